"""`python -m kernels.cuda_build [--out PATH] [--arch 80,90] [--check]`: build the GPU target's kernel library.

kernels/cuda/mx_matmul_gpu.cu (ai.mxspd::MXMatMulGPU on ONNX Runtime's CUDA provider) compiled with
CUDA's compiler, nvcc, into kernels/_mxspd_ort_cuda.so, which the runtime registers for ort-cuda
sessions (kernels.cuda_library_path). `pip install` does not build it (the CPU library needs only a C++
compiler); a GPU machine builds it once. nvcc is found on PATH, in /usr/local/cuda/bin, or in the
`nvidia-cuda-nvcc` wheel (`pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-crt`: the
compiler and the headers, no GPU needed). `--check` compiles without linking (what the tests run where
nvcc is installed). Device code for `--arch` (compute capabilities: 80 for A100, 90 for H100 and H200).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "cuda" / "mx_matmul_gpu.cu"
LIBRARY = HERE / "_mxspd_ort_cuda.so"
ARCHES = "80,90"


class NvccNotFoundError(FileNotFoundError):
    """No CUDA compiler on this machine."""


def nvcc() -> Path:
    """CUDA's compiler: PATH, /usr/local/cuda, or the nvidia-cuda-nvcc wheel (its headers from nvidia-cuda-runtime)."""
    found = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).is_file()), None)
    if found:
        return Path(found)
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        for candidate in sorted(Path(root).glob("cu*/bin/nvcc")):
            return candidate
    raise NvccNotFoundError("CUDA's compiler (nvcc) is not installed: put the CUDA toolkit's bin on PATH, or "
                            "`pip install nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-crt`")


def _include_dirs(compiler: Path) -> list[str]:
    """The wheel's nvcc finds cuda_runtime.h beside it in nvidia/cu*/include (nvidia-cuda-runtime's)."""
    include = compiler.parent.parent / "include"
    return [f"-I{include}"] if include.is_dir() else []


def build(out: Path = LIBRARY, arches: str = ARCHES, check: bool = False) -> Path:
    """Compile the CUDA op (into `out`, atomically; with `check`, an object file in a temporary folder)."""
    compiler = nvcc()
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arches.split(",")]
    flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC,-fvisibility=hidden", *gencode,
             *_include_dirs(compiler)]
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / ("check.o" if check else out.name)
        command = [str(compiler), *flags, *(["-c"] if check else ["-shared"]), str(SOURCE), "-o", str(target)]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ | {"PATH": os.environ.get(
            "PATH", "") + os.pathsep + str(compiler.parent)})
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(command)}):\n{done.stderr[-4000:]}")
        if check:
            return target.with_name("checked")
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.with_name(out.name + ".partial")
        shutil.copyfile(target, staged)
        staged.replace(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=LIBRARY)
    ap.add_argument("--arch", default=ARCHES, help="comma-separated compute capabilities")
    ap.add_argument("--check", action="store_true", help="compile only: does the source build with this nvcc?")
    args = ap.parse_args()
    try:
        path = build(args.out, args.arch, args.check)
    except (NvccNotFoundError, RuntimeError) as exc:
        sys.exit(f"error: {exc}")
    print("the CUDA kernels compile" if args.check else f"built {path}")


if __name__ == "__main__":
    main()
