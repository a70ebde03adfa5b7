"""Per-step decode cost against context length C: transformers' concat attention vs split attention.

    python -m benchmarks.attention_cost [--contexts 256 1024 2048] [--repeats 20] [--threads 2]

On the ~220M Llama of benchmarks/decode.py (random weights, built once and cached), exports a
decode graph (T = 1) both ways at each C: `concat`, transformers' attention, which copies the
whole cache into [past; new] in every layer on every call, and `split` (export/split_attention.py),
which reads the cache in place. Both are optimised as the compiler does for ort-cpu (EXTENDED, ORT
prepacks the weights) and timed one step at a time, alternating, with spinning off as in the runtime.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from benchmarks.decode import TLM, checkpoint
from common import graph_io
from common.graph_io import ModelDims
from common.onnx_store import save_shared
from common.targets import TARGETS, session_options, spin_within_calls
from export.loader import load_model
from export.onnx_export import model_dims, trace_graph

VARIANTS = {"concat": False, "split": True}  # name -> trace_graph(split_attention=...)


def _session(path: Path, threads: int) -> ort.InferenceSession:
    so = spin_within_calls(session_options(threads))
    so.graph_optimization_level = TARGETS["ort-cpu"].offline_level
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _binding(session: ort.InferenceSession, dims: ModelDims, context: int, rng: np.random.Generator
             ) -> tuple[ort.IOBinding, list[np.ndarray]]:
    """Preallocated inputs and outputs bound once, as the runtime does: a step is only the graph's run."""
    binding = session.io_binding()
    keep: list[np.ndarray] = []
    feeds = {graph_io.INPUT_IDS: np.full((1, 1), 7, np.int64),
             graph_io.POSITION_IDS: np.full((1, 1), context, np.int64),
             graph_io.ATTENTION_MASK: np.ones((1, 1, context + 1), bool)}  # every slot valid: the full cost
    for name, shape in graph_io.input_shapes(dims, 1, 1, context).items():
        arr = feeds.get(name)
        arr = rng.standard_normal(shape).astype(np.float32) if arr is None else arr
        binding.bind_cpu_input(name, arr)
        keep.append(arr)
    for name, shape in graph_io.output_shapes(dims, 1, 1).items():
        arr = np.zeros(shape, np.float32)
        binding.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        keep.append(arr)
    return binding, keep


def measure(model, context: int, repeats: int, threads: int, warmup: int = 3) -> dict[str, float]:
    """Median per-step latency (ms) of each variant's decode graph at `context` cache slots."""
    dims = model_dims(model)
    with tempfile.TemporaryDirectory(prefix="attn-cost-") as tmp:
        graphs = {name: trace_graph(model, 1, context, split_attention=split) for name, split in VARIANTS.items()}
        paths = save_shared(graphs, Path(tmp), "weights.bin")  # one weights file for both
        del graphs
        sessions = {name: _session(path, threads) for name, path in paths.items()}
    rng = np.random.default_rng(0)
    bound = {name: _binding(s, dims, context, rng) for name, s in sessions.items()}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for r in range(warmup + repeats):
        order = list(sessions) if r % 2 == 0 else list(reversed(sessions))  # neither always runs first
        for name in order:
            t0 = time.perf_counter()
            sessions[name].run_with_iobinding(bound[name][0])
            if r >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: float(np.median(v)) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2, help="ORT intra-op threads")
    args = ap.parse_args()
    ckpt = checkpoint("llama-220m", TLM, 0)
    model = load_model(ckpt, max(args.contexts), progress=False)
    dims = model_dims(model)
    print(f"# {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
          f"onnxruntime {ort.__version__}, {args.threads} intra-op threads, median of {args.repeats} steps")
    print("| C | KV cache MiB | concat ms/step | split ms/step | split / concat |")
    print("|---|---|---|---|---|")
    for c in args.contexts:
        ms = measure(model, c, args.repeats, args.threads)
        cache_mib = 2 * dims.n_layers * dims.n_kv_heads * c * dims.head_dim * 4 / 2**20
        print(f"| {c} | {cache_mib:.0f} | {ms['concat']:.1f} | {ms['split']:.1f} | {ms['split'] / ms['concat']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
