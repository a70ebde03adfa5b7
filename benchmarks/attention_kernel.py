"""ai.mxspd::Attention alone: nanoseconds per (query row, head, visible key), side by side for two builds.

    python -m benchmarks.attention_kernel [--baseline OTHER.so] [--repeats 5] [--threads 2]

One Attention node at SmolLM2-135M's shape (9 query heads, 3 KV heads, head size 64) over a 2,048-slot
cache: a decode row (T = 1) and a 9-row call of a server's step (T = 9), each row seeing `keys` random
slots plus itself. Each library (the installed one, and `--baseline`, for example an older build of
kernels/*.cc) gets its own session; calls alternate between them. Prints the median ns per (row, head,
key) and the ratio baseline / installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import kernels
from common.targets import session_options, spin_within_calls

HQ, HKV, D, SLOTS = 9, 3, 64, 2048
NAMES = ["query", "past_key", "past_value", "new_key", "new_value", "mask"]


def _session(library: str, threads: int) -> ort.InferenceSession:
    node = helper.make_node(kernels.ATTENTION, NAMES, ["y"], domain=kernels.DOMAIN, scale=D**-0.5)
    graph = helper.make_graph([node], "attention", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                    for n in NAMES],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    so = spin_within_calls(session_options(threads, library=Path(library)))  # as the runtime's sessions
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _inputs(rows: int, keys: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    f = np.float32
    mask = np.full((1, 1, rows, SLOTS + rows), np.finfo(f).min, f)
    for r in range(rows):
        mask[0, 0, r, rng.choice(SLOTS, keys, replace=False)] = 0.0
        mask[0, 0, r, SLOTS + r] = 0.0
    return {"query": rng.standard_normal((1, HQ, rows, D)).astype(f),
            "past_key": rng.standard_normal((1, HKV, SLOTS, D)).astype(f),
            "past_value": rng.standard_normal((1, HKV, SLOTS, D)).astype(f),
            "new_key": rng.standard_normal((1, HKV, rows, D)).astype(f),
            "new_value": rng.standard_normal((1, HKV, rows, D)).astype(f), "mask": mask}


def _seconds(session: ort.InferenceSession, feed: dict, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        session.run(None, feed)
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="another build of the kernel library to compare with")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keys", type=int, nargs="+", default=[160, 600], help="visible cache slots per row")
    args = ap.parse_args()
    libraries = {"installed": str(kernels.require_library())} | ({"baseline": args.baseline} if args.baseline else {})
    sessions = {name: _session(path, args.threads) for name, path in libraries.items()}
    rng = np.random.default_rng(0)
    report = {"machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
              "threads": args.threads, "cases": {}}
    for rows in (1, 9):
        for keys in args.keys:
            feed = _inputs(rows, keys, rng)
            outs = {name: s.run(None, feed)[0] for name, s in sessions.items()}  # warm-up, and the values
            calls = max(3, int(2e6 / (rows * HQ * keys)))
            times: dict[str, list[float]] = {name: [] for name in sessions}
            for _ in range(args.repeats):
                for name, s in sessions.items():
                    times[name].append(_seconds(s, feed, calls) * 1e9 / (rows * HQ * (keys + 1)))
            case = {name: round(float(np.median(t)), 1) for name, t in times.items()}
            if "baseline" in outs:
                case["speedup"] = round(case["baseline"] / case["installed"], 2)
                case["max_abs_difference"] = float(np.abs(outs["baseline"] - outs["installed"]).max())
            report["cases"][f"T={rows} keys={keys}"] = case
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
