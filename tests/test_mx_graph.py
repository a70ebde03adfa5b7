"""The MX quant pass (standard ONNX), its ONNX Runtime lowerings, and MX artifacts end to end."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from benchmarks.chain import Chain
from common.recipe import ModelSpec, RecipeError, recipe_from_dict, with_mx_format
from compiler import mx_lowering
from compiler.build import _check_lowered
from compiler.mx_lowering import LoweringError, lower_model
from compiler.pack_matmuls import SEPARATOR
from export.pipeline import build_artifact
from kernels import library_path
from quant import fake_quantize
from quant.onnx_pass import MXPass, apply_passes, quantize_model
from recipes import get_recipe
from runtime.load import load_artifact
from tests.conftest import recipe_file, tiny_recipe

WEIGHT = "layers.0.mlp.up_proj.weight.T"


def matmul_model(w: np.ndarray, rows: int = 3) -> onnx.ModelProto:
    k, n = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", WEIGHT], ["y"])], "mm",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, rows, k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, rows, n])],
        [numpy_helper.from_array(w, WEIGHT)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def weights(k: int, n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((k, n)) * 0.05).astype(np.float32)


def run_ort(model: onnx.ModelProto, x: np.ndarray, optimized: str | None = None) -> np.ndarray:
    so = ort.SessionOptions()
    if optimized:
        so.optimized_model_filepath = optimized
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("fmt", ["fp6_e2m3", "fp6_e3m2", "fp4_e2m1"])
@pytest.mark.parametrize("k", [64, 70])
def test_standard_onnx_mx_graph_dequantizes_to_fake_quantize(fmt, k):
    """onnx's own reference DequantizeLinear (FLOAT6 data, E8M0 scales) decodes our packing exactly."""
    w = weights(k, 24)
    model = matmul_model(w)
    assert quantize_model(model, fmt) == 1
    onnx.checker.check_model(model, full_check=True)
    types = {t.name: t.data_type for t in model.graph.initializer}
    want = {"fp6_e2m3": onnx.TensorProto.FLOAT6E2M3, "fp6_e3m2": onnx.TensorProto.FLOAT6E3M2,
            "fp4_e2m1": onnx.TensorProto.FLOAT4E2M1}
    assert types[WEIGHT + ".mx_codes"] == want[fmt]
    assert types[WEIGHT + ".mx_scales"] == onnx.TensorProto.FLOAT8E8M0
    x = np.random.default_rng(1).standard_normal((1, 3, k)).astype(np.float32)
    y = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ fake_quantize(w, fmt, axis=0), rtol=1e-5, atol=1e-6)


def renamed(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    model.graph.node[0].input[1] = model.graph.initializer[0].name = name
    return model


@pytest.mark.parametrize("name,int8", [(WEIGHT, ("mlp.up",)), (WEIGHT, ("layers.1.",)),
                                       ("lm_head.weight.T", ("lm_head",))])
def test_weights_named_in_mx_int8_are_standard_mxint8_blocks(name, int8):
    """MXINT8 in the graph: INT8 codes and E8M0 exponents holding the element's 2^-6, so onnx's own
    DequantizeLinear gives the MX values, tiny blocks too (exponent below 6: stored shifted)."""
    w = weights(64, 24)
    w[:, 3] *= 1e-37  # blocks whose MX exponent is below 6
    model = renamed(matmul_model(w), name)
    mx = MXPass("fp6_e2m3", int8=int8)
    assert apply_passes(model, [mx]) == 1
    onnx.checker.check_model(model, full_check=True)
    fmt = "int8" if any(f in name for f in int8) else "fp6_e2m3"
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert types[name + ".mx_codes"] == (onnx.TensorProto.INT8 if fmt == "int8" else onnx.TensorProto.FLOAT6E2M3)
    assert mx.summary().int8_tensors == (fmt == "int8")
    model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    x = np.zeros((1, 3, 64), np.float32)
    dequantized = ReferenceEvaluator(model).run(None, {"x": x})[1]
    ref = fake_quantize(w, fmt, axis=0)
    np.testing.assert_array_equal(dequantized[:, [0, 1, 2, 4]], ref[:, [0, 1, 2, 4]])
    np.testing.assert_allclose(dequantized[:, 3], ref[:, 3], rtol=0, atol=2.0**-128)


def test_an_mx_int8_fragment_that_selects_nothing_is_refused():
    mx = MXPass("fp6_e2m3", int8=("mlp.up", "down_prj"))
    apply_passes(matmul_model(weights(64, 24)), [mx])
    with pytest.raises(ValueError, match=r"\['down_prj'\] match no quantized weight"):
        mx.info()


def test_a_float_build_of_a_recipe_with_mx_int8_drops_it():
    spec = ModelSpec(model="m", mx_format="fp6_e2m3", mx_int8=("down_proj",), mx_lm_head="format")
    assert with_mx_format(spec, None) == ModelSpec(model="m", mx_lm_head="format")
    assert not with_mx_format(spec, None).mx_head and not with_mx_format(spec, None).mx_table
    assert with_mx_format(spec, "fp6_e3m2").mx_int8 == ("down_proj",)


def test_mx_weights_quantize_the_head_and_the_table_unless_told_otherwise():
    """A recipe that asks for MX weights gets an MXINT8 LM head and embedding table (both read every
    token); "format" puts the head in mx_format, "float32" keeps either; the keys mean nothing without
    MX weights; contradictions and the keys' earlier boolean form are refused by name."""
    plain = ModelSpec(model="m", mx_format="fp6_e2m3")
    assert plain.mx_head and plain.mx_table and plain.mx_int8_fragments == ("lm_head",)
    six = replace(plain, mx_lm_head="format", mx_int8=("down_proj",))
    assert six.mx_head and six.mx_int8_fragments == ("down_proj",)
    kept = replace(plain, mx_lm_head="float32", mx_embedding="float32")
    assert not kept.mx_head and not kept.mx_table and kept.mx_int8_fragments == ()
    assert replace(plain, mx_int8=("lm_head", "self_attn")).mx_int8_fragments == ("lm_head", "self_attn")
    float_model = ModelSpec(model="m")
    assert not float_model.mx_head and not float_model.mx_table
    for head in ("float32", "format"):
        with pytest.raises(RecipeError, match="names the LM head"):
            recipe_from_dict({"name": "r", "tlm": {"model": "m", "mx_format": "fp6_e2m3", "mx_lm_head": head,
                                                   "mx_int8": ["lm_head"]}})
    for key, value in [("mx_lm_head", True), ("mx_embedding", False)]:
        with pytest.raises(RecipeError, match=f"{key}: expected a string.*not a boolean"):
            recipe_from_dict({"name": "r", "tlm": {"model": "m", "mx_format": "fp6_e2m3", key: value}})
    for key, value in [("mx_lm_head", "int4"), ("mx_embedding", "format")]:
        with pytest.raises(RecipeError, match=f"{key}: '{value}' is not one of"):
            recipe_from_dict({"name": "r", "tlm": {"model": "m", "mx_format": "fp6_e2m3", key: value}})
    for name in ("llama2-7b-spd", "codegen-7b-spd"):  # the mission's recipes read no float32 head or table
        tlm = get_recipe(name).tlm
        assert tlm.mx_head and tlm.mx_table and "lm_head" in tlm.mx_int8_fragments


def test_mx_int8_needs_mx_weights_and_real_fragments():
    with pytest.raises(RecipeError, match="need mx_format"):
        recipe_from_dict({"name": "r", "tlm": {"model": "m", "mx_int8": ["lm_head"]}})
    with pytest.raises(RecipeError, match="empty name fragment"):
        recipe_from_dict({"name": "r", "tlm": {"model": "m", "mx_format": "fp6_e2m3", "mx_int8": [""]}})


def test_mx_fp6_is_a_tier_under_other_formats_only():
    """mx_fp6 needs MX weights in another format than MXFP6 E2M3, real fragments, and mx_lm_head = "fp6" to name
    the head; switching the recipe to MXFP6 (or float) drops it."""
    base = {"model": "m", "mx_format": "fp4_e2m1"}
    for tlm, why in [({"model": "m", "mx_fp6": ["v_proj"]}, "need mx_format"),
                     (base | {"mx_format": "fp6_e2m3", "mx_fp6": ["v_proj"]}, "are fp6_e2m3 already"),
                     (base | {"mx_fp6": ["v_proj", ""]}, "mx_fp6: an empty name fragment"),
                     (base | {"mx_fp6": ["lm_head"]}, 'names the LM head, but mx_lm_head is .int8.*"fp6"')]:
        with pytest.raises(RecipeError, match=why):
            recipe_from_dict({"name": "r", "tlm": tlm})
    spec = recipe_from_dict({"name": "r", "speculative": False,
                             "tlm": base | {"mx_fp6": ["down_proj"], "mx_lm_head": "fp6"}}).tlm
    assert spec.mx_fp6_fragments == ("down_proj", "lm_head") and spec.mx_int8_fragments == () and spec.mx_head
    assert replace(spec, mx_fp6=("lm_head",)).mx_fp6_fragments == ("lm_head",)
    assert with_mx_format(spec, "fp6_e2m3").mx_fp6 == () and with_mx_format(spec, "fp6_e3m2").mx_fp6 == ("down_proj",)
    assert with_mx_format(spec, None).mx_fp6 == ()


def test_mx_fp6_fragments_store_mxfp6_under_mxint8():
    """Each weight in the first tier that names it (MXINT8, then MXFP6), else the pass's format; a fragment that
    chose no weight's format (a typo, or one mx_int8 shadows everywhere) is refused."""
    def stored(name: str, **tiers) -> tuple[int, MXPass]:
        model, mx = renamed(matmul_model(weights(64, 24)), name), MXPass("fp4_e2m1", **tiers)
        apply_passes(model, [mx])
        return {t.name: t.data_type for t in model.graph.initializer}[name + ".mx_codes"], mx

    assert stored(WEIGHT, fp6=("mlp.up",))[0] == onnx.TensorProto.FLOAT6E2M3
    assert stored(WEIGHT, fp6=("down",))[0] == onnx.TensorProto.FLOAT4E2M1
    kind, mx = stored(WEIGHT, fp6=("mlp.up",), int8=("layers.0.",))
    assert kind == onnx.TensorProto.INT8
    with pytest.raises(ValueError, match=r"mx_fp6 fragment\(s\) \['mlp.up'\] match no quantized weight that mx_int8"):
        mx.info()
    kind, mx = stored("lm_head.weight.T", fp6=("lm_head",))
    assert kind == onnx.TensorProto.FLOAT6E2M3 and mx.lm_head
    assert (mx.summary().fp6_tensors, mx.summary().int8_tensors) == (1, 0)


def test_lm_head_follows_the_option_and_unknown_weights_are_refused():
    head = renamed(matmul_model(weights(64, 32)), "lm_head.weight.T")
    assert quantize_model(onnx.ModelProto.FromString(head.SerializeToString())) == 0
    assert quantize_model(head, lm_head=True) == 1
    with pytest.raises(ValueError, match="onnx::MatMul_7.*unquantized"):
        quantize_model(renamed(matmul_model(weights(64, 32)), "onnx::MatMul_7"))


def test_quant_summary_counts_stored_bytes(tmp_path):
    mx = MXPass()
    apply_passes(matmul_model(weights(64, 32)), [mx])
    s = mx.summary()
    # 64 x 32 codes at 6 bits + 2 x 32 scale bytes, against 2 bytes per weight in FP16
    assert (s.elements, s.mx_bytes, s.fp16_bytes) == (2048, 1536 + 64, 4096)
    assert s.ratio_to_fp16 == pytest.approx(0.390625)


@pytest.mark.parametrize("fmt,lowering", [("fp6_e2m3", "exact"), ("fp6_e3m2", "exact"), ("fp6_e2m3", "fused"),
                                          ("fp4_e2m1", "exact"), ("fp4_e2m1", "fused")])
@pytest.mark.parametrize("k", [96, 70])
def test_lowered_graph_in_onnxruntime_equals_numpy_with_fake_quantized_weights(fmt, lowering, k, monkeypatch):
    """accuracy_level 0 keeps activations in float32, so the fused re-encoding itself must be lossless."""
    monkeypatch.setattr(mx_lowering, "ACCURACY_LEVEL", 0)
    w = weights(k, 40)
    model = matmul_model(w)
    quantize_model(model, fmt)
    assert lower_model(model, lowering) == {WEIGHT: fmt}
    onnx.checker.check_model(model)
    assert model.opset_import[0].version == 18
    x = np.random.default_rng(2).standard_normal((1, 3, k)).astype(np.float32)
    np.testing.assert_allclose(run_ort(model, x), x @ fake_quantize(w, fmt, axis=0), rtol=1e-5, atol=1e-5)


def test_fused_and_exact_agree_within_activation_quantization(tmp_path):
    """Stated tolerance: accuracy_level 4 rounds each 32-activation block to int8 (relative error ~1%)."""
    w = weights(256, 64)
    x = np.random.default_rng(3).standard_normal((1, 3, 256)).astype(np.float32)
    out = {}
    for lowering in ("exact", "fused"):
        model = matmul_model(w)
        quantize_model(model)
        lower_model(model, lowering)
        out[lowering] = run_ort(model, x, optimized=str(tmp_path / f"{lowering}.onnx"))
        folded = onnx.load(str(tmp_path / f"{lowering}.onnx"))
        # Loading folded the unpacking subgraph away: only the matmul runs per step.
        assert [n.op_type for n in folded.graph.node] == ["MatMulNBits" if lowering == "fused" else "MatMul"]
    scale = np.abs(out["exact"]).max()
    err = np.abs(out["fused"] - out["exact"]).max()
    assert err < 0.02 * scale, err
    assert err > 0  # activations really were quantized: the two lowerings are not the same computation


@pytest.mark.parametrize("lowering", ["fused", "native", "native8"])
def test_e3m2_needs_the_exact_lowering(lowering):
    model = matmul_model(weights(64, 32))
    quantize_model(model, "fp6_e3m2")
    with pytest.raises(LoweringError, match="exact"):
        lower_model(model, lowering)
    with pytest.raises(RecipeError, match="exact"):
        recipe_from_dict({"name": "x", "tlm": {"model": "m", "mx_format": "fp6_e3m2", "mx_lowering": lowering},
                          "speculative": False})
    with pytest.raises(RecipeError, match="exact"):  # the default lowering too
        recipe_from_dict({"name": "x", "tlm": {"model": "m", "mx_format": "fp6_e3m2"}, "speculative": False})


def test_mxfp4_is_refused_for_the_gpu_target_s_kernel():
    base = {"name": "x", "speculative": False, "target": "ort-cuda"}
    with pytest.raises(RecipeError, match="tlm: the ort-cuda target's MX kernel reads MXFP6 and MXINT8 only"):
        recipe_from_dict(base | {"tlm": {"model": "m", "mx_format": "fp4_e2m1"}})
    for lowering in ("fused", "exact"):
        recipe_from_dict(base | {"tlm": {"model": "m", "mx_format": "fp4_e2m1", "mx_lowering": lowering}})
    recipe_from_dict(base | {"target": "ort-cpu", "tlm": {"model": "m", "mx_format": "fp4_e2m1"}})


def test_lowering_that_did_not_survive_is_an_error():
    plain = matmul_model(weights(64, 32))
    with pytest.raises(RuntimeError, match="did not survive"):
        _check_lowered(plain, "decode", "fused", {WEIGHT: "fp6_e2m3"})
    exact = matmul_model(weights(64, 32))
    quantize_model(exact)
    lower_model(exact, "exact")
    _check_lowered(exact, "decode", "exact", {WEIGHT: "fp6_e2m3"})  # intact: passes
    with pytest.raises(RuntimeError, match="did not survive"):  # but a fused plan needs MatMulNBits
        _check_lowered(exact, "decode", "fused", {WEIGHT: "fp6_e2m3"})


def hf_logits(checkpoint, tokens: list[int], fmt: str | None, head: str = "int8", embedding: bool = True,
              tiers: tuple[tuple[str, str], ...] = ()) -> np.ndarray:
    """transformers itself with the values an artifact of ModelSpec(mx_format=fmt) stores (if fmt): its
    decoder linear weights in `fmt` but those a (name fragment, format) of `tiers` names first, its LM head
    as `head` says (mx_lm_head: "int8", "fp6", "format", "float32") and its embedding table MXINT8
    (`embedding`); the defaults are ModelSpec's. A tied head is untied first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        for name, p in model.named_parameters():
            layer = name.startswith("model.layers.") and name.endswith("proj.weight")
            tier = next((f for fragment, f in tiers if fragment in name), fmt)
            store = (tier if layer else {"int8": "int8", "fp6": "fp6_e2m3", "format": fmt}.get(head)
                     if name == "lm_head.weight" else None)
            if fmt and store:
                # nn.Linear holds W[N, K]; the graph's MatMul weight is W.T [K, N], blocked along K.
                p.copy_(torch.from_numpy(fake_quantize(p.numpy().T, store, axis=0).T.copy()))
        if fmt and embedding:
            table = model.get_input_embeddings().weight
            table.copy_(torch.from_numpy(fake_quantize(table.numpy(), "int8", axis=1)))
        return model(torch.tensor([tokens])).logits[0].numpy()


MIX = {"mx_format": "fp4_e2m1", "mx_fp6": ("v_proj", "down_proj"), "mx_int8": ("layers.0.self_attn",),
       "mx_lm_head": "fp6"}
MIX_TIERS = (("layers.0.self_attn", "int8"), ("v_proj", "fp6_e2m3"), ("down_proj", "fp6_e2m3"))


@pytest.fixture(scope="module")
def mx_artifacts(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("mx")
    specs = {
        "fused": ModelSpec(model=str(checkpoints["llama-gqa"]), mx_format="fp6_e2m3", mx_lowering="fused"),
        "native": ModelSpec(model=str(checkpoints["llama-gqa"]), mx_format="fp6_e2m3", mx_lowering="native"),
        "native8": ModelSpec(model=str(checkpoints["llama-gqa"]), mx_format="fp6_e2m3"),  # the default lowering
        "exact": ModelSpec(model=str(checkpoints["llama-gqa"]), mx_format="fp6_e2m3", mx_lowering="exact"),
        "e3m2": ModelSpec(model=str(checkpoints["llama-gqa"]), mx_format="fp6_e3m2", mx_lowering="exact"),
        "fp4": ModelSpec(model=str(checkpoints["llama-gqa"]), mx_format="fp4_e2m1"),  # native8: int8 activations
        "fp4_exact": ModelSpec(model=str(checkpoints["llama-gqa"]), mx_format="fp4_e2m1", mx_lowering="exact"),
        # three tiers: MXFP4, MXFP6 (v, down, the head) and MXINT8 (layer 0's attention, over mx_fp6's v_proj)
        # int16 activations where the weights allow, so the tiers' activation widths differ (MXFP4's: always 8)
        "mix": ModelSpec(model=str(checkpoints["llama-gqa"]), **MIX, mx_lowering="native"),
        "mix_exact": ModelSpec(model=str(checkpoints["llama-gqa"]), **MIX, mx_lowering="exact"),
    }
    return {
        k: build_artifact(replace(tiny_recipe(), dlm=None, tlm=s), root / k, progress=False) for k, s in specs.items()
    }


def prompt_logits(artifact, tokens: list[int]) -> np.ndarray:
    runner = Chain(load_artifact(artifact).tlm)
    runner.prefill(np.array(tokens[:-1]))
    return runner.forward("decode", np.array(tokens[-1:]))[0]


TOKENS = [5, 17, 200, 43, 99, 12, 7, 64, 150, 3, 77, 31]


@pytest.mark.parametrize("kind,fmt", [("exact", "fp6_e2m3"), ("e3m2", "fp6_e3m2"), ("fp4_exact", "fp4_e2m1"),
                                      ("mix_exact", "fp4_e2m1")])
def test_exact_artifact_matches_transformers_with_mx_weights(mx_artifacts, checkpoints, kind, fmt):
    ours = prompt_logits(mx_artifacts[kind], TOKENS)
    mix = {"head": "fp6", "tiers": MIX_TIERS} if kind == "mix_exact" else {}
    ref = hf_logits(checkpoints["llama-gqa"], TOKENS, fmt, **mix)[-1]
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    fp32 = hf_logits(checkpoints["llama-gqa"], TOKENS, None)[-1]
    assert np.abs(ours - fp32).max() > 1e-3  # the weights really were quantized


@pytest.mark.parametrize("kind,tolerance,exact", [("fused", 0.02, "exact"), ("native", 1e-4, "exact"),
                                                  ("native8", 0.02, "exact"), ("fp4", 0.02, "fp4_exact"),
                                                  ("mix", 0.02, "mix_exact")])
def test_kernel_artifacts_are_close_to_exact(mx_artifacts, kind, tolerance, exact):
    """fused rounds activations to int8 per block; native (where its library is built) to int16, native8 (the
    default) to int8, and either to int8 with MXFP4 weights."""
    ours, exact = prompt_logits(mx_artifacts[kind], TOKENS), prompt_logits(mx_artifacts[exact], TOKENS)
    if kind == "native" and load_artifact(mx_artifacts[kind]).manifest.models["tlm"].quant["lowering"] != "native":
        tolerance = 0.02  # no library here: the compiler fell back to fused
    assert np.abs(ours - exact).max() < tolerance * np.abs(exact).max()
    assert ours.argmax() == exact.argmax()


@pytest.mark.parametrize("kind", ["fused", "native", "native8", "exact", "e3m2", "fp4"])
def test_mx_artifact_kernels_and_manifest(mx_artifacts, kind):
    """The MX form is 0.41x FP16 (recorded: MXFP6 decoder weights at 0.39x, the MXINT8 LM head at 0.52x);
    the compiled CPU artifact stores what its kernels read: fused keeps every MX weight as MatMulNBits
    8-bit codes (prepacked), native as MXMatMul's codes (6-bit: 24 bytes per 32 weights; MXFP4's 16; the
    head's 8-bit) and E8M0 bytes; neither ever a float weight."""
    root = mx_artifacts[kind]
    quant = load_artifact(root).manifest.models["tlm"].quant
    fp4 = kind == "fp4"
    kind = "native8" if fp4 else kind  # MXFP4 weights: the default lowering
    if kind in ("native", "native8") and library_path() is None:
        kind = "fused"  # the compiler fell back (tested in test_native_kernel.py)
    assert quant["lowering"] == (kind if kind in ("fused", "native", "native8") else "exact")
    assert quant["lowered_weights"] == quant["tensors"] == 15 and quant["lm_head"] and quant["int8_tensors"] == 1
    decoder, head = 73728, 260 * 64  # llama-gqa's decoder linears and LM head, in weights
    bits = 4.25 if fp4 else 6.25
    assert quant["mx_bytes"] == decoder * bits / 8 + head * 8.25 / 8 and quant["fp16_bytes"] == 2 * (decoder + head)
    for graph in ("prefill", "decode", "score3"):
        model = onnx.load(str(root / "tlm" / f"{graph}.onnx"), load_external_data=False)
        inits = {t.name: t for t in model.graph.initializer}
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert len(nbits) == (15 if kind == "fused" else 0)
        for n in nbits:
            b = inits[n.input[1]]
            assert b.data_type == onnx.TensorProto.UINT8
            assert any(e.key.startswith("prepacked") for e in b.external_data)
        native = [n for n in model.graph.node if n.op_type == "MXMatMul" and n.domain == "ai.mxspd"]
        covered = [w for n in native for w in n.input[1].split(SEPARATOR)]  # q/k/v and gate/up packed in one call
        assert (len(native), len(covered)) == ((9, 15) if kind in ("native", "native8") else (0, 0))
        for n in native:
            w, e8m0 = inits[n.input[1]], inits[n.input[2]]
            attrs = {a.name: a.i for a in n.attribute}
            k, n_out = attrs["K"], attrs["N"]
            groups, kb = -(-n_out // 16), -(-k // 32)
            block = 512 if n.input[1].startswith("lm_head") else 256 if fp4 else 384  # MXINT8: 64 bytes per 4 x 16
            assert list(w.dims) == [groups, kb, block] and list(e8m0.dims) == [groups, kb, 16]
            assert attrs["activation_bits"] == (16 if kind == "native" else 8)  # MXFP4 weights: always 8
        if kind in ("fused", "native", "native8"):
            assert not [t for t in inits if t.endswith("proj.weight.T")], "a full-precision decoder weight"


def test_a_mixed_recipe_stores_each_tier_and_runs_each_in_its_kernel(mx_artifacts):
    """MIX: MXINT8 where mx_int8 names a weight (over mx_fp6's v_proj in layer 0), MXFP6 where mx_fp6 or
    mx_lm_head = "fp6" does, MXFP4 elsewhere; each in its own MXMatMul (4, 6 or 8 bits; under `native`, int8
    activations with MXFP4 only), counted in the manifest's bytes."""
    quant = load_artifact(mx_artifacts["mix"]).manifest.models["tlm"].quant
    if quant["lowering"] != "native":
        pytest.skip("mxspd's kernel library is not built here")
    assert (quant["int8_tensors"], quant["fp6_tensors"], quant["tensors"]) == (4, 4, 15)
    assert quant["fp6"] == ["v_proj", "down_proj", "lm_head"] and quant["int8"] == ["layers.0.self_attn"]
    int8, fp6, fp4 = 4096 + 2048 + 2048 + 4096, 2048 + 2 * 8192 + 260 * 64, 2 * 2 * 8192 + 4096 + 2048 + 4096
    assert int8 + fp6 + fp4 == 73728 + 260 * 64
    assert quant["mx_bytes"] == (int8 * 8.25 + fp6 * 6.25 + fp4 * 4.25) / 8
    model = onnx.load(str(mx_artifacts["mix"] / "tlm" / "decode.onnx"), load_external_data=False)
    bits = {}
    for n in model.graph.node:
        if n.op_type == "MXMatMul":
            attrs = {a.name: a.i for a in n.attribute}
            for w in n.input[1].split(SEPARATOR):
                bits[w.split(".weight")[0]] = (attrs["weight_bits"], attrs["activation_bits"])
    assert bits["layers.0.self_attn.v_proj"] == bits["layers.0.self_attn.q_proj"] == (8, 16)
    assert bits["layers.1.self_attn.v_proj"] == bits["layers.1.mlp.down_proj"] == bits["lm_head"] == (6, 16)
    assert bits["layers.1.self_attn.q_proj"] == bits["layers.0.mlp.gate_proj"] == (4, 8)
    assert len(bits) == 15


def test_float16_storage_matches_transformers_with_rounded_weights(checkpoints, tmp_path):
    """dtype = "float16": weight values float16-rounded (folded to float32 at build time, where
    RowMatMul's panels are made), arithmetic float32."""
    from transformers import AutoModelForCausalLM

    ck = checkpoints["llama-gqa"]
    recipe = replace(tiny_recipe(), dlm=None, tlm=ModelSpec(model=str(ck), dtype="float16"))
    art_dir = build_artifact(recipe, tmp_path / "fp16", progress=False)
    art = load_artifact(art_dir)
    assert art.manifest.models["tlm"].dtype == "float16"
    decode = onnx.load(str(art_dir / "tlm" / "decode.onnx"), load_external_data=True)
    panels = [t for t in decode.graph.initializer if t.name.endswith("proj.weight.T.panels")]
    mats = [onnx.numpy_helper.to_array(t) for t in panels]
    assert sum(len(t.name.split(SEPARATOR)) for t in panels) == 14  # gate/up packed (compiler.pack_matmuls)
    assert all(np.array_equal(m, m.astype(np.float16).astype(np.float32)) for m in mats)
    ours = prompt_logits(art_dir, TOKENS)
    model = AutoModelForCausalLM.from_pretrained(ck, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
        ref = model(torch.tensor([TOKENS])).logits[0, -1].numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_export_cli_mx_flags(checkpoints, tmp_path, capsys):
    from export.__main__ import main

    recipe = recipe_file(tmp_path / "r.toml", checkpoints["llama-gqa"])
    out = tmp_path / "art"
    assert main(["--recipe", str(recipe), "--mx-format", "fp6_e3m2", "--out", str(out), "--quiet"]) == 2
    assert "exact" in capsys.readouterr().err and not out.exists()
    assert main(["--recipe", str(recipe), "--mx-format", "fp6_e2m3", "--out", str(out), "--quiet"]) == 0
    expected = "native8" if library_path() is not None else "fused"  # the default, or its fallback
    assert load_artifact(out).manifest.models["tlm"].quant["lowering"] == expected


@pytest.mark.parametrize("lowering", ["fused", "native"])
def test_a_memo_lowers_each_weight_once_for_all_graphs_of_a_model(tmp_path, monkeypatch, lowering):
    """The graphs of one model read the same exported weights: with a memo the second graph takes
    the first one's lowered tensors (no recomputation) and ends up with the same bytes."""
    from common.onnx_store import read_tensor

    model = matmul_model(weights(256, 64))
    quantize_model(model)
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="w.bin",
                    size_threshold=0)
    computed = []
    by_column, pack = mx_lowering._by_column, mx_lowering.pack_scales
    monkeypatch.setattr(mx_lowering, "_by_column", lambda *a: computed.append("fused") or by_column(*a))
    monkeypatch.setattr(mx_lowering, "pack_scales", lambda *a: computed.append("native") or pack(*a))
    memo, lowered = {}, []
    for _ in range(2):
        graph = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
        assert lower_model(graph, lowering, read=lambda t: read_tensor(t, tmp_path), memo=memo) == {WEIGHT: "fp6_e2m3"}
        lowered.append({t.name: t.raw_data for t in graph.graph.initializer})
    assert computed == [lowering]  # the first graph computed it, the second did not
    other = "native" if lowering == "fused" else "fused"  # the same weight for another lowering: not a hit
    lower_model(onnx.load(str(tmp_path / "m.onnx"), load_external_data=False), other,
                read=lambda t: read_tensor(t, tmp_path), memo=memo)
    assert computed == [lowering, other]
    computed.clear()
    assert lowered[0] == lowered[1] and any(len(v) > 1000 for v in lowered[1].values())
    fresh = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    lower_model(fresh, lowering, read=lambda t: read_tensor(t, tmp_path))  # the control: no memo, computed again
    assert computed == [lowering]
    assert {t.name: t.raw_data for t in fresh.graph.initializer} == lowered[0]


def embedding_model(table: np.ndarray, ids_shape: tuple[int, ...] = (1, 5)) -> onnx.ModelProto:
    v, k = table.shape
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed_tokens.weight", "input_ids"], ["rows"])], "embed",
        [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, list(ids_shape))],
        [helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, [*ids_shape, k])],
        [numpy_helper.from_array(table, "embed_tokens.weight")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("lowering", ["exact", "fused", "native"])
@pytest.mark.parametrize("k", [64, 70])
def test_an_mx_embedding_table_is_gathered_then_dequantized_exactly(lowering, k):
    """mx_embedding: the table becomes standard MXINT8 blocks along K (onnx's reference decodes them to
    the MX values), and every lowering gathers the rows' codes and dequantizes only them, giving those
    values bit for bit, with no float copy of the table left in the graph."""
    table = weights(300, k).astype(np.float32)
    table[7] *= 1e-37  # blocks whose MX exponent is below 6
    model = embedding_model(table)
    mx = MXPass("fp6_e2m3", embedding=True)
    assert apply_passes(model, [mx]) == 1 and mx.summary().embedding
    onnx.checker.check_model(model, full_check=True)
    ids = np.array([[0, 7, 299, 7, 42]])
    want = fake_quantize(table, "int8", axis=1)[ids]
    standard = ReferenceEvaluator(model).run(None, {"input_ids": ids})[0]
    np.testing.assert_array_equal(standard[0, [0, 2, 4]], want[0, [0, 2, 4]])
    np.testing.assert_allclose(standard[0, [1, 3]], want[0, [1, 3]], rtol=0, atol=2.0**-128)
    assert lower_model(model, lowering) == {}  # no matmul weight: nothing for a kernel to keep
    assert not [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.dims[0] == 300]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"input_ids": ids})[0], standard)


def test_mx_embedding_needs_a_table():
    mx = MXPass(embedding=True)
    apply_passes(matmul_model(weights(64, 24)), [mx])
    with pytest.raises(ValueError, match="no embedding table"):
        mx.info()


@pytest.mark.parametrize("lowering", ["exact", "native"])
def test_mx_embedding_artifact_matches_transformers_with_its_mxint8_table(checkpoints, tmp_path, lowering):
    """mx_embedding end to end: the exported, compiled artifact equals transformers with the same MX
    decoder weights and the table's MXINT8 values (exact to 1e-4; native as the other kernel artifacts),
    its graphs gather int8 rows from no float32 table, and the manifest says so."""
    ck = checkpoints["llama-gqa"]
    spec = ModelSpec(model=str(ck), mx_format="fp6_e2m3", mx_lowering=lowering)  # the default: mx_embedding "int8"
    art_dir = build_artifact(replace(tiny_recipe(), dlm=None, tlm=spec), tmp_path / "emb", progress=False)
    plain = build_artifact(replace(tiny_recipe(), dlm=None, tlm=replace(spec, mx_embedding="float32")),
                           tmp_path / "plain", progress=False)
    ours = prompt_logits(art_dir, TOKENS)
    ref = hf_logits(ck, TOKENS, "fp6_e2m3")[-1]
    np.testing.assert_allclose(ours, ref, atol=1e-4 if lowering == "exact" else 1e-4 * np.abs(ref).max(), rtol=1e-4)
    assert np.abs(ours - prompt_logits(plain, TOKENS)).max() > 1e-5  # the table really was quantized
    assert load_artifact(art_dir).manifest.models["tlm"].quant["embedding"]
    model = onnx.load(str(art_dir / "tlm" / "decode.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    assert inits["embed_tokens.weight.rows_int8"].data_type == onnx.TensorProto.INT8
    assert not [t for t in inits.values() if t.data_type == onnx.TensorProto.FLOAT and list(t.dims[:1]) == [vocab]]
