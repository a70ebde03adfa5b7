"""ai.mxspd::Attention alone: nanoseconds per (query row, head, visible key), side by side for two builds.

    python -m benchmarks.attention_kernel [--baseline OTHER.so] [--repeats 5] [--threads 2]
                                          [--shape smollm2|llama2-7b|llama3-1b] [--chunk 128 --past 384] [--half]

One Attention node at SmolLM2-135M's shape (9 query heads, 3 KV heads, head size 64; or Llama-2-7B's, 32
heads of 128; or Llama-3.2-1B's, 32 query heads of 64 over 8 KV heads) over a 2,048-slot cache: a decode row
(T = 1) and a 9-row call of a server's step (T = 9), each row seeing `keys` random slots plus itself; and
with `--chunk` a prefill chunk (T = chunk rows, each seeing the first `past` slots and the chunk's rows up to
itself). Each library (the installed one, and `--baseline`, for example an older build of kernels/*.cc) gets
its own session; calls alternate between them. Prints the median ns per (row, head, visible key) and the
ratio baseline / installed. `--half`: the op over a float16 cache (AttentionHalfKV, the default recipe's).
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

# query heads, KV heads, head size
SHAPES = {"smollm2": (9, 3, 64), "llama2-7b": (32, 32, 128), "llama3-1b": (32, 8, 64)}
SLOTS = 2048
NAMES = ["query", "past_key", "past_value", "new_key", "new_value", "mask"]


def _session(library: str, threads: int, d: int, half: bool = False) -> ort.InferenceSession:
    outputs = ["y", "k16", "v16"] if half else ["y"]
    node = helper.make_node(kernels.ATTENTION_HALF_KV if half else kernels.ATTENTION, NAMES, outputs,
                            domain=kernels.DOMAIN, scale=d**-0.5)
    cache = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    graph = helper.make_graph([node], "attention", [helper.make_tensor_value_info(n, cache if n.startswith("past")
                                                                                  else TensorProto.FLOAT, None)
                                                    for n in NAMES],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
                              + [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in outputs[1:]])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    so = spin_within_calls(session_options(threads, library=Path(library)))  # as the runtime's sessions
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _inputs(shape: tuple[int, int, int], rows: int, keys: int, rng: np.random.Generator,
            prefill: bool = False) -> dict[str, np.ndarray]:
    """Each row sees `keys` random slots and itself; `prefill`: the first `keys` slots and the rows up to it."""
    (hq, hkv, d), f = shape, np.float32
    mask = np.full((1, 1, rows, SLOTS + rows), np.finfo(f).min, f)
    for r in range(rows):
        mask[0, 0, r, np.arange(keys) if prefill else rng.choice(SLOTS, keys, replace=False)] = 0.0
        mask[0, 0, r, SLOTS + (0 if prefill else r): SLOTS + r + 1] = 0.0
    return {"query": rng.standard_normal((1, hq, rows, d)).astype(f),
            "past_key": rng.standard_normal((1, hkv, SLOTS, d)).astype(f),
            "past_value": rng.standard_normal((1, hkv, SLOTS, d)).astype(f),
            "new_key": rng.standard_normal((1, hkv, rows, d)).astype(f),
            "new_value": rng.standard_normal((1, hkv, rows, d)).astype(f), "mask": mask}


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
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--chunk", type=int, help="also a prefill chunk of this many rows")
    ap.add_argument("--past", type=int, default=384, help="cache slots the prefill chunk sees")
    ap.add_argument("--half", action="store_true", help="a float16 cache (AttentionHalfKV)")
    args = ap.parse_args()
    if args.chunk and not 0 <= args.past <= SLOTS:
        ap.error(f"--past must be 0 to {SLOTS} (the cache's slots)")
    shape = SHAPES[args.shape]
    libraries = {"installed": str(kernels.require_library())} | ({"baseline": args.baseline} if args.baseline else {})
    sessions = {name: _session(path, args.threads, shape[2], args.half) for name, path in libraries.items()}
    rng = np.random.default_rng(0)
    report = {"machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
              "threads": args.threads, "shape": args.shape, "half": args.half, "cases": {}}
    cases = [(f"T={rows} keys={keys}", _inputs(shape, rows, keys, rng), rows * (keys + 1))
             for rows in (1, 9) for keys in args.keys]
    if args.chunk:
        seen = args.chunk * args.past + args.chunk * (args.chunk + 1) // 2
        cases.append((f"prefill T={args.chunk} past={args.past}", _inputs(shape, args.chunk, args.past, rng, True),
                      seen))
    for label, feed, row_keys in cases:
        if args.half:
            feed = {n: a.astype(np.float16) if n.startswith("past") else a for n, a in feed.items()}
        outs = {name: s.run(None, feed)[0] for name, s in sessions.items()}  # warm-up, and the values
        calls = max(3, int(2e6 / (shape[0] * row_keys)))
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for _ in range(args.repeats):
            for name, s in sessions.items():
                times[name].append(_seconds(s, feed, calls) * 1e9 / (shape[0] * row_keys))
        case = {name: round(float(np.median(t)), 1) for name, t in times.items()}
        if "baseline" in outs:
            case["speedup"] = round(case["baseline"] / case["installed"], 2)
            case["max_abs_difference"] = float(np.abs(outs["baseline"] - outs["installed"]).max())
        report["cases"][label] = case
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
