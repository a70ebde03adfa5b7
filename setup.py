"""The one compiled part: ONNX Runtime custom ops (kernels/*.cc), built by `pip install`.

Optional: where no C++ compiler is found the install still succeeds, and the compiler falls back to
MatMulNBits for MX weights with a warning (kernels.library_path() is then None).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kernels._mxspd_ort",  # loaded by ONNX Runtime (register_custom_ops_library), never imported
            sources=["kernels/register.cc", "kernels/mx_matmul.cc", "kernels/mx_matmul_gpu.cc", "kernels/row_matmul.cc",
                     "kernels/attention.cc", "kernels/rotary.cc", "kernels/swiglu.cc"],
            depends=["kernels/ort_api.h", "kernels/exp.h", "kernels/prologue.h", "kernels/rotary.h",
                     "kernels/mx_gpu_layout.h", "kernels/mx_gpu_op.h"],
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
