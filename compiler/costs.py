"""Measures what one call of each compiled graph costs on the build machine.

The runtime decides per speculative round how many tokens to draft from these costs (and refines
them with what it measures itself), so the compiler records them in the manifest.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common import graph_io
from common.graph_io import ModelDims
from common.manifest import ArtifactError
from common.shared_weights import SharedWeights
from common.targets import (
    Target,
    TargetUnavailableError,
    check_session,
    check_target,
    compiled_session_options,
    parked_pools,
)

# Cache slots each row sees while timing. Attention's cost follows the keys a row sees (hidden ones are
# skipped), the weights' cost follows the call: timed with half of a 2,048-slot serving cache visible,
# two 4-row calls looked cheaper than one 9-row call (a padded row's 1,024 keys), and the scheduler
# split 8 requests' rows in two, reading the weights twice. A short chat turn sees ~100.
VISIBLE = 128


def call_inputs(dims: ModelDims, tokens: int, context: int, device: str) -> dict[str, ort.OrtValue]:
    """A call's inputs where the runtime keeps them: the KV cache on the target's device, not copied
    in per call (on a GPU that copy would cost more than the call)."""
    shapes = graph_io.input_shapes(dims, 1, tokens, context)
    visible = min(VISIBLE, context // 2)
    mask = np.zeros(shapes[graph_io.ATTENTION_MASK], dtype=bool)
    mask[:, :, :visible] = True
    mask[:, :, context:] = np.tri(tokens, dtype=bool)
    feeds = {graph_io.INPUT_IDS: np.zeros(shapes[graph_io.INPUT_IDS], np.int64),
             graph_io.POSITION_IDS: np.arange(tokens, dtype=np.int64)[None] + visible,
             graph_io.ATTENTION_MASK: mask}
    kv = ort.OrtValue.ortvalue_from_numpy(np.zeros(shapes[graph_io.past_key(0)], dims.kv_dtype), device, 0)
    return {k: ort.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in feeds.items()} | {
        name: kv for name in graph_io.input_names(dims)[3:]}


def bound_call(session: ort.InferenceSession, graph: str, dims: ModelDims, tokens: int, context: int,
               device: str) -> tuple[ort.IOBinding, ort.OrtValue]:
    """A call of `graph` bound as the runtime binds it: inputs from `call_inputs`, every output (the greedy
    outputs too, where the graph has them) written into a buffer allocated once on the device (a CUDA graph
    replays fixed addresses). Returns the binding and the logits buffer."""
    binding, logits = session.io_binding(), None
    for name, value in call_inputs(dims, tokens, context, device).items():
        binding.bind_ortvalue_input(name, value)
    rows = graph_io.logit_rows(graph, tokens)
    shapes = graph_io.output_shapes(dims, 1, tokens, rows)
    greedy = {name: dtype for name, dtype in graph_io.GREEDY_OUTPUTS.items()
              if name in {o.name for o in session.get_outputs()}}
    shapes |= {name: (1, rows) for name in greedy}
    for name, shape in shapes.items():
        dtype = greedy.get(name) or (np.float32 if name == graph_io.LOGITS else np.dtype(dims.kv_dtype).type)
        buffer = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0)
        binding.bind_ortvalue_output(name, buffer)
        logits = buffer if name == graph_io.LOGITS else logits
    return binding, logits


def graph_costs_ms(graphs: dict[str, tuple[Path, int]], dims: ModelDims, context: int, target: Target,
                   repeats: int = 5, shared: SharedWeights | None = None) -> dict[str, float]:
    """Median ms per call of each graph ({name: (path, T)}), runs interleaved across graphs, timed as the
    runtime runs them (but for its per-call copy of ids, positions and mask, a few microseconds):
    outputs bound, logits brought to the host, and on a GPU replayed as CUDA graphs
    (timed without them, a scoring call read 2.4x a decode call's cost where it costs 1.1-1.4x, and
    speculation never drafted: docs/benchmarks.md, "GPU target"). Empty when the target's provider is
    not on the build machine or cannot start there (the runtime then measures for itself). `shared`: the
    model's weights, one device copy for all the graphs' sessions, as the runtime holds them."""
    try:
        check_target(target)  # also loads pip's CUDA libraries for the GPU target
    except TargetUnavailableError:
        return {}

    def options(graph: str) -> ort.SessionOptions:
        so = compiled_session_options(target)
        return shared.add_to(graph, so) if shared is not None else so

    device = target.device
    cuda_graph = device == "cuda"
    try:
        with parked_pools():  # as the runtime runs them: mapped blobs, spinning within calls, weights shared
            sessions = {n: ort.InferenceSession(str(p), options(n), providers=target.providers(cuda_graph))
                        for n, (p, _) in graphs.items()}
    except ArtifactError:  # the index or the weights file is wrong: the build must say so
        raise
    except RuntimeError:  # no device to put the shared weights on ("no such device", from ortvalue_from_numpy)
        return {}
    try:  # onnxruntime-gpu lists its provider on a machine without a GPU too
        for session in sessions.values():
            check_session(session, target)
    except TargetUnavailableError:
        return {}
    calls = {n: (s, *bound_call(s, n, dims, graphs[n][1], context, device)) for n, s in sessions.items()}
    warm = 3 if cuda_graph else 1  # ONNX Runtime's CUDA provider captures a graph on a session's third run
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for i in range(repeats + warm):
        for name, (session, binding, logits) in calls.items():
            t0 = time.perf_counter()
            session.run_with_iobinding(binding)
            logits.numpy()  # to the host, as the runtime takes them
            if i >= warm:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {n: round(float(np.median(t)), 3) for n, t in times.items()}
