"""mxspd's native MX kernel (kernels/mx_matmul.cc, ai.mxspd::MXMatMul): its values against a numpy
model of the documented arithmetic, batch invariance, both code paths, the lowering that emits it
and the fallback without it."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import kernels
from common.targets import TARGETS, session_options
from compiler import build
from compiler.mx_lowering import LoweringError, lower_model
from kernels.layout import (
    PLANES,
    PLANES8,
    TRIPLES,
    pack_columns,
    pack_fp4_columns,
    pack_int8_columns,
    pack_scales,
    unpack_columns,
)
from quant import element_values, fake_quantize
from quant.onnx_pass import MXPass, apply_passes, quantize_model
from tests.test_mx_graph import WEIGHT, matmul_model, renamed, weights

CPU = TARGETS["ort-cpu"]

needs_library = pytest.mark.skipif(kernels.library_path() is None, reason="native kernel library not built here")


def test_library_is_built_where_a_compiler_is():
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine: the install skips the native kernel")
    assert kernels.library_path() is not None, "pip install found a compiler but did not build kernels/_mxspd_ort"


def test_int8_layout_keeps_two_complement_codes_in_the_kernels_order():
    codes = np.random.default_rng(0).integers(-127, 128, (70, 19)).astype(np.int8)
    packed = pack_int8_columns(codes)
    assert packed.shape == (2, 3, 512) and packed.dtype == np.uint8  # 8.25 bits per weight with the scale
    chunk = packed[1, 1, 64 * 3: 64 * 4].view(np.int8)  # group 1 (columns 16-31), block 1, chunk 3
    # byte o: code 4q + 2 (o // 32) + o % 2 of column (o % 32) // 2; K = 70 and N = 19 padded with 0
    for o in (0, 1, 6, 7, 32, 33, 38):
        column, code = 16 + (o % 32) // 2, 32 + 12 + 2 * (o // 32) + o % 2
        assert chunk[o] == (codes[code, column] if column < 19 else 0), o
    assert packed[0, 0, :4].view(np.int8).tolist() == [*codes[:2, 0], *codes[:2, 1]]
    assert not packed[0, 2, 64 * 3:].any()  # block 2 from code 64 + 12 on: K padding


def test_layout_round_trips_every_code():
    codes = np.random.default_rng(0).integers(0, 64, (70, 37)).astype(np.uint8)
    packed = pack_columns(codes)
    assert packed.shape == (3, 3, 384)  # N = 37: 3 groups of 16; K = 70: 3 blocks; 6 bits per code
    np.testing.assert_array_equal(unpack_columns(packed, 70, 37), codes)
    scales = pack_scales(np.arange(3 * 37, dtype=np.uint8).reshape(3, 37))
    assert scales.shape == (3, 3, 16) and scales[2, 1, 4] == 37 + 36 and scales[2, 1, 5] == 127  # padding


def test_planes_layout_puts_each_code_where_the_avx2_path_reads_it():
    """Layout PLANES, as kernels/layout.py documents it: per pair of chunks, 32 bytes of chunk 2p's low
    nibbles, 32 of chunk 2p + 1's, then 32 bytes of top bits (from bit 7 down: bit 4, bit 5 of positions
    i and 32 + i of chunk 2p, then of 2p + 1)."""
    codes = np.random.default_rng(0).integers(0, 64, (70, 37)).astype(np.uint8)
    planes, triples = pack_columns(codes, PLANES), pack_columns(codes, TRIPLES)
    assert planes.shape == triples.shape == (3, 3, 384)  # the same 6 bits per code
    chunks = unpack_columns(triples, 70, 37)  # the codes; then each chunk byte's code, by the triples layout
    by_chunk = np.zeros((48, 96), np.uint8)
    by_chunk[:37, :70] = chunks.T
    block = by_chunk.reshape(3, 16, 3, 32).transpose(0, 2, 1, 3)[2, 1]  # group 2, block 1: [column, code]
    assert_planes(planes[2, 1], lambda q, o: block[(o % 32) // 2, 4 * q + 2 * (o // 32) + o % 2])
    with pytest.raises(ValueError, match="unknown MXFP6 layout 3"):
        pack_columns(codes, 3)


def assert_planes(got: np.ndarray, code_at) -> None:
    """A planes block's bits: chunk q's byte o holds code_at(q, o) (its low nibble in the pair's nibbles, its
    bits 4 and 5 in the pair's plane)."""
    for q, o in itertools.product(range(8), range(64)):
        code = code_at(q, o)
        pair, half, i, r = got[96 * (q // 2):], o // 32, o % 32, 2 * (q % 2) + o // 32
        assert (pair[32 * (q % 2) + i] >> (4 * half)) & 15 == code & 15, (q, o)
        assert (pair[64 + i] >> (7 - 2 * r)) & 1 == (code >> 4) & 1 and (pair[64 + i] >> (6 - 2 * r)) & 1 == code >> 5


def test_planes8_layout_puts_each_column_s_four_codes_in_one_32_bit_lane():
    """Layout PLANES8: PLANES' bits, with chunk byte o holding code 4q + o % 4 of column 4 (o // 32) +
    8 ((o % 32) // 16) + (o % 16) // 4: one column's 4 codes per 32-bit lane, columns 0-3 and 8-11 first."""
    codes = np.random.default_rng(1).integers(0, 64, (70, 37)).astype(np.uint8)
    planes8 = pack_columns(codes, PLANES8)
    padded = np.zeros((96, 48), np.uint8)
    padded[:70, :37] = codes
    block = padded[32:64, 32:48].T  # group 2, block 1: [column, code]
    assert_planes(planes8[2, 1],
                  lambda q, o: block[4 * (o // 32) + 8 * ((o % 32) // 16) + (o % 16) // 4, 4 * q + o % 4])
    assert not np.array_equal(planes8, pack_columns(codes, PLANES))  # the same bits, another order


def test_fp4_layout_puts_two_codes_in_a_byte_in_planes8_order():
    """MXFP4: chunk q's 32 bytes, byte i holding planes8's position i in bits 0-3 and 32 + i in bits 4-7."""
    codes = np.random.default_rng(2).integers(0, 16, (70, 37)).astype(np.uint8)
    packed = pack_fp4_columns(codes)
    assert packed.shape == (3, 3, 256) and packed.dtype == np.uint8  # 4.25 bits per weight with the scale
    padded = np.zeros((96, 48), np.uint8)
    padded[:70, :37] = codes
    block = padded[32:64, 32:48].T  # group 2, block 1: [column, code]
    for q, o in itertools.product(range(8), range(64)):
        column, code = 4 * (o // 32) + 8 * ((o % 32) // 16) + (o % 16) // 4, 4 * q + o % 4
        assert (packed[2, 1, 32 * q + o % 32] >> (4 * (o // 32))) & 15 == block[column, code], (q, o)
    assert not packed[:, 2, 32 * 2:].any() and packed[:, 2, :32 * 2].any()  # K = 70: block 2 from code 72 is padding


def mx_matmul_model(codes: np.ndarray, exps: np.ndarray, bits: int, shape: list, layout: int = TRIPLES,
                    wbits: int = 6) -> onnx.ModelProto:
    """MXMatMul on MXFP6 E2M3 codes (uint8, in `layout`), MXFP4 E2M1 codes (uint8, `wbits` 4: PLANES8's order)
    or MXINT8 codes (int8, exponents already holding the 2^-6)."""
    k, n = codes.shape
    wbits = 8 if codes.dtype == np.int8 else wbits
    node = helper.make_node("MXMatMul", ["a", "w", "s"], ["y"], domain=kernels.DOMAIN, K=k, N=n, activation_bits=bits,
                            weight_bits=wbits, **({} if wbits == 8 else {"layout": layout}))
    packed = {8: pack_int8_columns, 4: pack_fp4_columns}.get(wbits, lambda c: pack_columns(c, layout))(codes)
    graph = helper.make_graph(
        [node], "mx", [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(pack_scales(exps), "s")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)])


def session(model: onnx.ModelProto, threads: int = 2) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])


def reference(a: np.ndarray, codes: np.ndarray, exps: np.ndarray, bits: int, wbits: int = 6) -> np.ndarray:
    """The documented arithmetic in float64: activations rounded per block of 32 to `bits`-bit integers."""
    k = codes.shape[0]
    kb = -(-k // 32)
    qmax = 2.0 ** (bits - 1) - 1
    x = np.zeros((a.shape[0], kb * 32))
    x[:, :k] = a
    blocks = x.reshape(-1, kb, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True).astype(np.float32).astype(np.float64)
    step = np.where(amax > 0, (amax / qmax).astype(np.float32), 0).astype(np.float64)
    inv = np.where(amax > 0, (qmax / amax).astype(np.float32), 0).astype(np.float32)
    q = np.rint((blocks.astype(np.float32) * inv).astype(np.float32)).astype(np.float64) * step
    return q.reshape(-1, kb * 32)[:, :k] @ weight_values(codes, exps, wbits)


def weight_values(codes: np.ndarray, exps: np.ndarray, wbits: int = 6) -> np.ndarray:
    """float64 [K, N]: E2M3 (or, `wbits` 4, E2M1) values, or MXINT8 codes, times the blocks' 2^(e-127)."""
    values = (codes.astype(np.float64) if codes.dtype == np.int8
              else element_values("fp4_e2m1" if wbits == 4 else "fp6_e2m3")[codes])
    return values * np.ldexp(1.0, exps.astype(int) - 127).repeat(32, 0)[: codes.shape[0]]


def random_mx(k: int, n: int, seed: int = 0, wbits: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Random codes (E2M3, E2M1, or MXINT8's symmetric int8) and block exponents near 1."""
    rng = np.random.default_rng(seed)
    codes = (rng.integers(-127, 128, (k, n)).astype(np.int8) if wbits == 8
             else rng.integers(0, 2 ** wbits, (k, n)).astype(np.uint8))
    return codes, rng.integers(118, 132, (-(-k // 32), n)).astype(np.uint8) - (6 if wbits == 8 else 0)


@needs_library
@pytest.mark.parametrize("wbits,layout,bits", [(6, TRIPLES, 16), (6, PLANES, 16), (8, TRIPLES, 16), (6, TRIPLES, 8),
                                              (6, PLANES, 8), (6, PLANES8, 8), (8, TRIPLES, 8), (4, PLANES8, 8)],
                         ids=["mxfp6-triples", "mxfp6-planes", "mxint8", "mxfp6-triples-int8", "mxfp6-planes-int8",
                              "mxfp6-planes8-int8", "mxint8-int8", "mxfp4-int8"])
@pytest.mark.parametrize("k,n", [(96, 40), (70, 19), (576, 192)])
def test_values_follow_the_documented_arithmetic(bits, k, n, wbits, layout):
    codes, exps = random_mx(k, n, wbits=wbits)
    a = np.random.default_rng(1).standard_normal((6, k)).astype(np.float32)
    y = session(mx_matmul_model(codes, exps, bits, [6, k], layout, wbits)).run(None, {"a": a})[0]
    ref = reference(a, codes, exps, bits, wbits)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    exact = a.astype(np.float64) @ weight_values(codes, exps, wbits)
    err = np.abs(y - exact).max() / np.abs(exact).max()
    # int16 activations: within float32-accumulation noise of the exact product; int8: ~0.5% as MatMulNBits' level 4
    assert err < (1e-4 if bits == 16 else 2e-2), err
    assert err > (0 if bits == 16 else 1e-4)  # negative control: int8 really rounds coarser


@needs_library
@pytest.mark.parametrize("wbits,layout,bits", [(6, TRIPLES, 16), (8, TRIPLES, 16), (6, TRIPLES, 8), (6, PLANES8, 8),
                                              (8, TRIPLES, 8), (4, PLANES8, 8)],
                         ids=["mxfp6", "mxint8", "mxfp6-int8", "mxfp6-planes8-int8", "mxint8-int8", "mxfp4-int8"])
def test_a_row_gets_the_same_bits_whatever_shares_its_call(bits, wbits, layout):
    """Calls of 1 to 9 rows, and of 64 (the many-row path), give each row the bits it gets alone."""
    codes, exps = random_mx(576, 200, seed=3, wbits=wbits)
    a = np.random.default_rng(4).standard_normal((64, 576)).astype(np.float32)
    model = mx_matmul_model(codes, exps, bits, [None, 576], layout, wbits)
    s = session(model)
    full = s.run(None, {"a": a})[0]
    for m in (1, 2, 3, 4, 5, 8, 9, 13, 30):
        np.testing.assert_array_equal(s.run(None, {"a": a[:m]})[0], full[:m])
    np.testing.assert_array_equal(s.run(None, {"a": a[[7]]})[0], full[[7]])
    one_thread = session(model, threads=1)
    np.testing.assert_array_equal(one_thread.run(None, {"a": a})[0], full)
    batched = session(mx_matmul_model(codes, exps, bits, [1, 64, 576], layout, wbits)).run(None, {"a": a[None]})[0]
    np.testing.assert_array_equal(batched[0], full)


@needs_library
def test_non_finite_activations_stay_in_their_row():
    codes, exps = random_mx(64, 8)
    a = np.ones((3, 64), np.float32)
    a[1, 5] = np.nan
    y = session(mx_matmul_model(codes, exps, 16, [3, 64])).run(None, {"a": a})[0]
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()
    np.testing.assert_array_equal(y[0], y[2])


ROW_COUNTS = [*range(1, 26), 48, 61, 70]


@needs_library
def test_every_path_gives_the_same_bits(tmp_path):
    """The AVX-512, AVX2 and portable paths (chosen when the library loads) agree bit for bit: both
    weight formats and MXFP4, MXFP6 in every layout, both activation widths, every row count from 1 to 25 and two
    beyond (AVX-512 passes take 1 to 12 rows, AVX2 ones 1 to 6; from 16 rows for MXFP6 and 32 for MXINT8
    (int8 activations: 12, 24, and 64 for MXFP4) the AVX-512 path decodes each weight once per call, 8 blocks
    of K at a time, 16 with int8 activations: K = 600 is whole tiles and a partial one), odd and even column
    counts, MXINT8's code -128, NaN and subnormal block scales, and zero and NaN activation blocks. (On a CPU
    without AVX-512 VNNI and VBMI the first two runs take the same path.) Where AMX runs, int8 calls from 32 rows
    multiply on its tiles (passes of 16 rows: 61 and 70 end in a partial one; K's 19 blocks an odd count) and a
    fourth run without them must give the same bits."""
    rng = np.random.default_rng(6)
    # (weight bits, activation bits, layout); the codes of case i % 4 (then MXFP6 in PLANES, and int8 in PLANES8)
    cases = [*((w, a, TRIPLES) for w, a in itertools.product((6, 8), (16, 8))), (6, 16, PLANES), (6, 8, PLANES),
             (6, 8, PLANES8), (4, 8, PLANES8)]
    for i, (wbits, bits, layout) in enumerate(cases):
        codes, exps = random_mx(600, 33, seed=i % 4 if i < 6 else 1, wbits=wbits)  # 33 columns: pairs and an odd one
        if wbits == 8:
            codes[5, 3] = -128
        exps[1, 7] = 255  # NaN scale: column 7's outputs are NaN
        exps[:, 9] = 0  # subnormal scales (the vector paths' table lookup): column 9's outputs are subnormal
        onnx.save(mx_matmul_model(codes, exps, bits, [None, 600], layout, wbits), tmp_path / f"{i}.onnx")
    for rows in ROW_COUNTS:
        a = rng.standard_normal((rows, 600)).astype(np.float32)
        a[0, 32:64] = 0.0
        a[-1, 70] = np.nan if rows > 2 else a[-1, 70]
        np.save(tmp_path / f"a{rows}.npy", a)
    code = ("import sys, pathlib, numpy as np, onnxruntime as ort; from common.targets import session_options;"
            "d = pathlib.Path(sys.argv[1]);"
            f"s = [ort.InferenceSession(str(d / f'{{i}}.onnx'), session_options(2)) for i in range({len(cases)})];"
            "[sys.stdout.buffer.write(x.run(None, {'a': np.load(d / f'a{r}.npy')})[0].tobytes())"
            f" for x in s for r in {ROW_COUNTS}]")
    outs = every_path(code, str(tmp_path), paths=(*PATHS, NO_AMX))
    case = sum(ROW_COUNTS) * 33 * 4  # bytes per case
    assert len(outs[0]) == len(cases) * case and outs[0] == outs[1] == outs[2] == outs[3]
    assert outs[0][4 * case:6 * case] == outs[0][:2 * case]  # MXFP6 in any layout: the same bits
    assert outs[0][6 * case:7 * case] == outs[0][case:2 * case]
    fp4 = np.frombuffer(outs[0][7 * case:], np.float32)
    assert np.isfinite(fp4).mean() > 0.9 and not np.array_equal(fp4, np.frombuffer(outs[0][:case], np.float32))
    y = np.frombuffer(outs[0], np.float32)
    assert np.isnan(y).any() and np.isfinite(y).mean() > 0.9  # the NaN cases took effect, the rest did not
    tiny = np.abs(y[np.isfinite(y)])
    assert ((tiny > 0) & (tiny < np.finfo(np.float32).tiny)).any()  # and the subnormal ones


@needs_library
def test_amx_runs_only_where_the_cpu_has_it_and_the_variable_allows():
    """The library takes AMX's tiles only on a CPU that reports them (an OS may still not enable them: then
    neither run takes them), and never under MXSPD_KERNELS_NO_AMX: the bits tests above compare the two."""
    code = "import kernels; print(kernels.uses_amx())"
    default, without = every_path(code, paths=({}, NO_AMX))
    assert without == b"False\n"
    if "amx_int8" not in open("/proc/cpuinfo").read():
        assert default == b"False\n"


@needs_library
def test_scale_products_by_exponent_give_the_multiply_s_bits(tmp_path):
    """The AVX-512 many-row path forms a block's ws * xs by an integer add on the exponents where the call's
    activation scales and a tile's weight scales keep every product a normal float, else by a multiply
    (kernels/mx_matmul.cc, exponent_products): both must give the other paths' bits. Calls of 64 rows
    (every width's many-row path), none with a zero block, against tiles (pairs of 16 columns) of weight
    scales near 1 (they add; a group alone too); tiny and huge (they multiply); exactly at the bounds, the
    smallest product's exponent field 1 or the largest's 254 (they add), and one past them (they
    multiply); near 1 but one column's scale NaN or subnormal, in calls whose activations would let the
    tile add but for that scale (they multiply). (An add off by one exponent fails it, so does one taken
    everywhere, one whose bounds are one off, and one that lets a NaN or subnormal weight scale add.)"""
    rng = np.random.default_rng(12)
    spreads = {"wide": (-90, 91), "small": (-80, -30), "large": (20, 61)}  # 2^k times normal samples, per block
    acts = {name: (rng.standard_normal((64, 600)) * np.exp2(rng.integers(lo, hi, (64, 19))).repeat(32, axis=1)
                   [:, :600]).astype(np.float32) for name, (lo, hi) in spreads.items()}
    acts["wide"][:2] = rng.standard_normal((2, 600)) * np.exp2([[-90], [90]])  # rows at the extremes: their
    # blocks at the bounds weigh in their sums, so a product rounded wrongly there shows
    for j, a in enumerate(acts.values()):
        np.save(tmp_path / f"a{j}.npy", a)
    n = 32 * 9 + 16  # nine tiles, then a group alone (near 1)
    cases = [(6, 8, TRIPLES), (6, 16, TRIPLES), (8, 8, TRIPLES), (4, 8, PLANES8)]
    for i, (wbits, bits, layout) in enumerate(cases):
        bias = 127 + {6: 3, 4: 1, 8: 0}[wbits]  # ws = 2^(e8 - bias)
        fields = {}  # each call's activation scales' exponent fields (float32, as the kernel divides)
        for name, a in acts.items():
            xs = np.abs(np.pad(a, ((0, 0), (0, 8))).reshape(64, 19, 32)).max(axis=2) / np.float32(2 ** (bits - 1) - 1)
            fields[name] = (xs.view(np.uint32) >> 23).astype(int)
            assert fields[name].min() >= 1 and fields[name].max() <= 254  # every scale normal: the call may add
        low, high = 1 + bias - fields["wide"].min(), 254 + bias - fields["wide"].max()  # the e8 at either bound
        assert bias - 126 < low - 1 and high + 1 < 255  # the bound tiles' scales normal: the bound decides
        codes, exps = random_mx(600, n, seed=i, wbits=wbits)  # near 1 where not set below
        exps = exps.astype(int)
        tiles = {"near 1": None, "tiny": 10, "huge": 240, "low bound": low, "below it": low - 1, "high bound": high,
                 "above it": high + 1, "a NaN": None, "a subnormal": None}
        for t, e8 in enumerate(tiles.values()):
            exps[:, 32 * t : 32 * t + 32] = exps[:, 32 * t : 32 * t + 32] if e8 is None else e8
        nan, sub = 32 * list(tiles).index("a NaN"), 32 * list(tiles).index("a subnormal")
        exps[:, nan + 5], exps[:, sub + 9] = 255, bias - 127  # ws NaN; ws 2^-127, subnormal
        for tile, call in ((nan, "small"), (sub, "large")):  # the activations' bounds alone would let them add
            e8 = exps[:, tile : tile + 32]
            assert fields[call].min() + e8.min() - bias >= 1 and fields[call].max() + e8.max() - bias <= 254
        onnx.save(mx_matmul_model(codes, exps.astype(np.uint8), bits, [64, 600], layout, wbits), tmp_path / f"{i}.onnx")
    code = ("import sys, pathlib, numpy as np, onnxruntime as ort; from common.targets import session_options;"
            "d = pathlib.Path(sys.argv[1]);"
            f"s = [ort.InferenceSession(str(d / f'{{i}}.onnx'), session_options(2)) for i in range({len(cases)})];"
            f"[sys.stdout.buffer.write(x.run(None, {{'a': np.load(d / f'a{{j}}.npy')}})[0].tobytes())"
            f" for x in s for j in range({len(acts)})]")
    outs = every_path(code, str(tmp_path), paths=(*PATHS, NO_AMX))
    assert len(outs[0]) == len(cases) * len(acts) * 64 * n * 4 and outs[0] == outs[1] == outs[2] == outs[3]
    y = np.frombuffer(outs[0], np.float32).reshape(len(cases), len(acts), 64, n)[:, 0]  # the wide call
    added = np.concatenate([y[:, :, :32], y[:, :, -16:]], axis=2)
    assert np.isfinite(added).all() and (added != 0).mean() > 0.99  # the tiles that add: real sums


@needs_library
@pytest.mark.parametrize("wbits,layout", [(6, TRIPLES), (6, PLANES), (6, PLANES8), (4, PLANES8), (8, TRIPLES)],
                         ids=["triples", "planes", "planes8", "mxfp4", "mxint8"])
def test_the_largest_int8_products_are_exact_on_the_many_row_path(wbits, layout):
    """int8 activations at +-127 against MXFP6 weights at +-60 (their largest magnitudes, signs mixed):
    the AVX2 many-row path's biased vpmaddubsw pairs reach 2 x 255 x 60 = 30,600 and must not saturate
    (2^15 - 1), nor PLANES8's one-row sums of two chunks' pairs (4 x 127 x 60 = 30,480 where a column's
    weights and a row's activations share their signs: column 0 and row 0): a 70-row call gives each row
    the bits it gets alone, and the exact products to float32 rounding (a saturated pair would be off by
    thousands of steps). MXFP4 at +-12 (2 x 6): the AVX2 many-row path's biased pairs of 4 chunks summed in
    int16, 4 x 2 x 255 x 12 = 24,480 (row 0 and column 0; 8 chunks would wrap), and its one-row loop's
    weights + 12 by the activations, 4 chunks in int16: 4 x 2 x 24 x 127 = 24,384.
    70 rows: every many-row loop (AVX-512 takes MXFP4's from 64).
    MXINT8 at 127 / -128 (the AVX-512 path's biased vpdpbusd: 4 x 255 x 128 per lane, in int32)."""
    k, n = 64, 32
    rng = np.random.default_rng(9)
    # +60 / -60 (8 x 7.5); MXFP4 +12 / -12 (2 x 6); MXINT8 127 / -128
    top, negative = {6: (31, 63), 4: (7, 15), 8: (127, -128)}[wbits]
    codes = np.where(rng.random((k, n)) < 0.5, top, negative).astype(np.int8 if wbits == 8 else np.uint8)
    exps = np.full((k // 32, n), 127, np.uint8)
    a = np.where(rng.random((70, k)) < 0.5, 1.0, -1.0).astype(np.float32)  # every activation +-127 after rounding
    a[:, ::2] = 1.0
    codes[:, 0], a[0] = top, 1.0
    s = session(mx_matmul_model(codes, exps, 8, [None, k], layout, wbits))
    y = s.run(None, {"a": a})[0]
    np.testing.assert_array_equal(y, np.concatenate([s.run(None, {"a": a[[r]]})[0] for r in range(70)]))
    np.testing.assert_allclose(y, a.astype(np.float64) @ weight_values(codes, exps, wbits), atol=1e-5)


@needs_library
def test_the_preferred_layout_is_the_one_the_chosen_path_decodes():
    """TRIPLES only where the AVX-512 VBMI path runs (its byte permutes); PLANES for AVX2 and the rest, PLANES8
    with int8 activations on AVX2 (its vpmaddubsw loop)."""
    widest, avx2, portable = every_path("import kernels; print(kernels.preferred_mx_layout(), "
                                        "kernels.preferred_mx_layout(activation_bits=8))")
    assert avx2 == f"{PLANES} {PLANES8}\n".encode() and portable == f"{PLANES} {PLANES}\n".encode()
    if "avx512vbmi" not in open("/proc/cpuinfo").read():
        assert widest == avx2


def test_a_library_older_than_planes8_gets_its_own_choice(monkeypatch, tmp_path):
    """A library that only answers for int16 (before PLANES8) is asked that, whatever the activations: it
    cannot read PLANES8 (matmul_rows --baseline OLD.so); one older still gets TRIPLES."""
    class Old:
        def __init__(self, answers: bool) -> None:
            if answers:
                self.mxspd_mx_preferred_layout = lambda: PLANES

    for answers, want in ((True, PLANES), (False, TRIPLES)):
        monkeypatch.setattr(kernels.ctypes, "CDLL", lambda path, a=answers: Old(a))
        assert kernels.preferred_mx_layout(tmp_path / f"old{answers}.so", activation_bits=8) == want


PATHS = ({}, {"MXSPD_KERNELS_AVX2": "1"}, {"MXSPD_KERNELS_PORTABLE": "1"})  # widest the CPU has, AVX2, scalar
NO_AMX = {"MXSPD_KERNELS_NO_AMX": "1"}  # the widest path less AMX's tiles (the same as the first where it has none)


def every_path(code: str, *args: str, stdin: bytes = b"", paths: tuple[dict[str, str], ...] = PATHS) -> list[bytes]:
    """What `python -c code args` prints with each of the library's code paths (`paths`), in that order."""
    outs = []
    for path in paths:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MXSPD_KERNELS_")} | path
        outs.append(subprocess.run([sys.executable, "-c", code, *args], env=env, check=True, input=stdin,
                                   capture_output=True).stdout)
    return outs


@needs_library
def test_bad_shapes_are_refused_with_a_message():
    codes, exps = random_mx(64, 8)
    model = mx_matmul_model(codes, exps, 16, [2, None])
    with pytest.raises(Exception, match="last dimension of A must equal attribute K"):
        session(model).run(None, {"a": np.ones((2, 65), np.float32)})
    bits = next(a for a in model.graph.node[0].attribute if a.name == "activation_bits")
    layout = next(a for a in model.graph.node[0].attribute if a.name == "layout")
    bits.i = 4
    with pytest.raises(Exception, match="activation_bits must be 8 or 16"):
        session(model)
    bits.i, next(a for a in model.graph.node[0].attribute if a.name == "weight_bits").i = 16, 5
    with pytest.raises(Exception, match="weight_bits must be 4"):
        session(model)
    next(a for a in model.graph.node[0].attribute if a.name == "weight_bits").i = 4  # MXFP4: int8 and PLANES8 only
    with pytest.raises(Exception, match="weight_bits 4 .MXFP4. needs activation_bits 8 and layout 2"):
        session(model)
    bits.i = 8
    with pytest.raises(Exception, match="weight_bits 4 .MXFP4. needs activation_bits 8 and layout 2"):
        session(model)  # layout 0
    layout.i = PLANES8
    session(model)  # MXFP4 attributes, but MXFP6's 384 bytes a block
    with pytest.raises(Exception, match=r"256 \(weight_bits 4\)"):
        session(model).run(None, {"a": np.ones((2, 64), np.float32)})
    bits.i, layout.i = 16, TRIPLES
    next(a for a in model.graph.node[0].attribute if a.name == "weight_bits").i = 6
    layout.i = 3
    with pytest.raises(Exception, match="layout must be 0"):
        session(model)
    layout.i = PLANES8  # int8 activations and MXFP6 only
    with pytest.raises(Exception, match="with activation_bits 8 too, 2"):
        session(model)
    bits.i = 8
    session(model)
    next(a for a in model.graph.node[0].attribute if a.name == "weight_bits").i = 8
    with pytest.raises(Exception, match="with activation_bits 8 too, 2"):
        session(model)
    next(a for a in model.graph.node[0].attribute if a.name == "weight_bits").i, bits.i = 6, 16
    layout.i = PLANES
    session(model)
    next(a for a in model.graph.node[0].attribute if a.name == "weight_bits").i = 8  # MXINT8 has one layout
    with pytest.raises(Exception, match="with weight_bits 6, 1"):
        session(model)
    next(a for a in model.graph.node[0].attribute if a.name == "weight_bits").i = 6
    model.graph.node[0].attribute.extend([helper.make_attribute("prologue", 2), helper.make_attribute("epsilon", 1e-5)])
    with pytest.raises(Exception, match="required input is missing"):  # a residual norm without skip and gamma
        session(model).run(None, {"a": np.ones((2, 64), np.float32)})


@needs_library
@pytest.mark.parametrize("lowering", ["native", "native8"])
def test_native_lowering_runs_mxmatmul_on_the_mx_values(lowering, tmp_path):
    w = weights(96, 40)
    model = matmul_model(w)
    quantize_model(model)
    assert lower_model(model, lowering) == {WEIGHT: "fp6_e2m3"}
    assert [(n.op_type, n.domain) for n in model.graph.node] == [("MXMatMul", kernels.DOMAIN)]
    layout = next(a.i for a in model.graph.node[0].attribute if a.name == "layout")
    # the weights in the layout this machine reads fastest with these activations
    assert layout == kernels.preferred_mx_layout(activation_bits=16 if lowering == "native" else 8)
    build._check_lowered(model, "decode", lowering, {WEIGHT: "fp6_e2m3"})
    x = np.random.default_rng(2).standard_normal((1, 3, 96)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), session_options(),
                             providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    exact = x @ fake_quantize(w, "fp6_e2m3", axis=0)
    np.testing.assert_allclose(y, exact, rtol=0, atol=(1e-4 if lowering == "native" else 2e-2) * np.abs(exact).max())


@pytest.mark.parametrize("lowering", ["native", "native8", "fused", "exact"])
def test_every_lowering_runs_an_mxint8_lm_head_on_its_mx_values(lowering):
    """A recipe's mx_int8 = ["lm_head"]: INT8 codes + E8M0 exponents holding the 2^-6 (standard
    DequantizeLinear gives exactly the MX values), then each lowering of them."""
    if lowering.startswith("native") and kernels.library_path() is None:
        pytest.skip("native kernel library not built here")
    w = weights(96, 40)
    model = renamed(matmul_model(w), "lm_head.weight.T")
    mx = MXPass(int8=("lm_head",))
    assert apply_passes(model, [mx]) == 1 and mx.summary().int8_tensors == 1 and mx.summary().lm_head
    stored = {t.name: t.data_type for t in model.graph.initializer}
    assert stored["lm_head.weight.T.mx_codes"] == onnx.TensorProto.INT8
    x = np.random.default_rng(2).standard_normal((1, 3, 96)).astype(np.float32)
    exact = x @ fake_quantize(w, "int8", axis=0)
    np.testing.assert_array_equal(ReferenceEvaluator(model).run(None, {"x": x})[0], exact)  # the portable graph
    assert lower_model(model, lowering) == {"lm_head.weight.T": "int8"}
    y = ort.InferenceSession(model.SerializeToString(), session_options(),
                             providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # int8 activations; int16 ones; float32 sums of the exact values
    tol = {"native8": 2e-2, "fused": 2e-2, "native": 1e-4}.get(lowering, 1e-5)
    np.testing.assert_allclose(y, exact, rtol=0, atol=tol * np.abs(exact).max())


@pytest.mark.parametrize("lowering", ["native", "native8", "fused", "exact"])
@pytest.mark.parametrize("k,n", [(96, 40), (70, 19)])  # whole blocks and groups; a padded K and an odd K x N
def test_every_lowering_runs_mxfp4_weights_on_their_mx_values(lowering, k, n):
    """MXFP4 E2M1: standard FLOAT4 DequantizeLinear blocks (the ONNX reference gives exactly the MX values),
    then each lowering; both native ones become MXMatMul with 4-bit weights and int8 activations."""
    if lowering.startswith("native") and kernels.library_path() is None:
        pytest.skip("native kernel library not built here")
    w = weights(k, n)
    model = matmul_model(w)
    quantize_model(model, "fp4_e2m1")
    assert {t.name: t.data_type for t in model.graph.initializer}[WEIGHT + ".mx_codes"] == onnx.TensorProto.FLOAT4E2M1
    x = np.random.default_rng(2).standard_normal((1, 3, k)).astype(np.float32)
    exact = x @ fake_quantize(w, "fp4_e2m1", axis=0)
    np.testing.assert_allclose(ReferenceEvaluator(model).run(None, {"x": x})[0], exact, rtol=1e-6)
    assert np.abs(exact - x @ w).max() > 1e-2 * np.abs(exact).max()  # 4 bits: far coarser than the float weights
    assert lower_model(model, lowering) == {WEIGHT: "fp4_e2m1"}
    if lowering.startswith("native"):
        attrs = {a.name: a.i for a in model.graph.node[0].attribute}
        assert (attrs["weight_bits"], attrs["activation_bits"], attrs["layout"]) == (4, 8, PLANES8)
        assert next(t for t in model.graph.initializer if t.name.endswith(".mx6")).dims[-1] == 256  # 4 bits a code
    y = ort.InferenceSession(model.SerializeToString(), session_options(),
                             providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    tol = 1e-5 if lowering == "exact" else 2e-2  # int8 activations (fused and native)
    np.testing.assert_allclose(y, exact, rtol=0, atol=tol * np.abs(exact).max())


def test_the_gpu_lowering_refuses_mxfp4():
    model = matmul_model(weights(96, 40))
    quantize_model(model, "fp4_e2m1")
    with pytest.raises(LoweringError, match="reads fp6_e2m3 and MXINT8 only, not fp4_e2m1"):
        lower_model(model, kernels.GPU_LOWERING)


def test_without_the_library_the_compiler_falls_back_and_the_runtime_says_why(monkeypatch):
    monkeypatch.setattr(build, "library_path", lambda: None)
    with pytest.warns(UserWarning, match="falling back to 'fused'"):
        assert build.effective_lowering("native", CPU) == "fused"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build.effective_lowering("exact", CPU) == "exact"
    monkeypatch.setattr(kernels, "library_path", lambda: None)
    with pytest.raises(kernels.KernelsUnavailableError, match="mx_lowering = 'fused'"):
        kernels.require_library()


@needs_library
def test_matmul_rows_compares_two_builds_on_the_same_values(capsys):
    """benchmarks.matmul_rows --baseline: both libraries in one process, their values checked equal."""
    from benchmarks.matmul_rows import main as matmul_rows
    from benchmarks.matmul_rows import stack

    common = ["--kinds", "mxfp6 native,mxint8 native", "--layers", "1", "--repeats", "1", "--threads", "1"]
    matmul_rows([*common, "--columns", "32", "--baseline", str(kernels.library_path())])
    report = json.loads(capsys.readouterr().out)
    for kind in ("mxfp6 native", "mxint8 native"):
        assert set(report[kind]["speedup_over_baseline"]) == set(report[kind]["ms"]) == {"1", "2", "3", "5", "9"}
    # --depth: each weight K x N (a real model's shape); the input follows it, or the session would fail
    matmul_rows([*common, "--columns", "32", "--depth", "96"])
    assert set(json.loads(capsys.readouterr().out)["mxfp6 native"]["ms"]) == {"1", "2", "3", "5", "9"}
    node = stack("mxfp6 native", 1, 32, k=96)[0].graph.node[0]
    assert {a.name: a.i for a in node.attribute}["K"] == 96
    for bad, message in ((["--columns", "100"], "--columns must be a positive multiple of 16"),
                         (["--depth", "100"], "--depth must be a positive multiple of 32"),
                         (["--baseline", "/nonexistent.so"], "no such file")):
        with pytest.raises(SystemExit):
            matmul_rows([*common, *bad])
        assert message in capsys.readouterr().err
    # a shared library without mxspd's ops (as one older than an op is for it): named, not a raw error
    other = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_shared.so"
    with pytest.raises(SystemExit, match=f"--baseline {other}: cannot run kind 'float32 row'"):
        matmul_rows([*common, "--kinds", "float32 row", "--columns", "32", "--baseline", str(other)])
