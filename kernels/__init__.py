"""mxspd's native ONNX Runtime ops (kernels/*.cc), built by `pip install` where a C++ compiler is found:

- `ai.mxspd::MXMatMul` reads MXFP6 weights at 6.25 bits per weight, MXFP4 at 4.25, MXINT8 at 8.25;
- `ai.mxspd::MXMatMulGPU` is the GPU target's MX matmul: its CUDA kernel (kernels/cuda/, a library of its own
  built with nvcc by `python -m kernels.cuda_build`) and, here, its CPU reference (for building and tests);
- `ai.mxspd::RowMatMul` (float32 weights) and `ai.mxspd::Attention` compute every row with the same
  arithmetic whatever else shares its call, so a compiled artifact is batch-invariant (a token's
  logits do not depend on the graph, the call's rows, or whether a key is cached or new).

Used by the compiler (to build and time graphs) and the runtime (to run them); neither needs torch.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from pathlib import Path

from kernels.layout import TRIPLES

DOMAIN = "ai.mxspd"
MX_MATMUL = "MXMatMul"
MX_MATMUL_GPU = "MXMatMulGPU"
ROW_MATMUL = "RowMatMul"
ATTENTION = "Attention"
ROTARY_ATTENTION = "RotaryAttention"
ATTENTION_HALF_KV = "AttentionHalfKV"  # the two over a float16 KV cache (compiler/half_kv.py)
ROTARY_ATTENTION_HALF_KV = "RotaryAttentionHalfKV"
ROTARY = "Rotary"
ROTARY_QKV = "RotaryQKV"
SWIGLU = "SwiGLU"
LIBRARY_STEM = "_mxspd_ort"
CUDA_LIBRARY = "_mxspd_ort_cuda.so"  # kernels/cuda_build.py writes it
NATIVE_LOWERINGS = ("native", "native8")  # the MX lowerings (common.recipe.MX_LOWERINGS) that run these ops
GPU_LOWERING = "gpu"  # what a native lowering becomes on the GPU target (MXMatMulGPU), as the manifest records it


class KernelsUnavailableError(RuntimeError):
    """The native kernel library was not built in this installation."""


def library_path() -> Path | None:
    """The built library, or None (no C++ compiler at install time, or a non-installed checkout)."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{LIBRARY_STEM}{suffix}"
        if path.is_file():
            return path
    return None


def require_library() -> Path:
    path = library_path()
    if path is None:
        raise KernelsUnavailableError(
            "mxspd's native kernel library (kernels/_mxspd_ort*.so) is not built in this installation. "
            "Reinstall with a C++ compiler present (`apt install g++`, then `pip install -e .`), or "
            "export with mx_lowering = 'fused' (ONNX Runtime's MatMulNBits; 9 bits per weight read)."
        )
    return path


def cuda_library_path() -> Path | None:
    """The GPU target's kernel library, where `python -m kernels.cuda_build` has built it."""
    path = Path(__file__).resolve().parent / CUDA_LIBRARY
    return path if path.is_file() else None


def require_cuda_library() -> Path:
    path = cuda_library_path()
    if path is None:
        raise KernelsUnavailableError(
            "this artifact's MX weights run on mxspd's CUDA kernel (MXMatMulGPU), whose library is not built here: "
            "run `python -m kernels.cuda_build` on this GPU machine (needs CUDA's compiler, nvcc), or export with "
            "mx_lowering = 'fused' (ONNX Runtime's 8-bit MatMulNBits)"
        )
    return path


@functools.cache
def uses_amx(path: Path | None = None) -> bool:
    """Whether the library at `path` (default: this installation's) multiplies MXMatMul's many-row int8 calls on
    AMX tiles on this machine (an Intel Xeon since Sapphire Rapids whose OS enables them, and
    MXSPD_KERNELS_NO_AMX unset); False from a library older than that path."""
    ask = getattr(ctypes.CDLL(str(path or require_library())), "mxspd_uses_amx", None)
    if ask is None:
        return False
    ask.restype = ctypes.c_int64
    return bool(ask())


def preferred_mx_layout(path: Path | None = None, activation_bits: int = 16) -> int:
    """The MXFP6 weight layout (kernels.layout.TRIPLES, PLANES or PLANES8) that the library at `path` (default:
    this installation's) multiplies fastest on this CPU with activations of `activation_bits`; from a library
    older than PLANES8 its choice for int16 (which it can run with either), and TRIPLES from one older than
    the choice."""
    library = ctypes.CDLL(str(path or require_library()))
    ask_for = getattr(library, "mxspd_mx_preferred_layout_for", None)
    if ask_for is not None:
        ask_for.restype, ask_for.argtypes = ctypes.c_int64, [ctypes.c_int64]
        return int(ask_for(activation_bits))
    ask = getattr(library, "mxspd_mx_preferred_layout", None)
    if ask is None:
        return TRIPLES
    ask.restype = ctypes.c_int64
    return int(ask())
