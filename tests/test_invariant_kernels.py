"""mxspd's batch-invariant kernels (kernels/row_matmul.cc, kernels/attention.cc): values against float64,
the invariance each promises (rows, threads, where a key is stored, what is masked), both code paths,
errors; and ONNX Runtime's standard ops failing the same checks (the negative control)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kernels
from export.split_attention import attention_function
from kernels.layout import pack_panels
from tests.test_native_kernel import every_path, session

pytestmark = pytest.mark.skipif(kernels.library_path() is None, reason="native kernel library not built here")
MIN = float(np.finfo(np.float32).min)


def row_matmul_model(w: np.ndarray, m: int | None, k: int | None = None) -> onnx.ModelProto:
    k, n = k or w.shape[0], w.shape[1]
    graph = helper.make_graph(
        [helper.make_node(kernels.ROW_MATMUL, ["a", "w"], ["y"], domain=kernels.DOMAIN, N=n)], "rows",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(pack_panels(w), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)])


@pytest.mark.parametrize("k,n", [(70, 200), (64, 64), (576, 130), (130, 100)])
def test_row_matmul_values_and_row_invariance(k, n):
    rng = np.random.default_rng(k)
    w, a = rng.standard_normal((k, n)).astype(np.float32), rng.standard_normal((17, k)).astype(np.float32)
    exact = a.astype(np.float64) @ w
    full = {t: session(row_matmul_model(w, None), t).run(None, {"a": a})[0] for t in (1, 2)}
    np.testing.assert_allclose(full[2], exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    assert np.array_equal(full[1], full[2])
    for m in (1, 2, 3, 5):
        assert np.array_equal(session(row_matmul_model(w, None)).run(None, {"a": a[:m]})[0], full[2][:m])
    with pytest.raises(Exception, match="packed"):
        session(row_matmul_model(w, None, k - 1)).run(None, {"a": a[:, :-1]})


def attention_model(scale: float, standard: bool = False) -> onnx.ModelProto:
    names = ["query", "past_key", "past_value", "new_key", "new_value", "mask"]
    graph = helper.make_graph(
        [helper.make_node(kernels.ATTENTION, names, ["y"], domain=kernels.DOMAIN, scale=scale)], "attention",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    if standard:  # the exporter's function, inlined: ONNX Runtime's MatMul and Softmax
        model.functions.append(attention_function(18))
        model = onnx.inliner.inline_local_functions(model)
    return model


def attention_inputs(rng, hq=4, hkv=2, t=3, c=10, d=16, visible=0.6):
    q = rng.standard_normal((1, hq, t, d)).astype(np.float32)
    kv = [rng.standard_normal((1, hkv, n, d)).astype(np.float32) for n in (c, c, t, t)]
    seen = rng.random((1, 1, t, c + t)) < visible
    seen[0, 0, np.arange(t), c + np.arange(t)] = True
    return [q, *kv, np.where(seen, 0.0, MIN).astype(np.float32)]


def reference(q, pk, pv, nk, nv, mask, scale):
    """Attention in float64 over [past; new], grouped-query heads mapped as h // (Hq // Hkv)."""
    group = q.shape[1] // pk.shape[1]
    k = np.repeat(np.concatenate([pk, nk], 2), group, 1).astype(np.float64)
    v = np.repeat(np.concatenate([pv, nv], 2), group, 1).astype(np.float64)
    s = q.astype(np.float64) @ k.transpose(0, 1, 3, 2) * scale + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def run_attention(inputs, scale=0.25, standard=False):
    names = ["query", "past_key", "past_value", "new_key", "new_value", "mask"]
    return session(attention_model(scale, standard)).run(None, dict(zip(names, inputs, strict=True)))[0]


def test_attention_values_against_float64():
    rng = np.random.default_rng(0)
    # head size 64 keeps its sums in registers; over 256 visible keys the int32 sums move to int64
    for shape in [dict(), dict(hq=6, hkv=3, d=20, t=1), dict(hq=2, hkv=2, c=40, t=5), dict(d=64, c=700, t=2)]:
        inputs = attention_inputs(rng, **shape)
        np.testing.assert_allclose(run_attention(inputs), reference(*inputs, 0.25), rtol=0, atol=2e-6)


def _moved(inputs, rng):
    """The same visible keys for query row 0, stored elsewhere: new row 1's key moved into a free cache
    slot, the cache slots permuted, and the hidden slots refilled with garbage."""
    q, pk, pv, nk, nv, mask = (x.copy() for x in inputs)
    c = pk.shape[2]
    perm = rng.permutation(c)
    pk, pv, mask[..., :c] = pk[:, :, perm], pv[:, :, perm], mask[..., perm]
    hidden = np.flatnonzero(mask[0, 0, 0, :c] == MIN)
    pk[:, :, hidden] = rng.standard_normal(pk[:, :, hidden].shape)
    slot = hidden[0]
    pk[:, :, slot], pv[:, :, slot] = nk[:, :, 1], nv[:, :, 1]
    mask[0, 0, 0, slot], mask[0, 0, 0, c + 1] = 0.0, MIN
    return [q, pk, pv, nk, nv, mask]


@pytest.mark.parametrize("standard", [False, True])
def test_a_row_does_not_depend_on_where_its_keys_are_stored(standard):
    """The kernel: bitwise equal after moving keys; ONNX Runtime's standard ops (negative control): not always."""
    rng = np.random.default_rng(1)
    same = []
    for _ in range(20):
        inputs = attention_inputs(rng, c=24, t=4, visible=0.7)
        inputs[5][0, 0, 0, 24 + 1] = 0.0  # row 0 sees new row 1
        before, after = run_attention(inputs, standard=standard), run_attention(_moved(inputs, rng), standard=standard)
        same.append(np.array_equal(before[:, :, 0], after[:, :, 0]))
        np.testing.assert_allclose(after[:, :, 0], before[:, :, 0], rtol=0, atol=1e-5)
    assert all(same) if not standard else not all(same)


def test_attention_nan_stays_in_its_rows_and_bad_shapes_are_refused():
    inputs = attention_inputs(np.random.default_rng(2), t=2)
    inputs[4][0, 0, 1, 3] = np.nan  # new row 1's value, KV head 0: query heads 0 and 1, rows that see it
    out = run_attention(inputs)
    assert np.isnan(out[0, :2, 1]).all() and not np.isnan(out[0, :, 0]).any() and not np.isnan(out[0, 2:]).any()
    with pytest.raises(Exception, match="shapes must be"):
        run_attention([inputs[0][:, :3], *inputs[1:]])


@pytest.mark.parametrize("hq,hkv,t", [(3, 1, 1), (3, 1, 9), (2, 2, 9)])
def test_equal_keys_at_the_largest_values_sum_without_overflow(hq, hkv, t):
    """The weighted sums' int32 lanes move into int64 often enough whatever the probabilities: every key the
    same (p = 1 for each) and every value the largest float below 2^e, so each term is 2^26 - 4 and 32 of them
    come within 128 of the int32 limit. Each row's output is the value itself, exactly: lanes that took more
    than 32 keys (tried: blocks of 64 keys, each moved at its end) or a step twice too fine wrap. On AVX-512 a
    decode row of one vector, a 9-row call's KV heads of three query heads each in one tile, and (one query
    head per KV head) tiles of three rows."""
    c, d = 200, 64
    top = np.nextafter(np.float32(2.0), np.float32(0.0))
    q = np.random.default_rng(12).standard_normal((1, hq, t, d)).astype(np.float32)
    past_key = np.broadcast_to(np.linspace(-1, 1, d, dtype=np.float32), (1, hkv, c, d)).copy()
    values = np.where(np.arange(d) % 2, top, -top).astype(np.float32)
    past_value = np.broadcast_to(values, (1, hkv, c, d)).copy()
    new_key, new_value = past_key[:, :, :t].copy(), past_value[:, :, :t].copy()
    mask = np.zeros((1, 1, t, c + t), np.float32)
    mask[0, 0, :, c:] = np.where(np.tril(np.ones((t, t), bool)), 0.0, MIN)
    out = run_attention([q, past_key, past_value, new_key, new_value, mask])
    np.testing.assert_array_equal(out, np.broadcast_to(values, out.shape))


@pytest.mark.parametrize("d", [64, 128])
def test_a_row_of_a_many_row_call_gets_the_bits_it_gets_alone(d):
    """Calls whose rows share keys find each key's value range once per call (the largest |v| over a row's
    visible keys sets the fixed-point step of its weighted sums); a row alone scans its own keys. The
    ranges must cover exactly the keys a row sees: a key no row sees holds the largest values (one
    counted by mistake changes every row's step and bits), a key only row 3 sees the next largest, and
    an Inf and a NaN value sit in keys that rows 5 and 6 alone see (those rows are NaN, no other)."""
    rng = np.random.default_rng(7)
    t, c = 9, 40
    q, pk, pv, nk, nv, mask = attention_inputs(rng, t=t, c=c, d=d, visible=0.5)
    mask[..., c:] = MIN  # rows see cache slots only: each can run alone, with its own hidden new key
    mask[..., :4] = MIN
    pv[0, :, 0] *= 1000.0  # slot 0: no row sees it
    pv[0, :, 1] *= 100.0  # slot 1: row 3 alone
    mask[0, 0, 3, 1] = 0.0
    pv[0, 0, 2, 5], mask[0, 0, 5, 2] = np.inf, 0.0  # slot 2: row 5 alone, KV head 0
    pv[0, 1, 3, 7], mask[0, 0, 6, 3] = np.nan, 0.0  # slot 3: row 6 alone, KV head 1
    together = run_attention([q, pk, pv, nk, nv, mask])
    for r in range(t):
        alone = run_attention([q[:, :, [r]], pk, pv, nk[:, :, [r]], nv[:, :, [r]], mask[:, :, [r], : c + 1]])
        np.testing.assert_array_equal(alone[:, :, 0], together[:, :, r])
    assert np.isnan(together[0, :2, 5]).all() and np.isnan(together[0, 2:, 6]).all()
    assert not np.isnan(np.delete(together, [5, 6], axis=2)).any()


@pytest.mark.parametrize("hq,hkv,d", [(2, 2, 128), (2, 2, 64), (4, 2, 64), (3, 1, 64), (8, 2, 64)])
def test_rows_of_a_prefill_chunk_tiled_get_the_bits_they_get_alone(hq, hkv, d):
    """A prefill chunk (each row sees the past and the chunk up to itself): on AVX-512 rows sharing keys go
    through the tile kernels together (three rows to a tile where a KV head has one query head), over the
    union of their keys, a key a row does not see scored -infinity whatever it holds. Each row's output bit
    for bit what it gets alone, when the chunk's row 4 holds an Inf key (rows 4 on see it: NaN; row 3, in a
    tile with rows 4 and 5, finite), and then an Inf value too (row 3's tile then runs row by row, as a
    value it does not see times p = 0 is no 0). On any CPU, the float64 reference within float32 rounding."""
    rng = np.random.default_rng(11)
    t, c = 13, 46  # row 3's tile: 49 keys, the Inf key 48th (in a group of 8 keys, not the scalar tail)
    q, pk, pv, nk, nv, mask = attention_inputs(rng, hq=hq, hkv=hkv, t=t, c=c, d=d)
    mask[...] = MIN
    mask[0, 0, :, 3:c] = 0.0  # the past, less 3 slots no row sees (filled with the largest values)
    mask[0, 0, :, c:] = np.where(np.tril(np.ones((t, t), bool)), 0.0, MIN)
    pv[0, :, :3] *= 1000.0
    finite = run_attention([q, pk, pv, nk, nv, mask])
    np.testing.assert_allclose(finite, reference(q, pk, pv, nk, nv, mask, 0.25), rtol=0, atol=2e-6)
    group = hq // hkv
    q[0, :group, :, 2] = np.abs(q[0, :group, :, 2]) + 0.5  # every score of the Inf key +Inf (+Inf - Inf: NaN)
    nk[0, 0, 4, 2] = np.inf
    for inf_value in (False, True):
        nv[0, 0, 4, 1] = np.inf if inf_value else nv[0, 0, 4, 1]
        together = run_attention([q, pk, pv, nk, nv, mask])
        assert np.isnan(together[0, :group, 4:]).all() and not np.isnan(together[0, :, :4]).any()
        np.testing.assert_array_equal(together[0, group:], finite[0, group:])  # the other KV heads' rows
        for r in range(t):  # row r alone, the chunk's earlier rows moved into the cache (a decode step)
            past = [np.concatenate([x, y[:, :, :r]], 2) for x, y in ((pk, nk), (pv, nv))]
            alone = run_attention([q[:, :, [r]], *past, nk[:, :, [r]], nv[:, :, [r]], mask[:, :, [r], : c + r + 1]])
            np.testing.assert_array_equal(alone[:, :, 0], together[:, :, r])


@pytest.mark.parametrize("d", [64, 128])
def test_rows_of_different_sequences_get_the_bits_they_get_alone(d):
    """A server's step: 12 rows, each seeing its own 40-70 cache slots (no key shared, so each row scans
    its own values), scattered over the cache as a server's slots are, beside hidden slots holding the
    largest values; three query heads per KV head worked through in blocks of keys. Each row's output,
    bit for bit, what the row gets alone, and within float32 rounding of float64."""
    rng = np.random.default_rng(8)
    t, c, hq, hkv = 12, 1000, 6, 2
    q, pk, pv, nk, nv, mask = attention_inputs(rng, hq=hq, hkv=hkv, t=t, c=c, d=d, visible=0.0)
    mask[...] = MIN
    slots = rng.permutation(c)
    taken = 0
    for r in range(t):
        n = int(rng.integers(40, 71))
        mask[0, 0, r, slots[taken : taken + n]] = 0.0
        mask[0, 0, r, c + r] = 0.0
        taken += n
    pv[0, :, slots[taken:]] *= 1000.0  # nobody's: were they counted, every row's step would change
    together = run_attention([q, pk, pv, nk, nv, mask])
    np.testing.assert_allclose(together, reference(q, pk, pv, nk, nv, mask, 0.25), rtol=0, atol=2e-6)
    for r in range(t):
        keep = np.r_[0:c, c + r]
        alone = run_attention([q[:, :, [r]], pk, pv, nk[:, :, [r]], nv[:, :, [r]], mask[:, :, [r]][..., keep]])
        np.testing.assert_array_equal(alone[:, :, 0], together[:, :, r])


def test_portable_paths_give_the_vector_paths_bits(tmp_path):
    """MXSPD_KERNELS_PORTABLE=1 (read when the library loads) forces the scalar loops on any CPU, and
    MXSPD_KERNELS_AVX2=1 the AVX2 ones on an AVX-512 CPU (without AVX-512 VNNI the first two runs take
    the same path): head sizes 20, 40, 48, 64 and 128, NaN and Inf inputs, a row that sees nothing."""
    rng = np.random.default_rng(3)
    inputs = attention_inputs(rng, d=20, c=30, t=5)  # t >= 4: query heads grouped per KV head
    wide = attention_inputs(rng, d=64, c=700, t=2, visible=0.9)  # sums in registers, moved to int64
    large = attention_inputs(rng, d=128, c=90, t=9)  # AVX-512: sums in 8 registers
    odd = attention_inputs(rng, d=40, c=33, t=3)  # a dot product's tail of 8 elements, then none
    edge = attention_inputs(rng, d=48, c=20, t=5)  # AVX-512 scan without its sums; NaN, Inf, nothing seen
    edge[0][0, 1, 2, 5] = np.nan  # a NaN score: query head 1, row 2
    edge[4][0, 1, 3, 7] = np.inf  # an Inf value: KV head 1, new row 3, for the rows that see it
    edge[5][0, 0, 4] = MIN  # row 4 sees no key
    # RowMatMul: three chunks of K, a whole panel and a partial one (45: 32 + 8 columns, then 5 scalar), 4 rows
    w, a = rng.standard_normal((130, 109)).astype(np.float32), rng.standard_normal((4, 130)).astype(np.float32)
    np.savez(tmp_path / "in.npz", *inputs, *wide, *large, *odd, *edge, w=w, a=a)
    code = ("import sys, numpy as np; from tests.test_invariant_kernels import *;"
            "z = np.load(sys.argv[1]); i = [z[f'arr_{j}'] for j in range(30)];"
            "y = session(row_matmul_model(z['w'], None)).run(None, {'a': z['a']})[0];"
            "sys.stdout.buffer.write(b''.join(run_attention(i[j : j + 6]).tobytes() for j in range(0, 30, 6))"
            " + y.tobytes())")
    vector, avx2, portable = every_path(code, str(tmp_path / "in.npz"))
    assert len(vector) > 0 and vector == avx2 == portable
    y = np.frombuffer(vector, np.float32)
    assert np.isnan(y).any() and (y == 0).any() and np.isfinite(y).mean() > 0.9  # the edge cases took effect


def single_op(op: str, inputs: dict[str, list[int | None]], outputs: list[str], **attrs: object) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node(op, list(inputs), outputs, domain=kernels.DOMAIN, **attrs)], op,
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs.items()],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)])


def swiglu(x: np.ndarray) -> np.ndarray:
    return session(single_op(kernels.SWIGLU, {"x": [None, None, None]}, ["y"])).run(None, {"x": x})[0]


def test_swiglu_values_rows_and_paths(tmp_path):
    """silu(gate) * up within float32 rounding of float64 (1e-6 relative), a row's bits the same alone or
    among others, every code path the same bits; a NaN gate gives NaN, +Inf gives +-Inf (by the sign of
    up), -Inf NaN (as the unfused graph's x * sigmoid(x) does)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((1, 7, 2 * 45)) * 6).astype(np.float32)  # 45: a vector loop's tail too
    x[0, 6, :3] = [np.nan, np.inf, -np.inf]
    y = swiglu(x)
    g, u = x[..., :45].astype(np.float64), x[..., 45:].astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        want = g / (1 + np.exp(-g)) * u
    finite = np.isfinite(want)
    np.testing.assert_allclose(y[finite], want[finite], rtol=1e-6, atol=1e-30)
    assert np.isnan(y[0, 6, 0]) and y[0, 6, 1] == np.inf * np.sign(u[0, 6, 1]) and np.isnan(y[0, 6, 2])
    for r in range(6):
        np.testing.assert_array_equal(swiglu(x[:, r : r + 1]), y[:, r : r + 1])
    np.save(tmp_path / "x.npy", x)
    code = ("import sys, numpy as np; from tests.test_invariant_kernels import swiglu;"
            "sys.stdout.buffer.write(swiglu(np.load(sys.argv[1])).tobytes())")
    vector, avx2, portable = every_path(code, str(tmp_path / "x.npy"))
    assert vector == avx2 == portable == y.tobytes()


def rotary_qkv(rng: np.random.Generator, b: int, t: int, hq: int, hkv: int, d: int) -> tuple:
    """A packed q/k/v projection, rotary angles' cos and sin, their shapes, and RotaryQKV's heads of them."""
    x = rng.standard_normal((b, t, (hq + 2 * hkv) * d)).astype(np.float32)
    angles = rng.uniform(-20, 20, (1, 1, t, d)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    shapes = {"x": [b, t, None], "cos": [1, 1, t, d], "sin": [1, 1, t, d]}
    heads = session(single_op(kernels.ROTARY_QKV, shapes, ["q", "k", "v"], q_heads=hq, kv_heads=hkv)).run(
        None, {"x": x, "cos": cos, "sin": sin})
    return x, cos, sin, shapes, heads


def test_rotary_qkv_is_the_split_and_the_two_rotary_ops():
    """RotaryQKV on a packed q/k/v projection: the queries' and keys' Rotary outputs, bit for bit, and the
    values as heads; a shape that does not split into its heads is refused."""
    b, t, hq, hkv, d = 1, 5, 6, 2, 8
    x, cos, sin, shapes, (q, k, v) = rotary_qkv(np.random.default_rng(6), b, t, hq, hkv, d)

    def rotary(part: np.ndarray, heads: int) -> np.ndarray:
        model = single_op(kernels.ROTARY, shapes, ["y"], heads=heads)
        return session(model).run(None, {"x": np.ascontiguousarray(part), "cos": cos, "sin": sin})[0]

    np.testing.assert_array_equal(q, rotary(x[..., : hq * d], hq))
    np.testing.assert_array_equal(k, rotary(x[..., hq * d : (hq + hkv) * d], hkv))
    heads = x[..., : hq * d].reshape(b, t, hq, d).transpose(0, 2, 1, 3)  # numpy: each product and sum rounded once
    turned = np.concatenate([-heads[..., d // 2 :], heads[..., : d // 2]], axis=-1)
    np.testing.assert_array_equal(q, heads * cos + turned * sin)
    np.testing.assert_array_equal(v, x[..., (hq + hkv) * d :].reshape(b, t, hkv, d).transpose(0, 2, 1, 3))
    with pytest.raises(Exception, match="must be"):
        session(single_op(kernels.ROTARY_QKV, shapes, ["q", "k", "v"], q_heads=hq, kv_heads=hkv)).run(
            None, {"x": x[..., :-8], "cos": cos, "sin": sin})
