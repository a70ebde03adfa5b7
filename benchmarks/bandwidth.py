"""The decode floor's two numbers: bytes of weights one model call reads, and how fast this machine reads.

    python -m benchmarks.bandwidth [--gib 1] [--repeats 5] [ARTIFACT]

Read bandwidth is timed as ONNX Runtime's ReduceSum over a float32 initializer of `--gib` GiB (many
times the last-level cache), with the session's threads: the rate at which the runtime can stream
weights, best of `--repeats`. Weight bytes per call are the bytes of the initializers a graph's
matrix products read (MatMul's and Gemm's weight, MatMulNBits' codes and scales): every decode
step reads all of them, and nothing else of comparable size (norms are small; the embedding
gathers one row). Weights read per token over bandwidth is the fastest a weight-bound decode can go.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from common import graph_io
from common.manifest import read_manifest
from compiler.targets import session_options

_PRODUCT_WEIGHTS = {"MatMul": (1,), "FusedMatMul": (1,), "Gemm": (1,), "MatMulNBits": (1, 2)}


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s at which ONNX Runtime (CPU, all of this process's cores) reads a large float32 tensor."""
    rows = int(gib * 2**30 / 4 / 4096)
    data = np.random.default_rng(0).random((rows, 4096), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["w"], ["s"], keepdims=0)], "read",
        [helper.make_tensor_value_info("unused", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])], [numpy_helper.from_array(data, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "read.onnx"
        onnx.save(model, path, save_as_external_data=True, location="read.bin")
        del model, graph, data
        so = session_options()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no constant folding
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        feed = {"unused": np.zeros(1, np.float32)}
        session.run(None, feed)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            session.run(None, feed)
            best = min(best, time.perf_counter() - t0)
    return rows * 4096 * 4 / best / 1e9


def weight_bytes_per_call(artifact_dir: Path, model: str, graph: str = graph_io.DECODE) -> int:
    """Bytes of the weights the matrix products of one call of `graph` read."""
    entry = read_manifest(artifact_dir, verify=False).models[model]
    g = onnx.load(str(Path(artifact_dir) / entry.graphs[graph].file), load_external_data=False).graph
    sizes = {t.name: int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
             for t in g.initializer}
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
