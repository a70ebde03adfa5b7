"""The exported graphs read the KV cache in place: no per-call copy of the C slots (export/split_attention.py).

Parity with transformers is tests/test_export_parity.py; here: the graph structure, what ONNX Runtime
makes of it, and agreement with transformers' own concat attention under arbitrary masks.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import inliner, shape_inference

from common import graph_io
from common.targets import TARGETS
from export.onnx_export import model_dims, trace_graph
from tests.conftest import make_model

C = 24


def _cache_copies(graph: onnx.ModelProto) -> list[list[int]]:
    """Output shapes of the Concat nodes that build a [B, H, >= C, D] tensor: a copy of a layer's cache."""
    inferred = shape_inference.infer_shapes(graph)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    out = [shapes.get(n.output[0], []) for n in graph.graph.node if n.op_type == "Concat"]
    return [s for s in out if len(s) == 4 and s[2] >= C]


def _cache_readers(graph: onnx.ModelProto, name: str) -> list[str]:
    """Ops reading the tensor's data (a Shape reads only its static shape)."""
    return [n.op_type for n in graph.graph.node if name in n.input and n.op_type != "Shape"]


@pytest.fixture(scope="module")
def llama():
    return make_model("llama-gqa", seed=7)


@pytest.mark.parametrize("tokens", [1, 4])
def test_graph_does_not_copy_the_cache(llama, tokens):
    dims = model_dims(llama)
    traced = trace_graph(llama, tokens, C)
    for i in range(dims.n_layers):  # one node per layer, whose function the compiler keeps or inlines
        assert _cache_readers(traced, graph_io.past_key(i)) == ["Attention"]
    split = inliner.inline_local_functions(traced)
    assert _cache_copies(split) == []
    for i in range(dims.n_layers):
        assert _cache_readers(split, graph_io.past_key(i)) == ["Transpose"]  # -> MatMul, fused by ORT below
        assert _cache_readers(split, graph_io.past_value(i)) == ["MatMul"]
    # negative control: transformers' attention concatenates past and new KV in every layer
    concat = trace_graph(llama, tokens, C, split_attention=False)
    assert _cache_copies(concat) == [[1, dims.n_kv_heads, C + tokens, dims.head_dim]] * (2 * dims.n_layers)


def test_ort_reads_the_keys_through_a_transposed_matmul(llama, tmp_path):
    """The compiler's offline optimisation folds q @ k^T's Transpose into FusedMatMul(transB): no copy either."""
    onnx.save(trace_graph(llama, 1, C), tmp_path / "decode.onnx")
    so = ort.SessionOptions()
    so.graph_optimization_level = TARGETS["ort-cpu"].offline_level
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(tmp_path / "decode.onnx"), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(tmp_path / "opt.onnx"))
    for i in range(model_dims(llama).n_layers):
        readers = [n for n in opt.graph.node if graph_io.past_key(i) in n.input]
        assert [n.op_type for n in readers] == ["FusedMatMul"]
        assert {a.name: a.i for a in readers[0].attribute}["transB"] == 1
        assert _cache_readers(opt, graph_io.past_value(i)) == ["MatMul"]


@pytest.mark.parametrize("kind", ["llama-gqa", "codegen"])
def test_split_matches_concat_attention_under_random_masks(kind, tmp_path):
    """Any mask the host may build (holes in the cache, new tokens hidden from each other) gives the same outputs."""
    model = make_model(kind, seed=5)
    dims, t = model_dims(model), 4
    rng = np.random.default_rng(0)
    mask = rng.random((1, t, C + t)) < 0.5
    mask[0, np.arange(t), C + np.arange(t)] = True  # every token sees itself
    feeds = {graph_io.INPUT_IDS: rng.integers(4, 260, (1, t)), graph_io.POSITION_IDS: rng.integers(0, 64, (1, t)),
             graph_io.ATTENTION_MASK: mask}
    for name, shape in graph_io.input_shapes(dims, 1, t, C).items():
        feeds.setdefault(name, rng.standard_normal(shape).astype(np.float32))
    outs = {}
    for split in (True, False):
        onnx.save(trace_graph(model, t, C, split_attention=split), tmp_path / f"{split}.onnx")
        outs[split] = ort.InferenceSession(str(tmp_path / f"{split}.onnx")).run(None, feeds)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.shape == b.shape and np.abs(a - b).max() <= 1e-4
