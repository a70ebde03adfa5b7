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
from common.targets import PROVIDERS, compiled_session_options, parked_pools


def _feeds(dims: ModelDims, tokens: int, context: int) -> dict[str, np.ndarray]:
    shapes = graph_io.input_shapes(dims, 1, tokens, context)
    mask = np.zeros(shapes[graph_io.ATTENTION_MASK], dtype=bool)
    mask[:, :, : context // 2] = True  # half the cache in use; the graph's cost does not depend on it
    mask[:, :, context:] = np.tri(tokens, dtype=bool)
    feeds = {graph_io.INPUT_IDS: np.zeros(shapes[graph_io.INPUT_IDS], np.int64),
             graph_io.POSITION_IDS: np.arange(tokens, dtype=np.int64)[None] + context // 2,
             graph_io.ATTENTION_MASK: mask}
    kv = np.zeros(shapes[graph_io.past_key(0)], np.float32)
    return feeds | {name: kv for name in graph_io.input_names(dims)[3:]}


def graph_costs_ms(graphs: dict[str, tuple[Path, int]], dims: ModelDims, context: int, target: str,
                   repeats: int = 5) -> dict[str, float]:
    """Median ms per call of each graph ({name: (path, T)}), runs interleaved across graphs; empty when
    the target's provider is not on the build machine (the runtime then measures for itself)."""
    if PROVIDERS[target][0] not in ort.get_available_providers():
        return {}
    so = compiled_session_options(target)  # as the runtime runs them: mapped blobs, spinning within calls
    with parked_pools():
        sessions = {n: (ort.InferenceSession(str(p), so, providers=PROVIDERS[target]), _feeds(dims, t, context))
                    for n, (p, t) in graphs.items()}
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for i in range(repeats + 1):
        for name, (session, feeds) in sessions.items():
            t0 = time.perf_counter()
            session.run([graph_io.LOGITS], feeds)
            if i:  # the first call warms up
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {n: round(float(np.median(t)), 3) for n, t in times.items()}
