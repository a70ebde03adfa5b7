"""Cost of one call of each graph: the artifact's mapped prepacked weights (one copy for all
graphs) against a per-session heap-prepacked copy (what ONNX Runtime does by itself).

    python -m benchmarks.steps ARTIFACT [--context-used 100] [--repeats 8]

Both runners are measured in one process, alternately per graph, so drift affects both alike.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.chain import Chain
from benchmarks.variants import heap_prepacked_copy
from common.manifest import read_manifest
from runtime.model_runner import ModelRunner


def step_ms(runner: Chain, graph: str, n: int, used: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        runner.rewind(used)
        t0 = time.perf_counter()
        runner.forward(graph, np.arange(4, 4 + n))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--context-used", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    manifest = read_manifest(args.artifact, verify=False)
    entry = manifest.models["tlm"]
    tmp = tempfile.TemporaryDirectory()
    dirs = {"mapped": Path(args.artifact), "heap": heap_prepacked_copy(Path(args.artifact), Path(tmp.name) / "a")}
    runners = {mode: Chain(ModelRunner(d, entry, manifest.capacity)) for mode, d in dirs.items()}
    for r in runners.values():
        r.prefill(np.arange(4, 4 + args.context_used))
    rows = {}
    for graph, g in entry.graphs.items():
        for n in sorted({1, g.tokens}):
            ms = {mode: step_ms(r, graph, n, args.context_used, args.repeats) for mode, r in runners.items()}
            rows[f"{graph}, {n} token(s)"] = {k: round(v, 2) for k, v in ms.items()} | {
                "mapped_speed_over_heap": round(ms["heap"] / ms["mapped"], 3)}
    print(json.dumps({"artifact": args.artifact, "median_ms_per_call": rows}, indent=2))


if __name__ == "__main__":
    main()
