"""The decode floor's two numbers: bytes of weights one model call reads, and how fast this machine reads.

    python -m benchmarks.bandwidth [--gib 1] [--repeats 5] [ARTIFACT]

Read bandwidth is the fastest streaming read measured on this machine: a sum over a float32 tensor
of `--gib` GiB (many times the last-level cache) with all of the process's cores, best of
`--repeats`. Weight bytes per call are the bytes of the initializers a graph's matrix products read
(MatMul's and Gemm's weight, MatMulNBits' codes and scales): every decode step reads all of them,
and nothing else of comparable size (norms are small; the embedding gathers one row). Weights read
per token over bandwidth is the fastest a weight-bound decode can go.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import onnx

from common import graph_io
from common.manifest import read_manifest

_PRODUCT_WEIGHTS = {"MatMul": (1,), "FusedMatMul": (1,), "Gemm": (1,), "MatMulNBits": (1, 2), "MXMatMul": (1, 2),
                    "RowMatMul": (1,)}


def cpu_name() -> str:
    """The CPU's model name (benchmarks name the CPU they ran on: this machine kind has two)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5, allocations: int = 3) -> float:
    """GB/s at which this process (all of its cores) streams through a large float32 tensor: torch.sum,
    the fastest reader measured here (75-80 GB/s on 2 cores, where ONNX Runtime's ReduceSum reaches 49
    along rows and 36 over all axes, and single-threaded numpy 25). The best over `repeats` reads of
    each of `allocations` fresh tensors: how fast a tensor reads depends on the pages backing it (an
    allocation now and then reads at 48-50 GB/s here)."""
    import torch

    if not gib * 2**30 >= 4 * 4096 or repeats < 1 or allocations < 1:
        raise ValueError(f"the probe needs at least one 16 KiB row, one repeat and one allocation; got gib={gib}, "
                         f"repeats={repeats}, allocations={allocations}")
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    best = float("inf")
    for _ in range(allocations):
        data = torch.rand(int(gib * 2**30 / 4 / 4096), 4096)
        data.sum()
        for _ in range(repeats):
            t0 = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - t0)
        del data
    return int(gib * 2**30 / 4 / 4096) * 4096 * 4 / best / 1e9


def gpu_read_bandwidth_gbs(gib: float = 4.0, repeats: int = 10) -> float:
    """GB/s at which the GPU streams through a float32 tensor in its memory (torch.sum, timed with CUDA
    events, best of `repeats`): the GPU target's decode floor is the weights read per token over this."""
    import torch

    data = torch.rand(int(gib * 2**30 / 4), device="cuda")
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        data.sum()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return data.numel() * 4 / best / 1e9


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def weight_bytes_per_call(artifact_dir: Path, model: str, graph: str = graph_io.DECODE) -> int:
    """Bytes of the weights the matrix products of one call of `graph` read."""
    entry = read_manifest(artifact_dir, verify=False).models[model]
    g = onnx.load(str(Path(artifact_dir) / entry.graphs[graph].file), load_external_data=False).graph
    sizes = {t.name: int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
             for t in g.initializer}
    for n in g.node:  # RowMatMul's panels are padded to 64 columns; the padding is never read
        if n.op_type == "RowMatMul" and n.input[1] in sizes:
            k = next(t.dims[1] for t in g.initializer if t.name == n.input[1])
            sizes[n.input[1]] = 4 * k * next(a.i for a in n.attribute if a.name == "N")
    names = {n.input[i] for n in g.node for i in _PRODUCT_WEIGHTS.get(n.op_type, ()) if len(n.input) > i}
    return sum(sizes[name] for name in names if name in sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", nargs="?", type=Path)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    gbs = read_bandwidth_gbs(args.gib, args.repeats)
    out: dict = {"read_bandwidth_GB_per_s": round(gbs, 1)}
    if args.artifact:
        for model in read_manifest(args.artifact, verify=False).models:
            mb = weight_bytes_per_call(args.artifact, model) / 1e6
            out[model] = {"weights_read_per_decode_call_MB": round(mb, 1), "floor_ms": round(mb / gbs, 3)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
