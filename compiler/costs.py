"""Measures what one call of each compiled graph costs on the build machine.

The runtime decides per speculative round how many tokens to draft from these costs (and refines
them with what it measures itself), so the compiler records them in the manifest. The calls are the
runtime's own (runtime/model_runner.py and its placement: I/O bound once, the cache where the target
keeps it, the weights shared, CUDA graphs replayed on a GPU), so the build times what will run.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from common.manifest import ArtifactError, ModelEntry
from common.targets import Target, TargetUnavailableError, check_target
from runtime.model_runner import ModelRunner

# Cache slots each row sees while timing. Attention's cost follows the keys a row sees (hidden ones are
# skipped), the weights' cost follows the call: timed with half of a 2,048-slot serving cache visible,
# two 4-row calls looked cheaper than one 9-row call (a padded row's 1,024 keys), and the scheduler
# split 8 requests' rows in two, reading the weights twice. A short chat turn sees ~100.
VISIBLE = 128


def visible_slots(slots: int, tokens: int = 1) -> np.ndarray:
    """bool [slots]: the cache slots every row of a timed call of `tokens` rows sees (its positions stay
    inside the context)."""
    return np.arange(slots) < min(VISIBLE, slots // 2, slots - tokens)


def graph_costs_ms(artifact_dir: Path, entry: ModelEntry, slots: int, target: Target,
                   repeats: int = 5) -> dict[str, float]:
    """Median ms per call of each of the entry's graphs (files relative to `artifact_dir`, a cache of
    `slots`), runs interleaved across graphs, each call as the runtime makes it (ModelRunner.run_rows:
    ids, positions and mask copied in, logits to the host; on a GPU replayed as CUDA graphs: timed
    without them, a scoring call read 2.4x a decode call's cost where it costs 1.1-1.4x, and speculation
    never drafted: docs/benchmarks.md, "GPU target"). Empty when the target's provider is not on the
    build machine or cannot start there (the runtime then measures for itself)."""
    try:
        check_target(target)  # also loads pip's CUDA libraries for the GPU target
        runner = ModelRunner(artifact_dir, entry, slots, target=target)
    except ArtifactError:  # the index or the weights file is wrong: the build must say so
        raise
    except (TargetUnavailableError, RuntimeError):  # onnxruntime-gpu lists its provider without a GPU too;
        return {}  # no device to put the shared weights on ("no such device", from ortvalue_from_numpy)
    times: dict[str, list[float]] = {n: [] for n in entry.graphs}
    for i in range(repeats + 1):  # the first round warms (a session's first run allocates; CUDA graphs capture)
        for name, g in entry.graphs.items():
            t0 = time.perf_counter()
            runner.run_rows(name, np.zeros(g.tokens, np.int64), visible_slots(slots, g.tokens),
                            np.tri(g.tokens, dtype=bool), check=False)
            if i:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {n: round(float(np.median(t)), 3) for n, t in times.items()}
