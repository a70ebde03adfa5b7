"""The GPU target (ort-cuda) where no GPU is: what builds and runs without one, and the refusals.

The GPU measurements themselves are in docs/benchmarks.md ("GPU target"); here: the device-resident
KV cache path (run on the CPU provider, it must give exactly what the host cache gives), the float16
build (types, kernels, RMSNorm statistics kept in float32) and the clear errors on a machine whose
ONNX Runtime has no CUDA provider or whose session fell back to the CPU.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.transformers.float16 import convert_float_to_float16

import runtime
from benchmarks.chain import Chain
from common import graph_io, targets
from common.manifest import read_manifest
from common.recipe import ModelSpec
from common.targets import TARGETS, TargetUnavailableError, check_session, compiled_session_options
from compiler import build
from compiler.float16 import norm_statistics, to_float16
from export.pipeline import build_artifact
from runtime.device_placement import DevicePlacement
from runtime.host_placement import HostPlacement
from runtime.model_runner import ModelRunner
from tests.conftest import tiny_recipe

CPU, CUDA = TARGETS["ort-cpu"], TARGETS["ort-cuda"]

NO_CUDA = "CUDAExecutionProvider" not in ort.get_available_providers()


@pytest.fixture(scope="module")
def both(artifact_dir):
    """The shared tiny artifact loaded twice: host numpy cache, and the device-cache path on the CPU."""
    host, device = runtime.load_artifact(artifact_dir), runtime.load_artifact(artifact_dir, device_cache=True)
    assert isinstance(host.tlm.place, HostPlacement) and isinstance(device.tlm.place, DevicePlacement)
    return host, device


@pytest.mark.parametrize("options", [
    dict(speculative=False),
    dict(speculative="draft", draft_length=3),
    dict(speculative="prompt_lookup"),
    dict(speculative="lookahead"),
    dict(speculative=False, do_sample=True, temperature=0.9, seed=5),
    dict(speculative="draft", do_sample=True, temperature=0.9, seed=5, draft_length=3),
])
def test_the_device_cache_gives_exactly_what_the_host_cache_gives(both, options):
    host, device = both
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    a = runtime.generate(host, prompt, max_new_tokens=24, **options)
    b = runtime.generate(device, prompt, max_new_tokens=24, **options)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_logits_from_the_device_cache_stay_the_callers_after_the_next_call(artifact_dir):
    """On the CPU provider a bound output's numpy() is the bound buffer itself: the logits a call returned
    must not change when the next call writes that buffer (nor go when the runner goes)."""
    manifest = read_manifest(artifact_dir)
    runner = Chain(ModelRunner(artifact_dir, manifest.models["tlm"], manifest.capacity, target=CPU,
                               device_cache=True))
    runner.start(np.arange(5, 17))
    first = runner.forward(graph_io.DECODE, np.array([11]))
    kept = first.copy()
    second = runner.forward(graph_io.DECODE, np.array([12]))
    assert not np.array_equal(second, kept)  # the second call wrote other logits
    np.testing.assert_array_equal(first, kept)


def test_the_device_cache_serves_branches_beams_and_a_reused_prefix(both):
    host, device = both
    a = runtime.generate(host, "import os\n", n=3, max_new_tokens=12, do_sample=True, seed=2)
    b = runtime.generate(device, "import os\n", n=3, max_new_tokens=12, do_sample=True, seed=2)
    assert [c.token_ids for c in a.branches] == [c.token_ids for c in b.branches]
    beams = [runtime.beam_search(art, "def f(x):", num_beams=3, max_new_tokens=10) for art in both]
    assert [b.token_ids for b in beams[0].sequences] == [b.token_ids for b in beams[1].sequences]
    first = runtime.generate(device, "import sys\nimport os\n", max_new_tokens=8)
    again = runtime.generate(device, "import sys\nimport os\n", max_new_tokens=8)  # prefix found in the cache
    assert again.metrics.cached_prompt_tokens > 0 and again.token_ids == first.token_ids


def test_cuda_graphs_are_captured_once_per_thread_and_change_no_generation(both, artifact_dir):
    """capture_graphs runs every graph on padding rows (on a GPU until ONNX Runtime holds its CUDA graph;
    forced here, the CPU provider runs the same calls): a thread's first call captures, for that thread
    only; the runs happened, each padding row seeing only itself; and a session with a cached prefix
    generates after them, on another thread, what it generated before."""
    import threading

    host, _ = both
    art = runtime.load_artifact(artifact_dir, device_cache=True)
    assert art.manifest.models["tlm"].batch_invariant  # so every padding row's logits are the same bits
    prompt, options = "import sys\nimport os\n", dict(speculative="draft", draft_length=3, max_new_tokens=8)
    first = runtime.generate(art, prompt, **options)
    assert art.tlm.place.captured == set()  # no CUDA graphs, no captures
    for runner in art.runners.values():
        runner.place.cuda_graph = True
    calls = art.tlm.calls
    art.tlm.capture_graphs()
    assert art.tlm.place.captured == {threading.get_ident()} and art.tlm.calls == calls
    alone = Chain(host.tlm).run(graph_io.DECODE, np.array([0]))  # token 0 at position 0, seeing only itself
    for g in art.tlm.graphs.values():
        assert np.array_equal(g.logits()[0], np.repeat(alone, g.logit_rows, axis=0))
    again: list = []
    worker = threading.Thread(target=lambda: again.append((runtime.generate(art, prompt, **options),
                                                          threading.get_ident())))
    worker.start()
    worker.join()
    result, ident = again[0]
    assert art.tlm.place.captured == {threading.get_ident(), ident} and ident in art.dlm.place.captured
    assert result.metrics.cached_prompt_tokens > 0 and result.token_ids == first.token_ids


def test_the_call_pattern_benchmark_times_each_call(both):
    """benchmarks.gpu's call_pattern (run here on the CPU): a positive median for each call kind."""
    from benchmarks.gpu import call_pattern

    host, _ = both
    prompt = list(range(5, 25))
    ms = call_pattern(host, prompt, repeats=3)
    score = host.tlm.graph_for(5)
    assert set(ms) == {"decode_after_decode", "commit_1", f"{score}_after_decode", "commit_3",
                       f"decode_after_{score}"}
    assert all(v > 0 for v in ms.values())


MX_TLM = ModelSpec(model="", mx_format="fp6_e2m3", mx_lowering="fused")  # every MX path (head, table: MXINT8)


@pytest.fixture(scope="module")
def cuda_artifact(tmp_path_factory, checkpoints):
    recipe = replace(tiny_recipe(target="ort-cuda"), tlm=MX_TLM)
    warned = pytest.warns(UserWarning, match="batch-invariant graphs need mxspd's kernels")
    with warned, pytest.MonkeyPatch.context() as m:
        m.setattr(build, "SHARED_MIN_BYTES", 4096)  # the tiny models' matrices, as a real model's weights are shared
        return build_artifact(recipe, tmp_path_factory.mktemp("cuda") / "art", tlm=str(checkpoints["llama-gqa"]),
                              dlm=str(checkpoints["draft"]), progress=False)


def test_a_cuda_artifact_builds_without_a_gpu_in_float16_with_mxfp6_in_matmulnbits(cuda_artifact):
    manifest = read_manifest(cuda_artifact)
    assert manifest.target == "ort-cuda"
    for role, entry in manifest.models.items():
        assert entry.dims.kv_dtype == "float16" and not entry.batch_invariant
        if NO_CUDA:  # no GPU to time the graphs on: the runtime measures for itself
            assert all(g.cost_ms == 0.0 for g in entry.graphs.values())
        graph = onnx.load(str(cuda_artifact / entry.graphs[graph_io.DECODE].file), load_external_data=False).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
        assert types[graph_io.past_key(0)] == types[graph_io.new_value(0)] == TensorProto.FLOAT16
        assert types[graph_io.LOGITS] == TensorProto.FLOAT  # sampling reads float32 logits
        assert types[graph_io.NEXT_TOKEN] == TensorProto.INT64  # greedy decoding reads these (greedy_outputs.py)
        assert types[graph_io.LOGITS_CHECK] == TensorProto.FLOAT
        bits = [a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"]
        assert (set(bits) == {8} and len(bits) >= 7) if role == "tlm" else not bits  # the MXFP6 TLM's matrices
        tables = {t.name for t in graph.initializer if t.data_type == TensorProto.INT8}
        assert tables == ({"embed_tokens.weight.rows_int8"} if role == "tlm" else set())  # its MXINT8 embedding
        assert len(norm_statistics(graph)) == 2 * entry.dims.n_layers + 1


def test_the_float16_graphs_compute_what_the_float32_graphs_compute(cuda_artifact, checkpoints, tmp_path):
    """Run on the CPU provider (which has float16 kernels or casts around them): the GPU target's
    prefill against the CPU target's, same checkpoint and MX lowering, a visible cache of random KV."""
    recipe = replace(tiny_recipe(), tlm=MX_TLM, dlm=None, batch_invariant=False)
    cpu_artifact = build_artifact(recipe, tmp_path / "cpu", tlm=str(checkpoints["llama-gqa"]), progress=False)
    rng = np.random.default_rng(0)
    entry = read_manifest(cpu_artifact).models["tlm"]
    context, tokens = read_manifest(cpu_artifact).capacity, entry.graphs[graph_io.PREFILL].tokens
    shapes = graph_io.input_shapes(entry.dims, 1, tokens, context)
    kv = {n: rng.standard_normal(shapes[n]).astype(np.float32) for n in graph_io.input_names(entry.dims)[3:]}
    mask = np.zeros(shapes[graph_io.ATTENTION_MASK], bool)
    mask[0, :, :20], mask[0, :, context:] = True, np.tri(tokens, dtype=bool)
    feeds = {graph_io.INPUT_IDS: rng.integers(4, 200, (1, tokens)), graph_io.ATTENTION_MASK: mask,
             graph_io.POSITION_IDS: np.arange(20, 20 + tokens)[None]}
    logits = {}
    for art, dtype in ((cpu_artifact, np.float32), (cuda_artifact, np.float16)):
        graph = art / read_manifest(art).models["tlm"].graphs[graph_io.PREFILL].file
        session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
        names = [graph_io.LOGITS, *([graph_io.NEXT_TOKEN] if dtype == np.float16 else [])]
        out = session.run(names, feeds | {n: v.astype(dtype) for n, v in kv.items()})
        logits[dtype] = out[0]
    np.testing.assert_array_equal(out[1], out[0].argmax(-1))  # the device's greedy tokens: its own logits' argmax
    a, b = logits[np.float32], logits[np.float16]
    assert np.linalg.norm(b - a) / np.linalg.norm(a) < 1e-2
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.9


def test_a_float16_device_cache_commits_what_a_float16_host_cache_commits(cuda_artifact, monkeypatch):
    """Two-byte slots: the layer offsets and the store graph in float16 (run on the CPU provider, at the
    GPU target's optimisation level: at the CPU target's ORT_DISABLE_ALL, ONNX Runtime's CPU float16 path
    computes these graphs wrongly, docs/benchmarks.md "GPU target")."""
    from runtime import placement

    monkeypatch.setattr(placement, "compiled_session_options",
                        lambda target, threads=None: compiled_session_options(CUDA, threads))
    manifest = read_manifest(cuda_artifact)
    entry = manifest.models["tlm"]
    logits = []
    for device_cache in (False, True):
        runner = ModelRunner(cuda_artifact, entry, manifest.capacity, target=CPU, device_cache=device_cache)
        chain = Chain(runner)
        chain.start(np.arange(5, 17))
        chain.run(graph_io.score_graph(3), np.array([7, 8, 9, 10]))
        chain.commit([0, 2])  # not a chain: the rows' KV go to slots 12 and 13
        logits.append(chain.forward(graph_io.DECODE, np.array([11])))
    np.testing.assert_array_equal(*logits)
    # the device runner's sessions used one shared copy of each weight (the same values as their own)
    listed = [row for rows in runner.place.shared.index.values() for row in rows]
    assert len(runner.place.shared.index) == len(entry.graphs) and len(listed) >= 7 * len(entry.graphs)
    assert 0 < len(runner.place.shared.values) < len(listed)  # each distinct tensor once, for every graph


def test_device_sessions_compute_with_the_weights_they_are_handed(cuda_artifact, monkeypatch, tmp_path):
    """The control for the shared weights: handed a zeroed copy of the weights file, the sessions compute
    something else, so they use the tensors they are handed, not a copy of their own."""
    from common.shared_weights import SharedWeights
    from runtime import placement

    monkeypatch.setattr(placement, "compiled_session_options",
                        lambda target, threads=None: compiled_session_options(CUDA, threads))
    manifest = read_manifest(cuda_artifact)
    entry = manifest.models["tlm"]
    zeroed = tmp_path / "zeroed.bin"
    zeroed.write_bytes(bytes((cuda_artifact / entry.weights).stat().st_size))

    def decode() -> np.ndarray:
        chain = Chain(ModelRunner(cuda_artifact, entry, manifest.capacity, target=CPU, device_cache=True))
        chain.start(np.arange(5, 17))
        return chain.forward(graph_io.DECODE, np.array([11]))

    handed = decode()
    monkeypatch.setattr(SharedWeights, "available",
                        classmethod(lambda cls, model_dir, weights, device: cls(model_dir, zeroed, device)))
    assert np.isfinite(handed).all() and not np.allclose(decode(), handed)


def test_the_initializer_index_points_at_each_graphs_weights(cuda_artifact):
    """What the runtime puts on the device in place of a session's own copy must be that tensor."""
    manifest = read_manifest(cuda_artifact)
    for role, entry in manifest.models.items():
        weights = cuda_artifact / entry.weights
        index = json.loads((weights.parent / graph_io.INITIALIZERS_FILE).read_text())
        graph = onnx.load(str(cuda_artifact / entry.graphs[graph_io.DECODE].file))  # with its external data
        values = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer}
        assert index[graph_io.DECODE], role
        for name, dtype, dims, offset, length in index[graph_io.DECODE]:
            stored = np.fromfile(weights, np.uint8, count=length, offset=offset).view(dtype).reshape(dims)
            np.testing.assert_array_equal(stored, values[name])


def test_cuda_graphs_without_the_device_cache_or_on_the_cpu_are_refused(cuda_artifact):
    manifest = read_manifest(cuda_artifact)
    with pytest.raises(ValueError, match="cuda_graph needs the device cache"):
        ModelRunner(cuda_artifact, manifest.models["tlm"], manifest.capacity, target=CPU, device_cache=False,
                    cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph applies to the GPU target"):
        ModelRunner(cuda_artifact, manifest.models["tlm"], manifest.capacity, target=CPU, device_cache=True,
                    cuda_graph=True)


def _rmsnorm_graph() -> onnx.ModelProto:
    """A residual value through RMSNorm into a projection named `logits` (as the graphs end)."""
    rng = np.random.default_rng(0)
    consts = {"one": np.array(1.0, np.float32), "two": np.array(2.0, np.float32), "axes": np.array([-1], np.int64),
              "eps": np.array(1e-5, np.float32), "w": np.linspace(0.5, 1.5, 64).astype(np.float32),
              "proj": rng.standard_normal((64, 16)).astype(np.float32)}
    nodes = [helper.make_node("Mul", ["x", "one"], ["h"]), helper.make_node("Pow", ["h", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"]), helper.make_node("Add", ["ms", "eps"], ["mse"]),
             helper.make_node("Sqrt", ["mse"], ["rms"]), helper.make_node("Div", ["h", "rms"], ["n"]),
             helper.make_node("Mul", ["n", "w"], ["y"]), helper.make_node("MatMul", ["y", "proj"], [graph_io.LOGITS])]
    graph = helper.make_graph(nodes, "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info(graph_io.LOGITS, TensorProto.FLOAT, [2, 16])],
                              [numpy_helper.from_array(v, k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _statistic_types(model: onnx.ModelProto) -> set[int]:
    inferred = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *inferred.output]}
    return {types[o] for chain in norm_statistics(model.graph) for n in chain for o in n.output}


def test_float16_graphs_keep_the_rmsnorm_statistic_in_float32(tmp_path):
    path = tmp_path / "g.onnx"
    onnx.save(_rmsnorm_graph(), path)
    to_float16(path)
    ours = onnx.load(str(path))
    assert {i.type.tensor_type.elem_type for i in ours.graph.input} == {TensorProto.FLOAT16}
    # mean(x^2) of a residual outlier of 256 or more is past float16's 65504: it must stay float32
    assert _statistic_types(ours) == {TensorProto.FLOAT}
    assert _statistic_types(convert_float_to_float16(_rmsnorm_graph(), keep_io_types=[graph_io.LOGITS])) == {
        TensorProto.FLOAT16}  # the control: ONNX Runtime's plain conversion puts it in float16
    x = (np.random.default_rng(1).standard_normal((2, 64)) * 600).astype(np.float32)  # outliers past 1,000
    ref = ort.InferenceSession(_rmsnorm_graph().SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.astype(np.float16)})[0]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-3


@pytest.mark.skipif(not NO_CUDA, reason="this ONNX Runtime has the CUDA provider")
def test_loading_a_cuda_artifact_without_the_cuda_provider_is_refused_by_name(cuda_artifact):
    with pytest.raises(TargetUnavailableError, match="needs ONNX Runtime's CUDAExecutionProvider.*onnxruntime-gpu"):
        runtime.load_artifact(cuda_artifact)


def test_both_onnxruntime_wheels_installed_is_named_as_the_cause(monkeypatch):
    monkeypatch.setattr(targets, "_installed", lambda name: True)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(TargetUnavailableError,
                       match="share one `onnxruntime` module: `pip uninstall -y onnxruntime && pip install --force"):
        targets.check_target(CUDA)


def test_a_gpu_session_that_fell_back_to_the_cpu_is_refused():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]), opset_imports=[helper.make_opsetid("", 18)],
        ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    check_session(session, CPU)
    with pytest.raises(TargetUnavailableError, match="could not start CUDAExecutionProvider"):
        check_session(session, CUDA)


def test_float16_values_equal_onnxruntimes_conversion_bit_for_bit():
    from onnxruntime.transformers.float16 import convert_np_to_float16

    from compiler.float16 import float16_values

    edges = np.array([0.0, -0.0, 1e-9, -1e-9, 5.96e-08, -5.96e-08, 6e-8, 1e-7, 65504.0, 65519.0, -65520.0, 1e6,
                      -1e30, np.inf, -np.inf, np.nan, 3.14159, -2.5e-5, 1.0], np.float32)
    rng = np.random.default_rng(0)
    wide = (rng.standard_normal(100_000) * 10.0 ** rng.uniform(-12, 8, 100_000)).astype(np.float32)
    for x in (edges, wide, np.ones(7, np.float32)):
        got, want = float16_values(x), convert_np_to_float16(x)
        assert got.dtype == want.dtype == np.float16
        assert got.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    with np.errstate(over="ignore"):  # the control: a plain cast differs (it overflows to infinity)
        assert float16_values(wide).tobytes() != wide.astype(np.float16).tobytes()


def test_each_target_is_one_record_and_the_runtimes_device_code_one_file():
    """What a target means is one `Target` record (an unknown name is refused with the list), and the
    runtime's device code (device tensors, their updates, CUDA graphs) lives in runtime/device_placement.py
    only: a reader finds it in one file."""
    import re
    from pathlib import Path

    assert {name: (t.device, t.float16, t.prepacked) for name, t in targets.TARGETS.items()} == {
        "ort-cpu": ("cpu", False, True), "ort-cuda": ("cuda", True, False)}
    assert targets.get_target("ort-cuda").providers(cuda_graph=True)[0] == (
        "CUDAExecutionProvider", {"enable_cuda_graph": "1"})
    with pytest.raises(ValueError, match=r"unknown target 'ort-tpu'; choose one of \['ort-cpu', 'ort-cuda'\]"):
        targets.get_target("ort-tpu")
    device_code = re.compile(r"OrtValue|ortvalue|update_inplace|enable_cuda_graph|captured")
    found = {p.name for folder in ("runtime", "serve") for p in (Path(__file__).parents[1] / folder).glob("*.py")
             if device_code.search(p.read_text())}
    assert found == {"device_placement.py"}
