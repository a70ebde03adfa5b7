"""Greedy decoding without the logits: a device target's graphs return each row's greedy token and a finite
check (compiler/greedy_outputs.py), and greedy decoding reads those instead of a vocabulary of floats per row.

Their gain is on a GPU (docs/benchmarks.md, "GPU target"); what a CPU can check is here: the outputs are
numpy's argmax and isfinite, the CPU target's graphs carry none, and an artifact built with them decodes
exactly what one without them decodes, on the device placement (run on the CPU provider) and the host
one, with the runtime never reading a logit (a control shows the check bites: sampling needs them).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import export.weights
import runtime
from common import graph_io, targets
from common.manifest import read_manifest
from compiler.greedy_outputs import add_greedy_outputs
from export.pipeline import build_artifact
from runtime import NonFiniteLogitsError
from runtime.device_placement import DeviceGraph
from runtime.host_placement import HostGraph
from tests.conftest import tiny_recipe
from tests.test_faults import TLM_ONLY, _damaged_checkpoint


def greedy_targets() -> dict[str, targets.Target]:
    """The targets, the CPU one's graphs with greedy outputs, as a device target's are."""
    return targets.TARGETS | {"ort-cpu": dataclasses.replace(targets.TARGETS["ort-cpu"], greedy_outputs=True)}


@pytest.fixture(scope="module")
def greedy_artifact(tmp_path_factory, checkpoints):
    """The runtime tests' artifact (`artifact_dir`: the same recipe and checkpoints), with greedy outputs."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(targets, "TARGETS", greedy_targets())
        return build_artifact(tiny_recipe(), tmp_path_factory.mktemp("greedy") / "art",
                              tlm=str(checkpoints["llama-gqa"]), dlm=str(checkpoints["draft"]), progress=False)


@pytest.mark.parametrize("opset", [11, 17])  # ReduceSum's axes: an attribute before opset 13, an input since
def test_the_outputs_are_numpys_argmax_and_a_finite_check(opset):
    vocab = 7
    graph = helper.make_graph([helper.make_node("Identity", ["x"], [graph_io.LOGITS])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, vocab])],
                              [helper.make_tensor_value_info(graph_io.LOGITS, TensorProto.FLOAT, [1, 6, vocab])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    add_greedy_outputs(model)
    onnx.checker.check_model(model, full_check=True)
    x = np.random.default_rng(0).integers(-2, 3, (1, 6, vocab)).astype(np.float32)  # ties in most rows
    x[0, 1, 3], x[0, 2, 0], x[0, 3, 6] = np.nan, np.inf, -np.inf
    x[0, 4] = 3e38  # finite, and a sum of them would overflow
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    tokens, check = session.run([graph_io.NEXT_TOKEN, graph_io.LOGITS_CHECK], {"x": x})
    finite = np.isfinite(x).all(axis=-1)
    np.testing.assert_array_equal(tokens[finite], np.argmax(x, axis=-1)[finite])  # the first index on ties
    np.testing.assert_array_equal(~np.isnan(check), finite)
    assert (check[finite] == 0).all() and finite.sum() == 3


def test_only_a_device_targets_graphs_carry_them(greedy_artifact, artifact_dir):
    assert targets.get_target("ort-cuda").greedy_outputs and not targets.get_target("ort-cpu").greedy_outputs
    for art, expected in ((greedy_artifact, True), (artifact_dir, False)):
        for entry in read_manifest(art).models.values():
            for g in entry.graphs.values():
                names = {o.name for o in onnx.load(str(art / g.file), load_external_data=False).graph.output}
                assert ({graph_io.NEXT_TOKEN, graph_io.LOGITS_CHECK} <= names) is expected, (art, g.file)


@pytest.fixture
def no_logits(monkeypatch):
    """Any read of a call's logits on the host fails the test."""
    def refuse(self):
        raise AssertionError("the logits were brought to the host")

    for cls in (DeviceGraph, HostGraph):
        monkeypatch.setattr(cls, "logits", refuse)


@pytest.mark.parametrize("options", [  # fixed draft lengths: every method drafts, whatever the machine's timings
    dict(speculative=False),
    dict(speculative="draft", draft_length=3),
    dict(speculative="prompt_lookup", prompt_lookup=dict(adaptive=False)),
    dict(speculative="lookahead", lookahead=dict(adaptive=False)),
])
@pytest.mark.parametrize("device_cache", [True, False])
def test_greedy_decoding_reads_the_graphs_tokens_never_the_logits(greedy_artifact, artifact_dir, options,
                                                                 device_cache, request):
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    want = runtime.generate(runtime.load_artifact(artifact_dir), prompt, max_new_tokens=24, **options)
    art = runtime.load_artifact(greedy_artifact, device_cache=device_cache)
    assert art.tlm.greedy_outputs and art.dlm.greedy_outputs
    request.getfixturevalue("no_logits")
    got = runtime.generate(art, prompt, max_new_tokens=24, **options)
    assert got.token_ids == want.token_ids and len(got.token_ids) == 24
    if options["speculative"]:
        assert got.metrics.speculative["rounds"] > 0  # the scoring calls' tokens were verified
    with pytest.raises(AssertionError, match="brought to the host"):  # the control: sampling reads them
        runtime.generate(art, prompt, max_new_tokens=4, do_sample=True, seed=1)


def test_greedy_decoding_refuses_non_finite_logits_from_the_graphs_check(checkpoints, tmp_path, monkeypatch, request):
    bad = _damaged_checkpoint(checkpoints, tmp_path, float("nan"))
    monkeypatch.setattr(export.weights, "check_finite", lambda array, key, role: None)  # let the NaN through
    monkeypatch.setattr(targets, "TARGETS", greedy_targets())
    art = runtime.load_artifact(build_artifact(TLM_ONLY, tmp_path / "art", tlm=str(bad), progress=False),
                                device_cache=True)
    request.getfixturevalue("no_logits")  # the build's timing takes logits, as a sampling call would
    with pytest.raises(NonFiniteLogitsError, match="NaN/Inf logits"):
        runtime.generate(art, [5, 6, 7], max_new_tokens=4)
