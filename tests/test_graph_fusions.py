"""The compiler's fusions: rotary embeddings (compiler/rotary.py, kernels/rotary.cc), head layouts folded
into the kernels (compiler/layouts.py), packed MXMatMuls (compiler/pack_matmuls.py) and the packed
q/k/v split into heads (compiler/split_heads.py) give the same bits as the nodes they replace; the
residual norms (compiler/skip_norm.py) and the MLP gate (compiler/swiglu.py) the same values within
float32 rounding, and both folded into MXMatMul (compiler/matmul_prologue.py) the bits of those ops;
on small graphs and on whole compiled models; patterns that are not theirs stay as exported."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kernels
import runtime
from benchmarks.chain import Chain
from common import graph_io
from common.targets import session_options
from compiler import build
from compiler.layouts import tensor_shapes
from compiler.matmul_prologue import fuse_matmul_prologues
from compiler.rotary import fuse_rotary
from compiler.skip_norm import fuse_skip_norms
from export.pipeline import build_artifact
from kernels.layout import pack_columns, pack_panels, pack_scales
from tests.conftest import FORMATS, tiny_recipe
from tests.test_native_kernel import random_mx

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
    """Every graph of a Llama- or Qwen2-shaped model has its rotary embeddings fused and no Neg left,
    one matmul call for gate/up (and for q/k/v in MXFP6: float32 k and v fill half a panel here), one
    SwiGLU per layer, and every residual Add in a SkipSimplifiedLayerNormalization, both folded into the
    matmul that reads them (compiler/matmul_prologue.py); the LM head's matmul writes the logits output
    (no Cast copies them). Where the packed q/k/v call feeds the rotary ops directly (Llama; Qwen2 adds
    biases between), one RotaryAttention per layer splits it into heads and attends, with no Reshape or
    Transpose left; else one Rotary per query and key, and a Reshape and a Transpose for the values (a
    graph output). Without SwiGLU (whose sigmoid is not QuickGelu's), its logits are the bits of the same
    model compiled without the fusions that keep bits; with it, within float32 rounding of them."""
    recipe = replace(tiny_recipe(), dlm=None, tlm=FORMATS[fmt])

    def build_it(name: str) -> runtime.Artifact:
        return runtime.load_artifact(build_artifact(recipe, tmp_path / name, tlm=str(checkpoints[kind]),
                                                    progress=False))

    fused = build_it("fused")
    layers = fused.tlm.dims.n_layers
    split_heads = kind == "llama-gqa" and fmt == "mx-native"
    calls_of = {"mx-native": (kernels.MX_MATMUL, 4 * layers + 1),  # qkv, o, gate+up, down; the MXINT8 LM head
                "float32": (kernels.ROW_MATMUL, 6 * layers + 1)}  # q, k, v, o, gate+up, down; LM head
    for g in fused.manifest.models["tlm"].graphs.values():
        nodes = onnx.load(str(fused.path / g.file), load_external_data=False).graph.node
        ops = [n.op_type for n in nodes]
        # the LM head's matmul writes the logits output itself: no Cast to float32 copies them (output_casts.py)
        assert [n.op_type for n in nodes if graph_io.LOGITS in n.output] == [calls_of[fmt][0]], g.file
        assert ops.count(kernels.ROTARY_ATTENTION) == (layers if split_heads else 0), g.file  # with its RotaryQKV
        assert ops.count(kernels.ROTARY_QKV) == 0 and ops.count(kernels.ATTENTION) == (0 if split_heads else layers)
        assert ops.count(kernels.ROTARY) == (0 if split_heads else 2 * layers) and "Neg" not in ops, g.file
        calls = calls_of[fmt]
        assert ops.count(calls[0]) == calls[1], g.file
        table = int(bool(fused.manifest.models["tlm"].quant.get("embedding")))  # the MXINT8 table's rows: a Reshape
        assert ops.count("Reshape") - table == ops.count("Transpose") == (0 if split_heads else layers), g.file
        # folded into the matmul that reads them, the final norm into the LM head's; not where three read
        # it (float32's q, k and v calls, unpacked here: layers 1.. ; layer 0's norm has no residual)
        norms = layers - 1 if fmt == "float32" else 0
        norms += g.file.endswith(f"/{graph_io.PREFILL_LAST}.onnx")  # the final norm, then its last row: unfused
        assert ops.count("SkipSimplifiedLayerNormalization") == norms and ops.count(kernels.SWIGLU) == 0, g.file
        assert "QuickGelu" not in ops, g.file
        assert ops.count("Add") == (3 * layers if kind == "qwen2" else 0), g.file  # Qwen2's q/k/v biases
    monkeypatch.setattr(build, "fuse_swiglu", lambda model: 0)
    kept = build_it("bits-kept")
    monkeypatch.setattr(build, "fuse_rotary", lambda model, read, shapes: 0)
    monkeypatch.setattr(build, "fold_layouts", lambda model, shapes: 0)
    monkeypatch.setattr(build, "pack_matmuls", lambda model, read, store, concat=None: 0)
    monkeypatch.setattr(build, "fuse_split_heads", lambda model, shapes: 0)
    monkeypatch.setattr(build, "drop_output_casts", lambda model: 0)
    unfused = build_it("unfused")
    quant = [art.manifest.models["tlm"].quant for art in (fused, unfused)]
    assert quant[0].get("lowered_weights") == quant[1].get("lowered_weights")  # every MX weight still in its kernel
    prompt = np.array([0, 5, 9, 13, 21, 3, 7])
    chains = [Chain(art.tlm) for art in (fused, kept, unfused)]
    starts = [chain.start(prompt[:-1]).copy() for chain in chains]
    decodes = [chain.forward("decode", prompt[-1:]) for chain in chains]
    for logits in starts, decodes:
        np.testing.assert_array_equal(logits[1], logits[2])
        np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def residual_model(bias: bool = False, axis: int = -1, broadcast: bool = False) -> onnx.ModelProto:
    """Two residual Adds of computed tensors (Relu stands for a layer), each normalised, as ONNX Runtime leaves
    a Llama graph; `bias`: the first Add adds a constant instead; `axis`: the norms' axis; `broadcast`: the
    first Add's second input is [1, 1, H]."""
    f, hidden = TensorProto.FLOAT, 16
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 2, hidden).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "bias")]
    norm = lambda x, y: helper.make_node("SimplifiedLayerNormalization", [x, "gamma"], [y], axis=axis,  # noqa: E731
                                         epsilon=1e-5, stash_type=1)
    nodes = [helper.make_node("Relu", ["a"], ["ra"]), helper.make_node("Relu", ["b"], ["rb"]),
             helper.make_node("Add", ["ra", "bias" if bias else "rb"], ["s1"]), norm("s1", "n1"),
             helper.make_node("Relu", ["n1"], ["layer"]), helper.make_node("Add", ["s1", "layer"], ["s2"]),
             norm("s2", "y")]
    shapes = {"a": [2, 3, hidden], "b": [1, 1, hidden] if broadcast else [2, 3, hidden]}
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info(n, f, shapes[n]) for n in "ab"],
                              [helper.make_tensor_value_info("y", f, [2, 3, hidden])], inits,
                              value_info=[helper.make_tensor_value_info("layer", f, [2, 3, hidden])])  # past the norm
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_residual_adds_and_their_norms_fuse_into_one_op_with_the_same_values():
    model = residual_model()
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_skip_norms(fused, tensor_shapes(model)) == 2
    assert [n.op_type for n in fused.graph.node] == ["Relu", "Relu", "SkipSimplifiedLayerNormalization", "Relu",
                                                     "SkipSimplifiedLayerNormalization"]
    rng = np.random.default_rng(1)
    x = {n: rng.standard_normal((2, 3, 16)).astype(np.float32) * 4 for n in "ab"}
    np.testing.assert_allclose(run(fused, x), run(model, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{"bias": True}, {"broadcast": True}, {"axis": 1}])
def test_a_constant_added_a_broadcast_or_another_axis_is_left_alone(kw):
    """A bias Add (one input an initializer) is not a residual, nor an Add that broadcasts (the op does not);
    a norm over another axis is not the op's. The second Add, a residual, still fuses in the first two."""
    model = residual_model(**kw)
    assert fuse_skip_norms(model, tensor_shapes(model)) == (0 if "axis" in kw else 1)


def layer_model(k: int = 96, f: int = 70, n: int = 40, shared_norm: bool = False, op: str = kernels.MX_MATMUL
                ) -> onnx.ModelProto:
    """A residual norm feeding a matmul (MXMatMul, or RowMatMul on float32 weights), its output gated by
    SwiGLU into a second one, as a Llama MLP compiles; `shared_norm`: a Relu reads the norm too."""
    rng = np.random.default_rng(3)
    gamma = rng.uniform(0.5, 2, k).astype(np.float32)
    inits = [numpy_helper.from_array(gamma, "gamma")]
    for i, (kk, nn) in enumerate(((k, 2 * f), (f, n)), start=1):
        if op == kernels.MX_MATMUL:
            codes, exps = random_mx(kk, nn, seed=i)
            weights = [pack_columns(codes), pack_scales(exps)]
        else:
            weights = [pack_panels(rng.standard_normal((kk, nn)).astype(np.float32))]
        inits += [numpy_helper.from_array(w, f"w{i}.{j}") for j, w in enumerate(weights)]

    def mx(x, i, y, kk, nn):
        names = [t.name for t in inits if t.name.startswith(f"w{i}.")]
        attrs = {"K": kk, "N": nn} if op == kernels.MX_MATMUL else {"N": nn}
        return helper.make_node(op, [x, *names], [y], domain=kernels.DOMAIN, **attrs)

    nodes = [helper.make_node("SkipSimplifiedLayerNormalization", ["a", "b", "gamma"], ["n", "", "", "sum"],
                              domain="com.microsoft", epsilon=1e-5),
             mx("n", 1, "gu", k, 2 * f),
             helper.make_node(kernels.SWIGLU, ["gu"], ["g"], domain=kernels.DOMAIN),
             mx("g", 2, "y", f, n)]
    outputs = ["y", "sum"]
    if shared_norm:
        nodes.append(helper.make_node("Relu", ["n"], ["r"]))
        outputs.append("r")
    fl = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info(x, fl, [None, k]) for x in "ab"],
                              [helper.make_tensor_value_info(o, fl, None) for o in outputs], inits)
    opsets = [helper.make_opsetid(d, v) for d, v in (("", 18), ("com.microsoft", 1), (kernels.DOMAIN, 1))]
    return helper.make_model(graph, opset_imports=opsets)


def run_all(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@needs_library
@pytest.mark.parametrize("op", [kernels.MX_MATMUL, kernels.ROW_MATMUL])
def test_norms_and_gates_fold_into_their_matmul_with_the_bits_of_the_nodes_they_replace(op):
    """The matmuls' prologues compute ONNX Runtime's SkipSimplifiedLayerNormalization and mxspd's SwiGLU bit
    for bit, the residual sum included, for any rows (a row's bits alone, whatever shares its call)."""
    model = layer_model(op=op)
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_matmul_prologues(fused) == 2
    assert [n.op_type for n in fused.graph.node] == [op] * 2
    rng = np.random.default_rng(4)
    x = {n: (rng.standard_normal((9, 96)) * rng.uniform(0.1, 30, (9, 1))).astype(np.float32) for n in "ab"}
    want, got = run_all(model, x), run_all(fused, x)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(g, w)
    for rows in ([0], [3, 8], [2, 5, 6, 7]):
        one = run_all(fused, {n: v[rows] for n, v in x.items()})
        np.testing.assert_array_equal(one[0], got[0][rows])


@needs_library
def test_a_norm_that_another_node_reads_keeps_its_own_node():
    model = layer_model(shared_norm=True)
    assert fuse_matmul_prologues(model) == 1  # the gate only
    assert [n.op_type for n in model.graph.node].count("SkipSimplifiedLayerNormalization") == 1
