"""Greedy tokens on the host (numpy on logits in host memory) against the graph's own outputs (ONNX Runtime's
CPU ArgMax and finite check, compiler/greedy_outputs.py), per call, side by side:

    python -m benchmarks.greedy_outputs [--vocab 49152] [--rows 1,5,128] [--threads 2] [--repeats 200]

Why the CPU target's graphs carry no greedy outputs: on the CPU the logits are already in host memory,
and what the host does with them (np.argmax and np.isfinite over the call's rows) is what the graph
would do, only faster. On a GPU the comparison is the logits' copy to the host against T integers'
(benchmarks.gpu, host_ms_per_token).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from benchmarks.bandwidth import cpu_name
from common import graph_io
from compiler.greedy_outputs import add_greedy_outputs


def _session(vocab: int, threads: int) -> ort.InferenceSession:
    """A graph whose logits are its input, with the greedy outputs the compiler adds."""
    logits = helper.make_tensor_value_info(graph_io.LOGITS, TensorProto.FLOAT, [1, "T", vocab])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], [graph_io.LOGITS])], "greedy",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", vocab])], [logits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    add_greedy_outputs(model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _median_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def measure(vocab: int, rows: list[int], threads: int, repeats: int) -> dict:
    session, out = _session(vocab, threads), {}
    names = [graph_io.NEXT_TOKEN, graph_io.LOGITS_CHECK]
    for t in rows:
        x = np.random.default_rng(t).standard_normal((1, t, vocab)).astype(np.float32)
        tokens, check = session.run(names, {"x": x})
        assert (tokens[0] == np.argmax(x[0], axis=-1)).all() and not np.isnan(check).any()
        host = _median_ms(lambda x=x: (np.argmax(x[0], axis=-1), np.isfinite(x[0]).all(axis=-1)), repeats)
        graph = _median_ms(lambda x=x: session.run(names, {"x": x}), repeats)
        out[t] = {"host_numpy_ms": round(host, 4), "graph_outputs_ms": round(graph, 4),
                  "graph_over_host": round(graph / host, 2)}
    return {"cpu": cpu_name(), "vocab": vocab, "threads": threads, "rows": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    ap.add_argument("--rows", default="1,5,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.vocab, [int(r) for r in args.rows.split(",")], args.threads, args.repeats), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
