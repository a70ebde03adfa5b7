"""The compiler's fusions: rotary embeddings (compiler/rotary.py, kernels/rotary.cc), head layouts folded
into the kernels (compiler/layouts.py) and packed MXMatMuls (compiler/pack_matmuls.py) give the same
bits as the nodes they replace, on small graphs and on whole compiled models; patterns that are not
theirs stay as exported."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kernels
import runtime
from common.targets import session_options
from compiler import build
from compiler.rotary import fuse_rotary
from export.pipeline import build_artifact
from tests.conftest import FORMATS, tiny_recipe

needs_library = pytest.mark.skipif(kernels.library_path() is None, reason="native kernel library not built here")
T, H, D = 5, 3, 8


def rope_model(form: str, lower: int = D // 2, concat_first: str = "neg") -> onnx.ModelProto:
    """P [1, T, H*D] -> heads -> transposed -> x * cos + rotate_half(x) * sin, as torch exports it
    (`slice`: two Slices; `split`: ONNX Runtime's fusion of them)."""
    c = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    inits = [c("shape", [1, T, H, D]), c("lo", [lower]), c("zero", [0]), c("big", [2**62]), c("axis", [-1]),
             c("sizes", [lower, D - lower])]
    nodes = [helper.make_node("Reshape", ["p", "shape"], ["r"]),
             helper.make_node("Transpose", ["r"], ["x"], perm=[0, 2, 1, 3])]
    if form == "split":
        nodes.append(helper.make_node("Split", ["x", "sizes"], ["x1", "x2"], axis=3))
    else:
        nodes += [helper.make_node("Slice", ["x", "zero", "lo", "axis"], ["x1"]),
                  helper.make_node("Slice", ["x", "lo", "big", "axis"], ["x2"])]
    halves = ["n", "x1"] if concat_first == "neg" else ["x1", "n"]
    nodes += [helper.make_node("Neg", ["x2"], ["n"]), helper.make_node("Concat", halves, ["turned"], axis=-1),
              helper.make_node("Mul", ["x", "cos"], ["a"]), helper.make_node("Mul", ["sin", "turned"], ["b"]),
              helper.make_node("Add", ["a", "b"], ["y"])]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info("p", f, [1, T, H * D]),
                                              helper.make_tensor_value_info("cos", f, [1, 1, T, D]),
                                              helper.make_tensor_value_info("sin", f, [1, 1, T, D])],
                              [helper.make_tensor_value_info("y", f, [1, H, T, D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)])


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    angles = rng.uniform(-20, 20, (1, 1, T, D)).astype(np.float32)
    return {"p": rng.standard_normal((1, T, H * D)).astype(np.float32) * 3,
            "cos": np.cos(angles), "sin": np.sin(angles)}


@needs_library
@pytest.mark.parametrize("form", ["slice", "split"])
def test_the_fused_op_gives_the_bits_of_the_nodes_it_replaces(form):
    model = rope_model(form)
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_rotary(fused) == 1
    assert [n.op_type for n in fused.graph.node] == ["Reshape", kernels.ROTARY]
    for seed in range(3):
        x = feeds(seed)
        np.testing.assert_array_equal(run(fused, x), run(model, x))


@pytest.mark.parametrize("kw", [{"lower": 3}, {"concat_first": "x1"}])
def test_what_is_not_rotate_half_is_left_alone(kw):
    """Unequal halves (partial rotary) or the halves the other way round (a rotation by -angle)."""
    model = rope_model("slice", **kw)
    assert fuse_rotary(model) == 0
    assert kernels.ROTARY not in {n.op_type for n in model.graph.node}


@needs_library
@pytest.mark.parametrize(("kind", "fmt"), [("llama-gqa", "mx-native"), ("qwen2", "mx-native"),
                                         ("llama-gqa", "float32")])
def test_compiled_models_fuse_every_layer_and_keep_their_bits(kind, fmt, checkpoints, tmp_path, monkeypatch):
    """Every graph of a Llama- or Qwen2-shaped model has one Rotary per query and key and no Neg left,
    one matmul call for gate/up (and for q/k/v in MXFP6: float32 k and v fill half a panel here), a
    Reshape and a Transpose only for the values (a graph output), and its logits are the bits of the
    same model compiled without any fusion."""
    recipe = replace(tiny_recipe(), dlm=None, tlm=FORMATS[fmt])
    fused = runtime.load_artifact(build_artifact(recipe, tmp_path / "fused", tlm=str(checkpoints[kind]),
                                                 progress=False))
    layers = fused.tlm.dims.n_layers
    for g in fused.manifest.models["tlm"].graphs.values():
        ops = [n.op_type for n in onnx.load(str(fused.path / g.file), load_external_data=False).graph.node]
        assert ops.count(kernels.ROTARY) == 2 * layers and "Neg" not in ops, g.file
        calls = {"mx-native": (kernels.MX_MATMUL, 4 * layers),  # qkv, o, gate+up, down
                 "float32": (kernels.ROW_MATMUL, 6 * layers + 1)}[fmt]  # q, k, v, o, gate+up, down; LM head
        assert ops.count(calls[0]) == calls[1], g.file
        assert ops.count("Reshape") == ops.count("Transpose") == layers, g.file
    monkeypatch.setattr(build, "fuse_rotary", lambda model, read, shapes: 0)
    monkeypatch.setattr(build, "fold_layouts", lambda model, shapes: 0)
    monkeypatch.setattr(build, "pack_matmuls", lambda model, read, store: 0)
    unfused = runtime.load_artifact(build_artifact(recipe, tmp_path / "unfused", tlm=str(checkpoints[kind]),
                                                   progress=False))
    quant = [art.manifest.models["tlm"].quant for art in (fused, unfused)]
    assert quant[0].get("lowered_weights") == quant[1].get("lowered_weights")  # every MX weight still in its kernel
    prompt = np.array([0, 5, 9, 13, 21, 3, 7])
    starts = [art.tlm.start(prompt[:-1]).copy() for art in (fused, unfused)]
    np.testing.assert_array_equal(*starts)
    np.testing.assert_array_equal(fused.tlm.forward("decode", prompt[-1:]), unfused.tlm.forward("decode", prompt[-1:]))
