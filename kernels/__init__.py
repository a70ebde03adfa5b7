"""mxspd's native ONNX Runtime ops (kernels/*.cc), built by `pip install` where a C++ compiler is found:

- `ai.mxspd::MXMatMul` reads MXFP6 weights at 6.25 bits per weight;
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
ROW_MATMUL = "RowMatMul"
ATTENTION = "Attention"
ROTARY_ATTENTION = "RotaryAttention"
ROTARY = "Rotary"
ROTARY_QKV = "RotaryQKV"
SWIGLU = "SwiGLU"
LIBRARY_STEM = "_mxspd_ort"
NATIVE_LOWERINGS = ("native", "native8")  # the MX lowerings (common.recipe.MX_LOWERINGS) that run these ops


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


@functools.cache
def preferred_mx_layout(path: Path | None = None) -> int:
    """The MXFP6 weight layout (kernels.layout.TRIPLES or PLANES) that the library at `path` (default: this
    installation's) multiplies fastest on this CPU; TRIPLES from a library older than the choice."""
    library = ctypes.CDLL(str(path or require_library()))
    ask = getattr(library, "mxspd_mx_preferred_layout", None)
    if ask is None:
        return TRIPLES
    ask.restype = ctypes.c_int64
    return int(ask())
