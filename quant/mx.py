"""OCP Microscaling (MX) block quantization in vectorised numpy (spec: shared/notes/mx-format.md).

Exponent arithmetic is exact: floor(log2) comes from frexp or the float's exponent bits and all
scaling is by powers of two, so results never depend on float log2 rounding (the microxcaling
Python path's off-by-one just below powers of two). float16/bfloat16/float32 inputs are processed
in float32, anything else in float64; both are exact.

Choices beyond the notes: the sign of an input that rounds to zero is kept (code 0x20 for fp6,
as ml_dtypes/ONNX casts do; padding is +0, code 0); MXINT8 is symmetric (k/64, |k| <= 127, as
microxcaling), though code 0x80 still decodes to -2.0.

measured: 0.55 s for 4096x11008 on this 2-core machine; 7B model extrapolation 1.4 min
(fp6_e2m3, axis 0, float32, steady state; the first call in a process took 0.6-2 s while the
machine was shared, i.e. up to ~5 min for 7B). Re-measure: `from quant.mx import benchmark`.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np

__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "SCALE_CHOICES",
    "MXTensor",
    "benchmark",
    "dequantize",
    "element_values",
    "fake_quantize",
    "quantize",
    "round_to_grid",
]

FORMATS = ("fp6_e2m3", "fp6_e3m2", "fp4_e2m1", "int8")
ROUNDINGS = ("even", "away")
# How a block's shared exponent is chosen. "spec": floor(log2(amax)) - emax, as the OCP spec and
# microxcaling do. "min_error": that exponent or the one above, whichever gives the block the smaller
# squared error (the spec's choice saturates the block's largest values when amax / 2^shared lies
# above the format's max normal, e.g. in (7.5, 8) for E2M3). The encoding is standard MX either way.
SCALE_CHOICES = ("spec", "min_error")

_SCALE_BIAS = 127
_SCALE_NAN = 255


@dataclass(frozen=True)
class _ElemFormat:
    """Element grid: magnitudes are r * 2^(e - mbits), e >= emin, r < 2^(mbits+1)."""

    nbits: int  # total bits including sign
    mbits: int  # fraction bits (for int8: fixed-point fraction bits)
    emin: int  # exponent of the smallest normal, also used by subnormals
    emax: int  # exponent of the largest normal; subtracted in the shared exponent
    is_int: bool  # two's complement codes instead of sign-magnitude

    @property
    def max_mag_code(self) -> int:
        # OCP FP6/FP4 have no Inf/NaN and MXINT8 is symmetric, so the top magnitude saturates.
        return (1 << (self.nbits - 1)) - 1


_SPECS: dict[str, _ElemFormat] = {
    "fp6_e2m3": _ElemFormat(nbits=6, mbits=3, emin=0, emax=2, is_int=False),
    "fp6_e3m2": _ElemFormat(nbits=6, mbits=2, emin=-2, emax=4, is_int=False),
    "fp4_e2m1": _ElemFormat(nbits=4, mbits=1, emin=0, emax=2, is_int=False),
    # MXINT8: k * 2^-6, k in [-127, 127]; emax 0 so amax / 2^shared lies in [1, 2).
    "int8": _ElemFormat(nbits=8, mbits=6, emin=0, emax=0, is_int=True),
}


@dataclass(frozen=True)
class MXTensor:
    """Quantized tensor: codes with `axis` moved last and padded to whole blocks."""

    codes: np.ndarray  # uint8 [..., nblocks * block_size]
    scales: np.ndarray  # uint8 E8M0 biased exponents [..., nblocks]
    fmt: str
    axis: int  # non-negative axis of the original tensor that was blocked
    block_size: int
    shape: tuple[int, ...]  # original shape

    def __post_init__(self) -> None:
        _spec(self.fmt)
        _check_block_size(self.block_size)
        nd = len(self.shape)
        if not 0 <= self.axis < nd:
            raise ValueError(f"axis {self.axis} out of range for shape {self.shape}")
        lead = self.shape[: self.axis] + self.shape[self.axis + 1 :]
        nblocks = -(-self.shape[self.axis] // self.block_size)
        if self.codes.shape != (*lead, nblocks * self.block_size):
            raise ValueError(f"codes shape {self.codes.shape} does not match shape {self.shape}")
        if self.scales.shape != (*lead, nblocks):
            raise ValueError(f"scales shape {self.scales.shape} does not match shape {self.shape}")


def _spec(fmt: str) -> _ElemFormat:
    try:
        return _SPECS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown MX format {fmt!r}; valid: {', '.join(FORMATS)}") from None


def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")


def _check_block_size(block_size: int) -> None:
    ok = isinstance(block_size, int | np.integer) and not isinstance(block_size, bool)
    if not ok or block_size < 1:
        raise ValueError(
            f"invalid block_size {block_size!r}; valid: any positive integer "
            "(32 is the OCP MX block size)"
        )


@functools.cache
def _table(fmt: str, dtype: type) -> np.ndarray:
    """Read-only code -> value lookup, cached because dequantize indexes it per element."""
    spec = _spec(fmt)
    codes = np.arange(1 << spec.nbits, dtype=np.int64)
    if spec.is_int:
        k = codes.astype(np.uint8).view(np.int8).astype(np.float64)
        vals = np.ldexp(k, -spec.mbits)
    else:
        mag = codes & spec.max_mag_code
        efield = mag >> spec.mbits
        frac = mag & ((1 << spec.mbits) - 1)
        # Subnormals (efield 0) lack the implicit bit but share the exponent emin.
        sig = np.where(efield == 0, frac, frac + (1 << spec.mbits))
        exp = np.maximum(efield, 1) - 1 + spec.emin - spec.mbits
        vals = np.ldexp(sig.astype(np.float64), exp.astype(np.int32))
        vals = np.where(codes >> (spec.nbits - 1) != 0, -vals, vals)
    out = vals.astype(dtype)
    out.flags.writeable = False
    return out


def element_values(fmt: str) -> np.ndarray:
    """float32 value of every code, indexed by code (a copy, so callers may modify it)."""
    return _table(fmt, np.float32).copy()


def _work_dtype(dtype: np.dtype) -> type:
    # float32 arithmetic is exact here for inputs that fit in float32 (only power-of-two scaling,
    # rint and small-integer ops); anything wider or integral goes through float64.
    if dtype in (np.float16, np.float32) or dtype.name == "bfloat16":
        return np.float32
    return np.float64


def _nonfinite_error(x: np.ndarray, name: str) -> ValueError:
    bad = ~np.isfinite(x)
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    return ValueError(
        f"tensor {name!r} contains NaN/Inf ({int(bad.sum())} non-finite values, first at "
        f"index {first}); MX quantization needs finite values"
    )


def _encode(y: np.ndarray, neg: np.ndarray, spec: _ElemFormat, rounding: str) -> np.ndarray:
    """Element codes for magnitudes `y` (already divided by the block scale); overwrites `y`.

    Written as in-place passes over few buffers: fresh full-size temporaries (page faults)
    cost more than the arithmetic here. Exponents come straight from the float bits.
    """
    finfo = np.finfo(y.dtype)
    nm, bias = finfo.nmant, finfo.maxexp - 1  # 23/127 or 52/1023
    itype = np.int32 if y.dtype == np.float32 else np.int64
    # Element exponent ey = max(floor(log2 y), emin), read from the bits of max(y, 2^emin)
    # (always a normal float, which also sends 0 and subnormals to emin).
    buf = np.maximum(y, y.dtype.type(2.0**spec.emin))
    e = buf.view(itype)
    e >>= nm
    e -= bias + spec.emin  # e = ey - emin >= 0
    # Magnitude code = (ey - emin) << mbits + r, r = round(y / 2^(ey - mbits)): this covers
    # subnormals (ey == emin, r < 2^mbits), normals (r holds the implicit bit) and a rounding
    # carry (r == 2^(mbits+1) reads as the next binade's first code) alike. ey > emax only for
    # float64 input beyond the E8M0 range; capping it at emax + 1 keeps the uint8 sum in range
    # and still above max_mag_code, so it saturates.
    cap = spec.emax + 1 - spec.emin
    code = np.minimum(e, cap, out=np.empty(e.shape, np.uint8), casting="unsafe")
    code <<= spec.mbits
    # 2^(mbits - ey) built from its bits; the exponent field stays in the normal range.
    np.subtract(bias + spec.mbits - spec.emin, e, out=e)
    e <<= nm
    y *= buf  # y is now the mantissa-scaled value t, exact
    if rounding == "even":
        r = np.rint(y, out=y)
    else:
        # floor + (frac >= 0.5) is exact; floor(t + 0.5) can round in the addition.
        r = np.floor(y, out=buf)
        y -= r
        r += y >= 0.5
    np.add(code, r, out=code, casting="unsafe")
    np.minimum(code, spec.max_mag_code, out=code)  # saturate: code order is value order
    if spec.is_int:
        np.negative(code, out=code, where=neg)  # uint8 wrap-around = two's complement
    else:
        sign = neg.view(np.uint8)
        sign <<= spec.nbits - 1
        code |= sign
    return code


def _block_error(y: np.ndarray, neg: np.ndarray, shared: np.ndarray, spec: _ElemFormat, fmt: str,
                 rounding: str) -> np.ndarray:
    """Squared error per block of magnitudes `y` [pre, nblocks, block, post] under exponents `shared`."""
    step = np.ldexp(y.dtype.type(1), shared)[:, :, None, :]
    codes = _encode(y / step, neg.copy(), spec, rounding)  # _encode writes sign bits into its `neg`
    decoded = np.abs(_table(fmt, y.dtype)[codes]) * step
    decoded -= y
    return np.square(decoded, out=decoded).sum(axis=2)


def _min_error_exponent(y: np.ndarray, neg: np.ndarray, shared: np.ndarray, spec: _ElemFormat, fmt: str,
                        rounding: str) -> np.ndarray:
    """Per block, the spec's shared exponent or the one above, whichever quantizes the block better."""
    above = np.minimum(shared + 1, _SCALE_BIAS)
    better = _block_error(y, neg, above, spec, fmt, rounding) < _block_error(y, neg, shared, spec, fmt, rounding)
    return np.where(better, above, shared).astype(np.int32)


def round_to_grid(x: np.ndarray, shared: np.ndarray, fmt: str, rounding: str = "even") -> np.ndarray:
    """The values `quantize` stores for `x` (float64) in blocks whose shared exponents are `shared`
    (unbiased, broadcast against x): for quantizers that choose the exponents themselves."""
    x = np.asarray(x, dtype=np.float64)
    step = np.ldexp(1.0, np.asarray(shared, dtype=np.int32))
    codes = _encode(np.abs(x) / step, np.signbit(x), _spec(fmt), rounding)
    return _table(fmt, np.float64)[codes] * step


def quantize(
    x: np.ndarray,
    fmt: str = "fp6_e2m3",
    axis: int = -1,
    block_size: int = 32,
    rounding: str = "even",
    name: str = "tensor",
    scale: str = "spec",
) -> MXTensor:
    """Quantize `x` into MX blocks of `block_size` consecutive elements along `axis`; `scale` picks
    each block's shared exponent (SCALE_CHOICES)."""
    spec = _spec(fmt)
    _check_rounding(rounding)
    if scale not in SCALE_CHOICES:
        raise ValueError(f"unknown scale choice {scale!r}; valid: {', '.join(SCALE_CHOICES)}")
    _check_block_size(block_size)
    block_size = int(block_size)
    arr = np.asarray(x)
    if arr.ndim == 0:
        raise ValueError(f"tensor {name!r}: cannot block a 0-d array")
    if not -arr.ndim <= axis < arr.ndim:
        raise ValueError(f"tensor {name!r}: axis {axis} out of range for shape {arr.shape}")
    ax = axis % arr.ndim
    work = _work_dtype(arr.dtype)

    # Work in the input's own layout, viewed as [pre, length, post]: moving the blocked axis
    # last is done on the uint8 codes at the end, a quarter of the bytes of a float32 transpose.
    shape = tuple(arr.shape)
    length = shape[ax]
    pre, post = math.prod(shape[:ax]), math.prod(shape[ax + 1 :])
    nblocks = -(-length // block_size)
    padded_len = nblocks * block_size
    # One copy: cast and zero-pad (pad zeros never change amax, and encode to code 0).
    blocks = np.zeros((pre, padded_len, post), dtype=work)
    blocks[:, :length] = arr.reshape(pre, length, post)
    blocks = blocks.reshape(pre, nblocks, block_size, post)

    neg = np.signbit(blocks)
    y = np.abs(blocks, out=blocks)  # in place: one full-size buffer less
    amax = y.max(axis=2)  # NaN propagates, Inf stays: one cheap per-block check
    if not np.isfinite(amax).all():
        raise _nonfinite_error(arr, name)

    # floor(log2(amax)) exactly: frexp mantissa is in [0.5, 1).
    amax_exp = np.frexp(amax)[1] - 1
    shared = np.clip(amax_exp - spec.emax, -_SCALE_BIAS, _SCALE_BIAS)
    shared = np.where(amax == 0, -_SCALE_BIAS, shared).astype(np.int32)
    if scale == "min_error":
        shared = _min_error_exponent(y, neg, shared, spec, fmt, rounding)
    scales = (shared + _SCALE_BIAS).astype(np.uint8)
    # y = |v| / 2^shared, exact (power-of-two multiply; underflow only hits values far below
    # the element grid's smallest step, which round to 0 either way).
    y *= np.ldexp(work(1), -shared)[:, :, None, :]
    codes = _encode(y, neg, spec, rounding).reshape(pre, padded_len, post)

    lead = shape[:ax] + shape[ax + 1 :]
    return MXTensor(
        codes=np.ascontiguousarray(codes.transpose(0, 2, 1)).reshape(*lead, padded_len),
        scales=np.ascontiguousarray(scales.transpose(0, 2, 1)).reshape(*lead, nblocks),
        fmt=fmt,
        axis=ax,
        block_size=block_size,
        shape=shape,
    )


def dequantize(t: MXTensor, dtype: type = np.float32) -> np.ndarray:
    """Decode back to the original shape and axis order (padding dropped)."""
    work = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    ax, shape, bs = t.axis, t.shape, t.block_size
    pre, post = math.prod(shape[:ax]), math.prod(shape[ax + 1 :])
    nblocks = t.scales.shape[-1]
    # Undo the axis move on the uint8 codes (cheap) so the float output is written in place.
    codes = t.codes.reshape(pre, post, nblocks * bs).transpose(0, 2, 1)
    scales = t.scales.reshape(pre, post, nblocks).transpose(0, 2, 1)
    nan = scales == _SCALE_NAN  # E8M0 0xFF is NaN, not 2^128
    scale = np.ldexp(work(1), np.where(nan, 0, scales.astype(np.int32) - _SCALE_BIAS))
    scale[nan] = np.nan
    vals = _table(t.fmt, work)[codes].reshape(pre, nblocks, bs, post)
    vals *= scale[:, :, None, :]
    vals = vals.reshape(pre, nblocks * bs, post)[:, : shape[ax]]
    return np.ascontiguousarray(vals, dtype=dtype).reshape(shape)


def fake_quantize(
    x: np.ndarray,
    fmt: str = "fp6_e2m3",
    axis: int = -1,
    block_size: int = 32,
    rounding: str = "even",
    scale: str = "spec",
) -> np.ndarray:
    """Quantize-dequantize, for accuracy studies that keep float32 kernels."""
    return dequantize(quantize(x, fmt, axis, block_size, rounding, scale=scale), np.float32)


def benchmark(
    rows: int = 4096, cols: int = 11008, fmt: str = "fp6_e2m3", axis: int = 0, repeats: int = 3
) -> list[float]:
    """Seconds per quantize of one Llama-7B MLP-sized float32 matrix (first call is coldest)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        quantize(w, fmt, axis)
        times.append(time.perf_counter() - start)
    per_param = 7e9 / (rows * cols) / 60
    print(
        f"measured: {times[0]:.2f} s (first call), {min(times):.2f} s (best of {repeats}) for "
        f"{rows}x{cols}; 7B model extrapolation {times[0] * per_param:.1f} / "
        f"{min(times) * per_param:.1f} min"
    )
    return times


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m quant.mx", description="How long quantizing one Llama-7B MLP-sized "
                                 "matrix takes, and what that makes of a 7B model's export.")
    ap.add_argument("--format", default="fp6_e2m3", choices=sorted(FORMATS))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    benchmark(fmt=args.format, repeats=args.repeats)
