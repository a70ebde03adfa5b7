"""The compiler's disk: what a 7B export needs beside its checkpoint (docs/benchmarks.md, "Real sizes").

Three things keep it near the artifact's size, each checked against a build without it (the control),
and both builds must compute the same logits, bit for bit:
- the packed q/k/v and gate/up weights point at their members' bytes, which lie back to back in the
  lowered weights file (SharedFile.span): no weight is written twice;
- ONNX Runtime's optimised copy of a graph holds no weight that only mxspd's kernels read (they are graph
  inputs while it optimises, then put back pointing at the lowered weights);
- a temporary export's weights file is gone before the artifact's is written.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from transformers import AutoModelForCausalLM, LlamaConfig

import runtime
from benchmarks.chain import Chain
from common import graph_io
from common.onnx_store import SharedFile, read_tensor, shared_file
from compiler import build
from export import pipeline
from kernels import DOMAIN
from recipes.default_pair import byte_tokenizer
from tests.conftest import COMMON, FORMATS, tiny_recipe


def _readers(model: onnx.ModelProto) -> dict[str, set[str]]:
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.domain)
    return readers


def _location(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _kernel_weight_files(graph: Path) -> set[str]:
    """The files holding the initializers that only mxspd's ops read in an optimised graph."""
    model = onnx.load(str(graph), load_external_data=False)
    readers = _readers(model)
    return {_location(t)["location"] for t in model.graph.initializer
            if readers.get(t.name) == {DOMAIN} and t.data_location == onnx.TensorProto.EXTERNAL}


def _dead(shared: SharedFile, graphs: list[Path]) -> dict[str, int]:
    """What was written to the lowered weights file that no lowered graph reads: {tensor's key: bytes}."""
    live = []
    for path in graphs:
        for t in onnx.load(str(path), load_external_data=False).graph.initializer:
            where = _location(t)
            if where.get("location") == shared.name:
                live.append((int(where["offset"]), int(where["length"])))
    return {key.rsplit(":", 1)[0]: n for key, (o, n) in shared.offsets.items()
            if not any(a <= o and o + n <= a + m for a, m in live)}


@pytest.fixture(scope="module")
def aligned(tmp_path_factory) -> Path:
    """A Llama whose q/k/v and gate/up codes and scales fill whole 4 KiB pages or stay inline (as at 7B
    widths, where they fill pages), so they pack in place."""
    torch.manual_seed(5)
    config = LlamaConfig(hidden_size=128, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, **COMMON)
    path = tmp_path_factory.mktemp("aligned") / "ck"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _build(out: Path, tlm: Path, monkeypatch: pytest.MonkeyPatch, lean: bool) -> dict:
    """Build an MX artifact; `lean=False`: packing by copying, the kernels' weights left in the graph while
    ONNX Runtime optimises, and the export kept to the end."""
    seen: dict = {"kernel_files": [], "export_at_merge": [], "lowered": []}
    real_lower, real_optimize, real_merge = build._lower, build._optimize, build.merge_external
    real_compile = pipeline.compile_artifact

    def lower(export_dir, name, lowering, invariant, shared, memo, *rest):
        result = real_lower(export_dir, name, lowering, invariant, shared, memo, *rest)
        seen["shared"] = shared
        seen["lowered"].append(result[0])
        return result

    def optimize(graph: Path, target: str, workdir: Path) -> Path:
        optimised = real_optimize(graph, target, workdir)
        seen["kernel_files"].append(_kernel_weight_files(optimised))
        return optimised

    def merge(graphs, out_dir: Path, weights_name: str):
        exports = list(out.parent.glob(f".{out.name}.export-*/tlm/{build.EXPORT_INFO}"))
        seen["export_at_merge"] += [(e.parent / json.loads(e.read_text())["weights"]).exists() for e in exports]
        seen["dead"] = _dead(seen["shared"], seen["lowered"])
        first = onnx.load(str(seen["lowered"][0]), load_external_data=False)
        seen["packed"] = sorted(t.name for t in first.graph.initializer if t.name.endswith(".mx6") and "|" in t.name)
        return real_merge(graphs, out_dir, weights_name)

    with monkeypatch.context() as m:
        m.setattr(build, "_lower", lower)
        m.setattr(build, "_optimize", optimize)
        m.setattr(build, "merge_external", merge)
        if not lean:
            m.setattr(SharedFile, "span", lambda self, members, name: None)
            m.setattr(build, "_lift", lambda model, floats: [])
            m.setattr(pipeline, "compile_artifact", lambda *a, **k: real_compile(*a, **k | {"consume_exports": False}))
        recipe = replace(tiny_recipe(), tlm=FORMATS["mx-native"], dlm=None)
        seen["artifact"] = pipeline.build_artifact(recipe, out, tlm=str(tlm), progress=False)
    return seen


@pytest.fixture(scope="module")
def builds(tmp_path_factory, aligned) -> dict[bool, dict]:
    monkeypatch = pytest.MonkeyPatch()
    try:
        return {lean: _build(tmp_path_factory.mktemp("disk") / f"lean-{lean}", aligned, monkeypatch, lean)
                for lean in (True, False)}
    finally:
        monkeypatch.undo()


def test_packed_weights_point_at_their_members_and_no_weight_is_written_twice(builds):
    assert builds[True]["dead"] == {}
    assert sum(builds[False]["dead"].values()) >= 5 * 128 * 128 * 6 // 8  # the control: q, k, v, gate, up twice
    assert len(builds[True]["packed"]) == 2  # q|k|v and gate|up, in place


def test_onnx_runtimes_optimised_copy_holds_none_of_the_kernels_weights(builds):
    lean, control = builds[True], builds[False]
    assert lean["kernel_files"] and all(files == {"lowered.bin"} for files in lean["kernel_files"])
    # the control: optimised with the weights in the graph, ONNX Runtime wrote its own copy of each
    assert all(files and all(f.startswith("opt-") for f in files) for files in control["kernel_files"])


def test_a_temporary_exports_weights_are_gone_before_the_artifact_is_written(builds):
    assert builds[True]["export_at_merge"] == [False]
    assert builds[False]["export_at_merge"] == [True]  # the control: kept, it would sit beside the artifact


def test_the_lean_build_computes_what_the_full_one_does(builds):
    arts = [runtime.load_artifact(builds[lean]["artifact"]) for lean in (True, False)]
    logits = []
    for art in arts:
        logits.append(Chain(art.tlm).forward(graph_io.PREFILL, np.arange(3, 11)))
    np.testing.assert_array_equal(*logits)
    a, b = (runtime.generate(art, "def f(x):", max_new_tokens=12) for art in arts)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_a_span_needs_its_members_back_to_back_in_the_file(tmp_path):
    arrays = [np.full((2, 2048), i, np.uint8) for i in range(3)]  # 4 KiB each: no padding between them
    with shared_file(tmp_path / "w.bin") as shared:
        members = [shared.external(numpy_helper.from_array(a, f"m{i}")) for i, a in enumerate(arrays)]
        small = shared.external(numpy_helper.from_array(np.full((1, 1500), 7, np.uint8), "small"))
        after = shared.external(numpy_helper.from_array(np.full((1, 2048), 9, np.uint8), "after"))
        wide = shared.external(numpy_helper.from_array(np.full((1, 4096), 5, np.uint8), "wide"))
        packed = shared.span(members, "packed")
        assert packed is not None and list(packed.dims) == [6, 2048]
        assert shared.span([members[0], members[2]], "gap") is None  # m1 lies between them
        assert shared.span([small, after], "padded") is None  # page padding between them
        assert shared.span([members[2], wide], "dims") is None  # other trailing dims
        outside = onnx.TensorProto()
        outside.CopyFrom(members[1])
        outside.external_data[0].value = "other.bin"
        assert shared.span([members[0], outside], "elsewhere") is None
    stored = np.frombuffer(read_tensor(packed, tmp_path), np.uint8).reshape(6, 2048)
    np.testing.assert_array_equal(stored, np.concatenate(arrays))
