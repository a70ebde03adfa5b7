"""Where one call of a compiled graph spends its time: the whole call at 1 and 2 threads, and
ONNX Runtime's per-op-type kernel time (its profiler adds a little per node, so the split is the
useful part, not the sum).

    python -m benchmarks.step_profile ARTIFACT [--model tlm] [--graph decode] [--calls 30] [--visible N]
                                      [--apart]

Inputs are zeros with a full attention mask (the cost of a decode step does not depend on the
values), or with only the first N cache slots visible (attention skips hidden keys, so its cost
follows the visible ones: a short chat turn sees ~100); with `--apart` each row sees N slots of its own
and itself (a server's step: rows of different sequences, no key shared, no row's keys in cache).
Sessions are made as the runtime makes them (common.targets.compiled_session_options).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common import graph_io
from common.manifest import read_manifest
from common.targets import Target, compiled_session_options, get_target

_DTYPES = {"tensor(int64)": np.int64, "tensor(float)": np.float32, "tensor(bool)": np.bool_,
           "tensor(float16)": np.float16}


def _session(path: Path, target: Target, threads: int, profile: str | None = None) -> ort.InferenceSession:
    so = compiled_session_options(target, threads)
    if profile:
        so.enable_profiling, so.profile_file_prefix = True, profile
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _feeds(s: ort.InferenceSession, visible: int | None = None, apart: bool = False) -> dict[str, np.ndarray]:
    out = {}
    for i in s.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        dtype = _DTYPES[i.type]
        out[i.name] = np.ones(shape, dtype) if dtype == np.bool_ else np.zeros(shape, dtype)
    if visible is not None:
        mask = out[graph_io.ATTENTION_MASK]
        tokens = out[graph_io.INPUT_IDS].shape[-1]
        slots = mask.shape[-1] - tokens
        mask[..., visible:slots] = False  # cache slots past the first `visible`
        if apart:
            mask[...] = False
            for r in range(tokens):
                mask[..., r, (r * visible + np.arange(visible)) % slots] = True
                mask[..., r, slots + r] = True
    return out


def _ms_per_call(s: ort.InferenceSession, feeds: dict, calls: int) -> float:
    for _ in range(3):
        s.run(None, feeds)
    t0 = time.perf_counter()
    for _ in range(calls):
        s.run(None, feeds)
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--model", default="tlm")
    ap.add_argument("--graph", default="decode")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--visible", type=int, help="cache slots each row sees (default: all)")
    ap.add_argument("--apart", action="store_true", help="each row sees --visible slots of its own, and itself")
    args = ap.parse_args()
    manifest = read_manifest(args.artifact, verify=False)
    path = args.artifact / manifest.models[args.model].graphs[args.graph].file
    report: dict = {"graph": str(path), "ms_per_call": {}}
    for threads in (1, 2, 1, 2):  # interleaved, twice
        s = _session(path, get_target(manifest.target), threads)
        report["ms_per_call"].setdefault(f"{threads} threads", []).append(
            round(_ms_per_call(s, _feeds(s, args.visible, args.apart), args.calls), 2))
    with tempfile.TemporaryDirectory() as tmp:
        s = _session(path, get_target(manifest.target), 1, profile=str(Path(tmp) / "p"))
        feeds = _feeds(s, args.visible, args.apart)
        for _ in range(args.calls):
            s.run(None, feeds)
        events = json.loads(Path(s.end_profiling()).read_text())
    by_op: dict[str, float] = defaultdict(float)
    nodes: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"] / args.calls
            nodes[e["args"]["op_name"]] += 1
    total = sum(by_op.values())
    report["profiled_1_thread_kernel_ms_per_call"] = round(total / 1e3, 2)
    report["nodes"] = sum(nodes.values()) // args.calls
    report["by_op_type"] = {op: {"ms": round(us / 1e3, 3), "share": round(us / total, 3),
                                 "nodes": nodes[op] // args.calls}
                            for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
