"""A float16 KV cache on the CPU (recipe `kv_cache = "float16"`, compiler/half_kv.py): the kernels'
float16-cache twins against the float32 kernel on the rounded keys and values, bit for bit on every code
path; their rounding against numpy's; and a built artifact against transformers attending over the same
rounded keys and values, with speculation and batching still autoregressive decoding's bits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

import kernels
import runtime
from common.recipe import RecipeError, recipe_from_dict
from export.pipeline import build_artifact
from runtime.request import decoding
from serve.scheduler import Scheduler
from tests.conftest import tiny_recipe
from tests.test_invariant_kernels import MIN, attention_inputs, rotary_qkv, run_attention
from tests.test_native_kernel import every_path, session

pytestmark = pytest.mark.skipif(kernels.library_path() is None, reason="native kernel library not built here")
NAMES = ["query", "past_key", "past_value", "new_key", "new_value", "mask"]
F, H = TensorProto.FLOAT, TensorProto.FLOAT16


def half_attention_model(scale: float) -> onnx.ModelProto:
    types = [F, H, H, F, F, F]
    return _model(helper.make_node(kernels.ATTENTION_HALF_KV, NAMES, ["y", "k", "v"], domain=kernels.DOMAIN,
                                   scale=scale), list(zip(NAMES, types, strict=True)))


def half_rotary_model(hq: int, hkv: int, scale: float) -> onnx.ModelProto:
    names = ["qkv", "cos", "sin", "past_key", "past_value", "mask"]
    node = helper.make_node(kernels.ROTARY_ATTENTION_HALF_KV, names, ["y", "k", "v"], domain=kernels.DOMAIN,
                            q_heads=hq, kv_heads=hkv, scale=scale)
    return _model(node, list(zip(names, [F, F, F, H, H, F], strict=True)))


def _model(node: onnx.NodeProto, inputs: list[tuple[str, int]]) -> onnx.ModelProto:
    graph = helper.make_graph([node], "half", [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
                              [helper.make_tensor_value_info(n, t, None) for n, t in (("y", F), ("k", H), ("v", H))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)])


def rounded(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def run_half(inputs: list[np.ndarray], scale: float = 0.25) -> list[np.ndarray]:
    q, pk, pv, nk, nv, mask = inputs
    feeds = dict(zip(NAMES, [q, pk.astype(np.float16), pv.astype(np.float16), nk, nv, mask], strict=True))
    return session(half_attention_model(scale)).run(None, feeds)


SHAPES = [dict(), dict(hq=6, hkv=3, d=20, t=1), dict(hq=2, hkv=2, c=40, t=5), dict(d=64, c=700, t=2),
          dict(d=128, c=90, t=9), dict(d=40, c=33, t=3)]


def test_the_half_kernel_is_the_float_kernel_on_rounded_keys_and_values():
    """Every head size and path shape: the output bit for bit the float32 kernel's on the rounded keys and
    values, and the new ones rounded as numpy rounds. The negative control: the float32 kernel on the
    unrounded new keys differs (so the rounding is really applied before attending)."""
    rng = np.random.default_rng(0)
    differs = []
    for shape in SHAPES:
        q, pk, pv, nk, nv, mask = attention_inputs(rng, **shape)
        y, k16, v16 = run_half([q, pk, pv, nk, nv, mask])
        assert k16.dtype == np.float16 and np.array_equal(k16, nk.astype(np.float16))
        assert np.array_equal(v16, nv.astype(np.float16))
        np.testing.assert_array_equal(y, run_attention([q, rounded(pk), rounded(pv), rounded(nk), rounded(nv), mask]))
        differs.append(not np.array_equal(y, run_attention([q, rounded(pk), rounded(pv), nk, nv, mask])))
    assert all(differs)


@pytest.mark.parametrize("d", [20, 40, 64])
def test_a_decode_row_finds_its_largest_value_in_a_row_s_tail(d):
    """A row alone scans its float16 values for the largest (the fixed-point step of its sums): with every
    value's largest element past the last whole 16 (or, at head size 64, the last), the output is still the
    float32 kernel's bit for bit; an Inf value there makes the rows that see it NaN and no other."""
    rng = np.random.default_rng(d)
    q, pk, pv, nk, nv, mask = attention_inputs(rng, hq=4, hkv=2, c=30, d=d, t=1, visible=0.8)
    pv[..., -1] = 50.0 + rng.random(pv.shape[:-1])
    y, _, _ = run_half([q, pk, pv, nk, nv, mask])
    np.testing.assert_array_equal(y, run_attention([q, rounded(pk), rounded(pv), rounded(nk), rounded(nv), mask]))
    seen = int(np.flatnonzero(mask[0, 0, 0, :30] == 0.0)[0])
    pv[0, 1, seen, -1] = np.inf  # KV head 1: query heads 2 and 3
    y, _, _ = run_half([q, pk, pv, nk, nv, mask])
    assert np.isnan(y[0, 2:]).all() and not np.isnan(y[0, :2]).any()


def test_the_fused_rotary_twin_rounds_what_it_rotates():
    """RotaryAttentionHalfKV: RotaryQKV's heads, the keys and values rounded, then the float32 attention."""
    rng = np.random.default_rng(1)
    b, t, hq, hkv, d, c = 1, 5, 6, 2, 16, 30
    x, cos, sin, _, (q, k, v) = rotary_qkv(rng, b, t, hq, hkv, d)
    pk, pv = (rng.standard_normal((b, hkv, c, d)).astype(np.float16) for _ in range(2))
    mask = np.where(rng.random((b, 1, t, c + t)) < 0.7, 0.0, MIN).astype(np.float32)
    mask[0, 0, np.arange(t), c + np.arange(t)] = 0.0
    y, k16, v16 = session(half_rotary_model(hq, hkv, 0.25)).run(
        None, {"qkv": x, "cos": cos, "sin": sin, "past_key": pk, "past_value": pv, "mask": mask})
    assert np.array_equal(k16, k.astype(np.float16)) and np.array_equal(v16, v.astype(np.float16))
    want = run_attention([q, pk.astype(np.float32), pv.astype(np.float32), rounded(k), rounded(v), mask])
    np.testing.assert_array_equal(y, want)


def test_every_path_rounds_and_attends_alike(tmp_path):
    """The AVX-512 / AVX2 (F16C) / portable paths: the same bits, outputs and rounded rows, over values at
    float16's edges: the largest finite and the first that rounds to infinity, ties, subnormals and values
    that round to zero, infinities and a NaN (in a key only row 2 sees: that row is NaN, no other)."""
    rng = np.random.default_rng(2)
    inputs = attention_inputs(rng, d=64, c=50, t=6)
    edges = np.array([65504, 65519.99, 65520, -65520, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001, 3 * 2.0**-26, 1e-9,
                      -0.0, np.inf, -np.inf, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 6.1e-5, 5.9e-8], np.float32)
    inputs[4][0, 0, 3, : len(edges)] = edges  # new value row 3 of KV head 0: rounded and returned
    inputs[3][0, 1, 2, 5] = np.nan  # new key row 2 of KV head 1
    inputs[5][..., 50 + 2] = MIN
    inputs[5][0, 0, 2, 50 + 2] = 0.0  # only row 2 sees new row 2
    inputs[5][0, 0, :, 50 + 3] = MIN  # no row sees the edge values' row (its infinities would NaN them)
    np.savez(tmp_path / "in.npz", *inputs)
    code = ("import sys, numpy as np; from tests.test_half_kv import run_half;"
            "z = np.load(sys.argv[1]); y = run_half([z[f'arr_{j}'] for j in range(6)]);"
            "sys.stdout.buffer.write(b''.join(a.tobytes() for a in y))")
    vector, avx2, portable = every_path(code, str(tmp_path / "in.npz"))
    assert len(vector) > 0 and vector == avx2 == portable
    y, k16, v16 = run_half(inputs)
    with np.errstate(over="ignore"):
        want = edges.astype(np.float16)
    assert np.array_equal(v16[0, 0, 3, : len(edges)].view(np.uint16), want.view(np.uint16))
    assert np.isnan(y[0, 2:4, 2]).all() and not np.isnan(np.delete(y, 2, axis=2)).any()


def test_recipes_check_kv_cache():
    base = {"name": "x", "tlm": {"model": "m"}, "speculative": False, "context_length": 64, "max_prompt_length": 32}
    assert recipe_from_dict(base | {"kv_cache": "float16"}).kv_cache == "float16"
    with pytest.raises(RecipeError, match="kv_cache"):
        recipe_from_dict(base | {"kv_cache": "bfloat16"})
    with pytest.raises(RecipeError, match="ort-cuda"):
        recipe_from_dict(base | {"kv_cache": "float32", "target": "ort-cuda"})


def _rounded_attention(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN201
    """transformers' eager attention over keys and values rounded to float16 (the cache and the new rows)."""
    return eager_attention_forward(module, query, key.half().float(), value.half().float(), attention_mask, **kwargs)


@pytest.fixture(scope="module")
def half(checkpoints, tmp_path_factory) -> runtime.Artifact:
    recipe = replace(tiny_recipe(dlm=None), kv_cache="float16")
    out = tmp_path_factory.mktemp("half_kv") / "art"
    return runtime.load_artifact(build_artifact(recipe, out, tlm=str(checkpoints["llama-gqa"]), progress=False))


@pytest.mark.parametrize("length", [1, 9, 30])
def test_greedy_matches_transformers_over_a_rounded_cache(half, checkpoints, length):
    """Float weights, float16 cache: greedy tokens equal transformers' with the same rounding, 64 tokens
    on from prompts below, past and well past a prefill chunk; the cache is float16 and holds the rounded
    keys (each the float16 of a float32 the exported graph computes)."""
    AttentionInterface.register("mxspd_rounded_kv", _rounded_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("mxspd_rounded_kv", eager_mask)  # the additive float mask eager reads
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama-gqa"], attn_implementation="mxspd_rounded_kv")
    rng = np.random.default_rng(length)
    prompt = [0] + rng.integers(4, 260, length - 1).tolist() if length > 1 else [0]
    ours = runtime.generate(half, prompt, max_new_tokens=64, speculative=False)
    with torch.no_grad():
        ref = model.eval().generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=64, do_sample=False, pad_token_id=3)[0, len(prompt):].tolist()
    assert ours.token_ids[: len(ref)] == ref
    assert half.tlm.place.cache[0].dtype == np.float16 and half.manifest.models["tlm"].dims.kv_dtype == "float16"


def test_speculation_and_batching_keep_autoregressive_bits(half):
    """Prompt lookup and lookahead give plain decoding's tokens; four requests batched in the server's
    scheduler each give what they give alone (a key read as a new row in one call and from the cache in
    another is the same float16 number)."""
    prompts = [[0, *range(40, 52), *range(40, 52)], [0, 7, 9, 11, 7, 9, 11, 7], [0, 200, 3, 99], [0, *range(60, 90)]]
    alone = [runtime.generate(half, p, max_new_tokens=24, speculative=False).token_ids for p in prompts]
    for method in ("prompt_lookup", "lookahead"):
        assert [runtime.generate(half, p, max_new_tokens=24, speculative=method).token_ids for p in prompts] == alone
    scheduler = Scheduler(half)
    try:
        requests = [scheduler.submit(p, decoding(max_new_tokens=24, do_sample=False)) for p in prompts]
        assert [[e.token for e in r.events() if e.token is not None] for r in requests] == alone
    finally:
        scheduler.close()


def test_a_float16_cache_needs_the_kernels(checkpoints, tmp_path):
    """Without them (no library, or batch_invariant off) the build says so and keeps a float32 cache, as the
    native lowering falls back to fused: the default recipe asks for float16 and must build anywhere."""
    recipe = replace(tiny_recipe(dlm=None), kv_cache="float16", batch_invariant=False)
    with pytest.warns(UserWarning, match='kv_cache = "float16".*float32'):
        art = build_artifact(recipe, Path(tmp_path) / "art", tlm=str(checkpoints["llama-gqa"]), progress=False)
    assert runtime.load_artifact(art).manifest.models["tlm"].dims.kv_dtype == "float32"


def test_the_export_cli_sets_the_cache_type_and_states_its_memory(checkpoints, tmp_path, capsys):
    from export.__main__ import main
    from tests.conftest import recipe_file

    recipe = recipe_file(tmp_path / "r.toml", checkpoints["llama-gqa"], context=32)
    assert main(["--recipe", str(recipe), "--kv-cache", "float16", "--kv-slots", "64", "--out", str(tmp_path / "a"),
                 "--quiet"]) == 0
    dims = runtime.load_artifact(tmp_path / "a").manifest.models["tlm"].dims  # 2 layers, 2 KV heads of 16
    assert f"KV cache: 64 slots, {64 * 2 * 2 * 2 * 16 * 2 / 2**20:.1f} MiB (tlm float16, 0.2 KiB a slot)" in \
        capsys.readouterr().out and dims.kv_dtype == "float16"


def test_a_plain_attention_gets_its_rounded_rows_to_the_graph_outputs(checkpoints, tmp_path):
    """CodeGen (partial rotary: its attention stays a plain Attention, whose new keys and values another node
    wrote as the graph's outputs): the compiler reroutes them through AttentionHalfKV's rounded outputs, the
    cache is float16, and prompt lookup still gives plain decoding's tokens."""
    recipe = replace(tiny_recipe(dlm=None), kv_cache="float16")
    built = build_artifact(recipe, tmp_path / "cg", tlm=str(checkpoints["codegen"]), progress=False)
    art = runtime.load_artifact(built)
    graph = onnx.load(str(tmp_path / "cg" / "tlm" / "decode.onnx"), load_external_data=False).graph
    assert kernels.ATTENTION_HALF_KV in {n.op_type for n in graph.node}
    assert all(o.type.tensor_type.elem_type == H for o in graph.output if o.name.startswith("new_"))
    prompt = [0, 17, 99, 42, 8, 250, 31, 64, 5, 77, 12, 17, 99, 42]
    plain = runtime.generate(art, prompt, max_new_tokens=30, speculative=False).token_ids
    assert runtime.generate(art, prompt, max_new_tokens=30, speculative="prompt_lookup").token_ids == plain
    assert art.tlm.place.cache[0].dtype == np.float16
