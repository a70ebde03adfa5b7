"""Tests for quant (OCP MX quantization): known values, a scalar reference, properties."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quant import (
    FORMATS,
    MXTensor,
    dequantize,
    element_values,
    fake_quantize,
    pack_fp4,
    pack_fp6,
    quantize,
    unpack_fp4,
    unpack_fp6,
)

F32 = np.float32

# Written from the spec table, independently of quant.mx: (ebits, mbits, bias) for the float
# formats; None marks MXINT8 (k / 64, k in [-127, 127]).
BITS = {"fp6_e2m3": (2, 3, 1), "fp6_e3m2": (3, 2, 3), "fp4_e2m1": (2, 1, 1), "int8": None}
MAX_NORMAL = {"fp6_e2m3": 7.5, "fp6_e3m2": 28.0, "fp4_e2m1": 6.0, "int8": 127 / 64}


# ----------------------------------------------------------------------------------------------
# Slow, obviously-correct scalar reference: nearest point of the explicit grid, exact fractions.


def ref_grid(fmt: str) -> list[tuple[Fraction, int]]:
    """(magnitude, code) of every non-negative code, straight from the bit-field definition."""
    if BITS[fmt] is None:
        return [(Fraction(k, 64), k) for k in range(128)]
    ebits, mbits, bias = BITS[fmt]
    grid = []
    for efield in range(2**ebits):
        for m in range(2**mbits):
            if efield == 0:
                val = Fraction(m, 2**mbits) * Fraction(2) ** (1 - bias)
            else:
                val = (1 + Fraction(m, 2**mbits)) * Fraction(2) ** (efield - bias)
            grid.append((val, (efield << mbits) | m))
    return grid


def ref_quantize_block(block: list[float], fmt: str, rounding: str) -> tuple[int, list[int]]:
    """Scale byte and codes of one block, one element at a time."""
    grid = ref_grid(fmt)
    emax_elem = math.frexp(float(max(g for g, _ in grid)))[1] - 1
    amax = max(abs(v) for v in block)
    if amax == 0:
        shared, byte = -127, 0
    else:
        shared = min(max(math.frexp(amax)[1] - 1 - emax_elem, -127), 127)
        byte = shared + 127
    codes = []
    for v in block:
        y = abs(Fraction(v)) / Fraction(2) ** shared
        best_val, best_code = grid[0]
        for val, code in grid[1:]:
            d_new, d_best = abs(val - y), abs(best_val - y)
            # On a tie between neighbours take the larger one (away) or the even code (even).
            tie_wins = d_new == d_best and (rounding == "away" or code % 2 == 0)
            if d_new < d_best or tie_wins:
                best_val, best_code = val, code
        negative = math.copysign(1.0, v) < 0
        if BITS[fmt] is None:
            codes.append((-best_code if negative else best_code) & 0xFF)
        else:
            nbits = sum(BITS[fmt][:2]) + 1
            codes.append(best_code | (int(negative) << (nbits - 1)))
    return byte, codes


def _reference_blocks(fmt: str, rng: np.random.Generator) -> np.ndarray:
    """Blocks rich in ties, saturation, subnormals and values just below powers of two."""
    grid = np.array([float(g) for g, _ in ref_grid(fmt)])
    mids = (grid[1:] + grid[:-1]) / 2
    emax = math.frexp(grid.max())[1] - 1
    rows = []
    for i in range(8):
        s = int(rng.integers(-60, 60))
        ties = rng.choice(mids, 12) * rng.choice([-1, 1], 12)
        exact = rng.choice(grid, 6) * rng.choice([-1, 1], 6)
        noise = rng.standard_normal(8) * 2.0 ** (emax - 1)
        # bf16-like: 8 significant bits, so ties at the element grid are common
        bf16 = (rng.standard_normal(5) * 2.0 ** (emax - 1)).astype(F32)
        bf16 = (bf16.view(np.uint32) & np.uint32(0xFFFF0000)).view(F32)
        lead = [
            grid.max() * rng.uniform(1, 2**0.99) if i % 4 < 2 else 1.0,  # amax, saturating
            np.nextafter(F32(2.0 ** (emax + 1)), F32(0)),  # amax in rows 2, 3, 6, 7
            0.0,
            -0.0,
            np.nextafter(F32(2.0 ** (emax - 1)), F32(0)),  # an element rounding up a binade
            float(mids[-1]),  # tie at the top of the grid: saturates
            grid.max() / 2 ** (i % 2),  # exactly max normal, or half of it
        ]
        row = np.concatenate([lead, ties, exact, noise, bf16])[:32]
        rows.append(np.ldexp(row, s).astype(F32))
    return np.stack(rows)


@pytest.mark.parametrize("rounding", ["even", "away"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_scalar_reference_bit_for_bit(fmt: str, rounding: str) -> None:
    rng = np.random.default_rng(2 * FORMATS.index(fmt) + (rounding == "away"))
    x = _reference_blocks(fmt, rng)
    q = quantize(x, fmt, axis=-1, rounding=rounding)
    for row in range(x.shape[0]):
        byte, codes = ref_quantize_block([float(v) for v in x[row]], fmt, rounding)
        assert q.scales[row, 0] == byte, (row, x[row])
        np.testing.assert_array_equal(q.codes[row], np.array(codes, np.uint8), err_msg=str(row))


@pytest.mark.parametrize("fmt", ["fp6_e2m3", "fp6_e3m2", "fp4_e2m1"])
def test_elements_match_ml_dtypes_casts(fmt: str) -> None:
    """Third-party cross-check of round-half-even and saturation (ml_dtypes saturates too)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    target = {
        "fp6_e2m3": ml_dtypes.float6_e2m3fn,
        "fp6_e3m2": ml_dtypes.float6_e3m2fn,
        "fp4_e2m1": ml_dtypes.float4_e2m1fn,
    }[fmt]
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 96)) * np.exp2(rng.integers(-20, 20, (64, 1)))).astype(F32)
    bf16 = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(F32)
    for data in (x, bf16):
        q = quantize(data, fmt)
        scaled = np.ldexp(data.astype(np.float64), -_elem_shared_exp(q)).astype(F32)
        np.testing.assert_array_equal(q.codes, scaled.astype(target).view(np.uint8))


# ----------------------------------------------------------------------------------------------
# Known values


def _elem_shared_exp(q: MXTensor) -> np.ndarray:
    """Shared exponent of each original element, in the original layout."""
    s = q.scales.astype(np.int64) - 127
    s = np.repeat(s, q.block_size, axis=-1)[..., : q.shape[q.axis]]
    return np.moveaxis(s, -1, q.axis)


def _fq_scale1(values: list[float], fmt: str, amax: float, rounding: str) -> np.ndarray:
    """Quantize `values` in a block whose amax pins the shared scale to 2^0."""
    x = np.array([amax, *values], F32)
    q = quantize(x, fmt, rounding=rounding)
    assert q.scales.tolist() == [127]
    return dequantize(q)[1:]


def test_e2m3_ties_both_ways() -> None:
    vals = [1.0625, 1.1875, -1.0625, 2.125, 2.375, 0.9375, 1.9375, 1.96875, 1.03125]
    even = _fq_scale1(vals, "fp6_e2m3", 4.0, "even")
    away = _fq_scale1(vals, "fp6_e2m3", 4.0, "away")
    # 1.0625: tie at an even mantissa (1.0, m=0) -> down; 1.1875: tie at an odd one -> up;
    # 1.9375 / 1.96875 round up into the next binade: 2.0.
    np.testing.assert_array_equal(even, [1.0, 1.25, -1.0, 2.0, 2.5, 1.0, 2.0, 2.0, 1.0])
    np.testing.assert_array_equal(away, [1.125, 1.25, -1.125, 2.25, 2.5, 1.0, 2.0, 2.0, 1.0])


def test_e3m2_ties_both_ways() -> None:
    vals = [1.125, 1.375, 5.0, 9.0, -11.0, 0.21875]
    even = _fq_scale1(vals, "fp6_e3m2", 16.0, "even")
    away = _fq_scale1(vals, "fp6_e3m2", 16.0, "away")
    np.testing.assert_array_equal(even, [1.0, 1.5, 5.0, 8.0, -12.0, 0.25])
    np.testing.assert_array_equal(away, [1.25, 1.5, 5.0, 10.0, -12.0, 0.25])


def test_carry_into_next_exponent_encodes_correctly() -> None:
    q = quantize(np.array([4.0, 1.96875, 3.9, -0.96875], F32), "fp6_e2m3")
    # 1.96875 -> 2.0 is code 0b0_10_000; 3.9 -> 4.0 is 0b0_11_000; -0.96875 -> -1.0 = 0b1_01_000
    assert q.codes[:4].tolist() == [0b011000, 0b010000, 0b011000, 0b101000]


def test_subnormals_e2m3() -> None:
    vals = [0.125, 0.1875, 0.0625, 0.3125, 0.875, -0.375, 0.03125]
    q = quantize(np.array([4.0, *vals], F32), "fp6_e2m3")
    assert q.codes[1:8].tolist() == [1, 2, 0, 2, 7, 32 | 3, 0]
    np.testing.assert_array_equal(
        _fq_scale1(vals, "fp6_e2m3", 4.0, "away"), [0.125, 0.25, 0.125, 0.375, 0.875, -0.375, 0.0]
    )


def test_subnormals_e3m2() -> None:
    vals = [0.0625, 0.1875, 0.03125, 0.09375, 0.21875]
    np.testing.assert_array_equal(
        _fq_scale1(vals, "fp6_e3m2", 16.0, "even"), [0.0625, 0.1875, 0.0, 0.125, 0.25]
    )
    np.testing.assert_array_equal(
        _fq_scale1(vals, "fp6_e3m2", 16.0, "away"), [0.0625, 0.1875, 0.0625, 0.125, 0.25]
    )


@pytest.mark.parametrize("k", [-120, -5, 0, 7, 100])
@pytest.mark.parametrize(
    ("fmt", "top", "sat"),
    [
        ("fp6_e2m3", 7.9, 7.5),
        ("fp6_e2m3", 7.75, 7.5),  # tie with the would-be 8.0
        ("fp6_e3m2", 31.0, 28.0),
        ("fp6_e3m2", 30.0, 28.0),  # tie: even rounds up to 32, then saturates
        ("fp4_e2m1", 7.0, 6.0),
        ("int8", 1.999, 127 / 64),
    ],
)
def test_saturates_never_overflows(fmt: str, top: float, sat: float, k: int) -> None:
    x = np.ldexp(np.array([top, -top, 1.0], np.float64), k).astype(F32)
    q = quantize(x, fmt)
    assert q.scales[0] == 127 + k  # floor(log2(top)) == emax for every `top` here
    np.testing.assert_array_equal(dequantize(q, np.float64)[:2], [sat * 2.0**k, -sat * 2.0**k])


def test_float32_max_saturates_without_inf() -> None:
    big = np.finfo(F32).max
    out = fake_quantize(np.array([big, -big], F32), "fp6_e2m3")
    np.testing.assert_array_equal(out, [7.5 * 2.0**125, -7.5 * 2.0**125])
    assert np.all(np.isfinite(fake_quantize(np.array([big], F32), "int8")))


def test_float64_beyond_e8m0_range_saturates() -> None:
    q = quantize(np.array([1e300, -1e300, 2.0**200], np.float64), "fp6_e2m3")
    assert q.scales[0] == 254  # shared exponent clamped to 127
    np.testing.assert_array_equal(
        dequantize(q, np.float64)[:3], np.array([1, -1, 1]) * 7.5 * 2.0**127
    )


@pytest.mark.parametrize("k", [2, 3, 20, -50])
def test_largest_float_below_power_of_two_uses_exact_floor_log2(k: int) -> None:
    x = np.nextafter(F32(2.0**k), F32(0))
    if k in (3, 20):
        assert np.floor(np.log2(x)) == k  # the trap: float32 log2 rounds up to k
    q = quantize(np.array([x, -x], F32), "fp6_e2m3")
    assert q.scales[0] == 127 + (k - 1) - 2  # floor(log2) = k - 1, emax = 2
    # x / 2^(k-3) = 7.99999 saturates to 7.5 (a log2-derived scale would give 4.0 -> 2^k)
    sat = 7.5 * 2.0 ** (k - 3)
    np.testing.assert_array_equal(dequantize(q, np.float64)[:2], [sat, -sat])
    q = quantize(np.array([np.nextafter(F32(32), F32(0))], F32), "fp6_e3m2")
    assert q.scales[0] == 127 + 4 - 4
    assert dequantize(q)[0] == 28.0
    q = quantize(np.array([np.nextafter(F32(2), F32(0))], F32), "int8")
    assert (q.scales[0], q.codes[0]) == (127, 127)


def test_tiny_block_clamps_scale_and_keeps_subnormal_elements() -> None:
    x = np.array([2.0**-128, 3 * 2.0**-132, 2.0**-140], F32)  # float32 subnormals
    q = quantize(x, "fp6_e2m3")
    assert q.scales[0] == 0  # floor(log2) - 2 = -130, clamped to -127
    np.testing.assert_array_equal(dequantize(q), [2.0**-128, 2.0**-130, 0.0])


def test_all_zero_blocks() -> None:
    x = np.zeros((2, 64), F32)
    x[1, 32:] = np.linspace(-1, 1, 32)
    q = quantize(x, "fp6_e2m3")
    assert q.scales.tolist() == [[0, 0], [0, 125]]  # amax 1: 0 - emax 2
    assert not q.codes[0].any() and not q.codes[1, :32].any()
    out = dequantize(q)
    assert not out[0].any() and not out[1, :32].any()
    assert out[1, 32:].any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_odd_length_pads_with_zero_codes_and_drops_them(fmt: str) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((45, 3)).astype(F32)
    x[32:] *= 1000  # the short second block gets its own scale from its 13 elements only
    q = quantize(x, fmt, axis=0)
    assert q.codes.shape == (3, 64) and q.scales.shape == (3, 2) and q.axis == 0
    assert q.codes.dtype == np.uint8 and q.scales.dtype == np.uint8
    assert not q.codes[:, 45:].any()
    assert np.all(q.scales[:, 1] > q.scales[:, 0] + 5)
    alone = quantize(x[32:], fmt, axis=0)
    np.testing.assert_array_equal(alone.scales[:, 0], q.scales[:, 1])
    np.testing.assert_array_equal(alone.codes[:, :13], q.codes[:, 32:45])
    out = dequantize(q)
    assert out.shape == (45, 3) and out.dtype == np.float32
    mbits = _MBITS_EMIN[fmt][0]
    for part in (slice(0, 32), slice(32, 45)):  # error <= 2^-mbits of the block's amax
        err = np.abs(out[part] - x[part])
        assert np.all(err <= 2.0**-mbits * np.abs(x[part]).max(axis=0))


@pytest.mark.parametrize("fmt", FORMATS)
def test_axis_0_and_last_agree_with_transposes(fmt: str) -> None:
    x = np.random.default_rng(4).standard_normal((70, 40)).astype(F32)
    q0, q1 = quantize(x, fmt, axis=0), quantize(x.T, fmt, axis=-1)
    np.testing.assert_array_equal(q0.codes, q1.codes)
    np.testing.assert_array_equal(q0.scales, q1.scales)
    np.testing.assert_array_equal(dequantize(q0), dequantize(q1).T)
    np.testing.assert_array_equal(fake_quantize(x, fmt, axis=0), fake_quantize(x.T, fmt).T)
    x3 = np.random.default_rng(5).standard_normal((3, 50, 4)).astype(F32)
    q = quantize(x3, fmt, axis=1)
    ref = quantize(np.moveaxis(x3, 1, -1), fmt, axis=-1)
    np.testing.assert_array_equal(q.codes, ref.codes)
    np.testing.assert_array_equal(dequantize(q), np.moveaxis(dequantize(ref), -1, 1))


def test_e2m3_values_are_int8_multiples_of_one_eighth() -> None:
    x = np.random.default_rng(6).standard_normal((64, 100)).astype(F32) * 0.05
    q = quantize(x, "fp6_e2m3", axis=0)
    k = np.ldexp(dequantize(q).astype(np.float64), 3 - _elem_shared_exp(q))
    np.testing.assert_array_equal(k, np.round(k))
    assert k.min() >= -60 and k.max() <= 60 and np.abs(k).max() > 30
    table = element_values("fp6_e2m3") * 8
    assert np.array_equal(table, np.round(table)) and np.abs(table).max() == 60


def test_element_values_tables() -> None:
    sizes = {"fp6_e2m3": 64, "fp6_e3m2": 64, "fp4_e2m1": 16, "int8": 256}
    for fmt in FORMATS:
        t = element_values(fmt)
        assert t.shape == (sizes[fmt],) and t.dtype == np.float32
        assert t.max() == MAX_NORMAL[fmt] and t[0] == 0
        np.testing.assert_array_equal(t, [float(v) for v in _ref_table(fmt)])
    e2m3 = element_values("fp6_e2m3")
    assert e2m3[1] == 0.125 and e2m3[8] == 1.0 and e2m3[16] == 2.0 and e2m3[32 | 31] == -7.5
    assert element_values("fp6_e3m2")[1] == 0.0625 and element_values("int8")[0x80] == -2.0
    element_values("int8")[0] = 5  # a copy: must not poison the cached table
    assert element_values("int8")[0] == 0


def _ref_table(fmt: str) -> list[Fraction]:
    mags = {code: val for val, code in ref_grid(fmt)}
    if BITS[fmt] is None:
        return [Fraction(c - 256 if c >= 128 else c, 64) for c in range(256)]
    half = len(mags)
    return [mags[c] if c < half else -mags[c - half] for c in range(2 * half)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_code_layout_round_trips_through_table(fmt: str) -> None:
    """Quantizing every representable value gives back its own code."""
    table = element_values(fmt)
    expected = np.arange(table.size, dtype=np.uint8)
    if fmt == "int8":
        # -2.0 (code 0x80) decodes but is never produced: as amax it doubles the block scale
        table[0x80], expected[0x80] = -127 / 64, 0x81
    q = quantize(table, fmt, block_size=table.size)  # one block, amax = max normal: scale 2^0
    assert q.scales[0] == 127
    np.testing.assert_array_equal(q.codes, expected)


def test_float16_float64_bfloat16_inputs_quantize_like_float32() -> None:
    x = np.random.default_rng(8).standard_normal((8, 64)).astype(np.float16)
    ref = quantize(x.astype(F32))
    for variant in (x, x.astype(np.float64)):
        q = quantize(variant)
        np.testing.assert_array_equal(q.codes, ref.codes)
        np.testing.assert_array_equal(q.scales, ref.scales)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    xb = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(quantize(xb).codes, quantize(xb.astype(F32)).codes)
    assert fake_quantize(x).dtype == np.float32


def test_nan_inf_rejected_with_tensor_name() -> None:
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((4, 40), F32)
        x[2, 33] = bad
        with pytest.raises(ValueError, match=r"layers\.0\.q_proj.*NaN/Inf.*\(2, 33\)"):
            quantize(x, name="layers.0.q_proj")
    with pytest.raises(ValueError, match="'tensor'.*NaN/Inf"):
        quantize(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="NaN/Inf"):
        fake_quantize(np.array([np.inf], F32), "int8")


def test_invalid_arguments_list_valid_choices() -> None:
    x = np.ones(8, F32)
    with pytest.raises(ValueError, match="fp6_e2m3, fp6_e3m2, fp4_e2m1, int8"):
        quantize(x, fmt="fp8")
    with pytest.raises(ValueError, match="even, away"):
        quantize(x, rounding="nearest")
    for bs in (0, -32, 2.5, True, "32"):
        with pytest.raises(ValueError, match="positive integer"):
            quantize(x, block_size=bs)
    with pytest.raises(ValueError, match="axis"):
        quantize(x, axis=1)
    with pytest.raises(ValueError, match="0-d"):
        quantize(np.float32(1))


def test_e8m0_nan_scale_and_shape_validation() -> None:
    q = quantize(np.ones(40, F32))
    nan_scales = q.scales.copy()
    nan_scales[1] = 255
    out = dequantize(MXTensor(q.codes, nan_scales, q.fmt, q.axis, q.block_size, q.shape))
    assert np.all(out[:32] == 1) and np.all(np.isnan(out[32:]))
    with pytest.raises(ValueError, match="codes shape"):
        MXTensor(q.codes[:32], q.scales, q.fmt, q.axis, q.block_size, q.shape)


def test_block_size_other_than_32() -> None:
    x = np.array([4.0, 1.0625, 0.5, 0.25, 64.0, 1.0], F32)
    q = quantize(x, block_size=4)
    assert q.scales.tolist() == [127, 131] and q.codes.shape == (8,)
    np.testing.assert_array_equal(dequantize(q), [4.0, 1.0, 0.5, 0.25, 64.0, 0.0])


# ----------------------------------------------------------------------------------------------
# Packing


def test_pack_known_bytes() -> None:
    assert pack_fp6(np.array([1, 2, 3, 4], np.uint8)).tolist() == [129, 48, 16]
    assert pack_fp6(np.array([63, 63, 63, 63], np.uint8)).tolist() == [255, 255, 255]
    assert pack_fp6(np.array([0, 63, 0, 0], np.uint8)).tolist() == [192, 15, 0]
    assert pack_fp6(np.array([0, 0, 63], np.uint8)).tolist() == [0, 240, 3]  # padded to 4
    assert unpack_fp6(np.array([129, 48, 16], np.uint8), 4).tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 5, 7, 31, 32, 33, 1001, 4096])
def test_pack_round_trip_and_size(count: int) -> None:
    codes = np.random.default_rng(count).integers(0, 64, count).astype(np.uint8)
    packed = pack_fp6(codes)
    assert packed.dtype == np.uint8 and packed.size == -(-count // 4) * 3
    if count % 4 == 0:
        assert packed.size == 0.75 * count
    np.testing.assert_array_equal(unpack_fp6(packed, count), codes)
    minimal = -(-count * 6 // 8)  # ONNX raw_data length is accepted too
    np.testing.assert_array_equal(unpack_fp6(packed[:minimal], count), codes)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 31, 32, 33, 1001])
def test_fp4_packs_two_codes_a_byte_low_nibble_first(count: int) -> None:
    """ONNX FLOAT4E2M1 raw_data: ceil(n / 2) bytes, the first code in the low 4 bits."""
    assert pack_fp4(np.array([1, 2, 15], np.uint8)).tolist() == [0x21, 0x0F]
    codes = np.random.default_rng(count).integers(0, 16, count).astype(np.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == np.uint8 and packed.size == -(-count // 2)
    np.testing.assert_array_equal(unpack_fp4(packed, count), codes)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_fp4(np.array([16], np.uint8))
    with pytest.raises(ValueError, match="do not hold"):
        unpack_fp4(np.zeros(packed.size + 1, np.uint8), count)


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\[0, 63\]"):
        pack_fp6(np.array([64], np.uint8))
    with pytest.raises(ValueError, match="do not hold"):
        unpack_fp6(np.zeros(6, np.uint8), 3)
    with pytest.raises(ValueError, match="do not hold"):
        unpack_fp6(np.zeros(2, np.uint8), 4)


def test_packing_matches_onnx_float6_raw_data() -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    x = np.random.default_rng(9).standard_normal(45).astype(F32)
    q = quantize(x, "fp6_e2m3")
    codes = q.codes[:45]
    values = dequantize(q) / np.exp2(_elem_shared_exp(q)).astype(F32)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    proto = onnx.helper.make_tensor(
        "w", onnx.TensorProto.FLOAT6E2M3, [45], values.astype(ml_dtypes.float6_e2m3fn), raw=True
    )
    ours = pack_fp6(codes)
    assert proto.raw_data == ours[: len(proto.raw_data)].tobytes()
    np.testing.assert_array_equal(numpy_helper.to_array(proto).view(np.uint8), codes)


def test_mxfp6_storage_is_6_25_bits_per_element() -> None:
    x = np.random.default_rng(10).standard_normal((256, 64)).astype(F32)
    q = quantize(x, axis=0)
    bits = (pack_fp6(q.codes).size + q.scales.size) * 8 / x.size
    assert bits == 6.25


# ----------------------------------------------------------------------------------------------
# Properties

_MBITS_EMIN = {"fp6_e2m3": (3, 0), "fp6_e3m2": (2, -2), "fp4_e2m1": (1, 0), "int8": (6, 0)}


@settings(max_examples=150, deadline=None)
@given(
    x=arrays(
        F32,
        st.tuples(st.integers(1, 6), st.integers(1, 70)),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
    ),
    fmt=st.sampled_from(FORMATS),
    rounding=st.sampled_from(["even", "away"]),
    axis=st.sampled_from([0, -1]),
)
def test_fake_quantize_idempotent_and_within_half_ulp(
    x: np.ndarray, fmt: str, rounding: str, axis: int
) -> None:
    q = quantize(x, fmt, axis=axis, rounding=rounding)
    fq = dequantize(q)
    assert fq.shape == x.shape and fq.dtype == np.float32
    np.testing.assert_array_equal(fake_quantize(fq, fmt, axis, rounding=rounding), fq)
    np.testing.assert_array_equal(fake_quantize(x, fmt, axis, rounding=rounding), fq)

    shared = _elem_shared_exp(q)
    y = np.ldexp(x.astype(np.float64), -shared)
    fy = np.ldexp(fq.astype(np.float64), -shared)
    mbits, emin = _MBITS_EMIN[fmt]
    ulp = np.ldexp(1.0, np.maximum(np.frexp(np.abs(y))[1] - 1, emin) - mbits)
    top = MAX_NORMAL[fmt]
    saturated = np.abs(y) > top
    assert np.all(np.abs(fy[saturated]) == top)
    assert np.all(np.sign(fy[saturated]) == np.sign(y[saturated]))
    assert np.all(np.abs(fy - y)[~saturated] <= ulp[~saturated] / 2)
    assert np.all(np.abs(fy) <= top)


# ----------------------------------------------------------------------------------------------
# Error-minimising block exponents (scale="min_error"): still standard MX, never worse per block.


def _block_sq_error(x: np.ndarray, fq: np.ndarray) -> np.ndarray:
    return ((x.astype(np.float64) - fq.astype(np.float64)) ** 2).reshape(x.shape[0], -1, 32).sum(-1)


@pytest.mark.parametrize("fmt", ["fp6_e2m3", "fp6_e3m2"])
def test_min_error_exponent_is_the_spec_one_or_one_above_and_never_errs_more(fmt: str) -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 256)) * rng.lognormal(size=(64, 1))).astype(F32)
    spec, best = quantize(x, fmt), quantize(x, fmt, scale="min_error")
    step = best.scales.astype(int) - spec.scales.astype(int)
    assert set(np.unique(step)) <= {0, 1}
    assert (step == 1).any() and (step == 0).any()  # both choices occur on ordinary data
    e_spec, e_best = _block_sq_error(x, dequantize(spec)), _block_sq_error(x, dequantize(best))
    assert np.all(e_best <= e_spec)
    assert e_best.sum() < e_spec.sum()
    # where the exponent stayed, the codes are the spec's codes: only the choice differs
    same = np.repeat(step == 0, 32, axis=-1)
    np.testing.assert_array_equal(best.codes[same], spec.codes[same])


def test_min_error_exponent_avoids_saturating_a_block() -> None:
    """amax / 2^shared in (7.5, 8) saturates under the spec's E2M3 exponent; one above does not."""
    x = np.full((1, 32), 0.5, dtype=F32)
    x[0, 0] = 7.9
    assert dequantize(quantize(x))[0, 0] == 7.5
    fq = dequantize(quantize(x, scale="min_error"))
    assert fq[0, 0] == 8.0 and _block_sq_error(x, fq).item() < _block_sq_error(x, dequantize(quantize(x))).item()


def test_unknown_scale_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown scale choice 'best'; valid: spec, min_error"):
        quantize(np.ones((1, 32), F32), scale="best")
