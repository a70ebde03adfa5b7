"""Each row's greedy token and a finite check, computed in the graph (common/graph_io.py: NEXT_TOKEN,
LOGITS_CHECK), for targets whose logits live on a device.

Greedy decoding needs one integer per row, but a graph's logits are a vocabulary's floats per row
(SmolLM2: 192 KiB a row): on a GPU, bringing them to the host and scanning them there (argmax, the
finite check) was most of the host's work per token. With these outputs in the graph (replayed with
it as one CUDA graph) the runtime brings back T integers and T floats. On the CPU target the logits
are already in host memory, and numpy reads them 4-8x faster than ONNX Runtime's CPU ops do
(docs/benchmarks.md, "GPU target"), so its graphs have no such outputs.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from common import graph_io as io


def add_greedy_outputs(model: onnx.ModelProto) -> None:
    """NEXT_TOKEN = ArgMax(logits) over the vocabulary (the first index on ties, as numpy's argmax), and
    LOGITS_CHECK = ReduceSum(logits * 0): 0 where a row's logits are all finite, NaN where any is NaN or
    infinite (inf * 0 is NaN), with no overflow (a sum of the logits themselves could overflow) and only
    ops every provider has. In place."""
    graph = model.graph
    logits = next((o for o in graph.output if o.name == io.LOGITS), None)
    if logits is None:
        raise ValueError(f"graph {graph.name!r} has no {io.LOGITS!r} output")
    rows = [d.dim_value or d.dim_param for d in logits.type.tensor_type.shape.dim][:2]  # [B, T]
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    zero = helper.make_tensor("greedy.zero", TensorProto.FLOAT, [], [0.0])
    graph.initializer.append(zero)
    reduce_inputs = ["greedy.zeroed"]
    reduce_attrs: dict = {"keepdims": 0}
    if opset >= 13:  # axes became an input
        graph.initializer.append(helper.make_tensor("greedy.axes", TensorProto.INT64, [1], [-1]))
        reduce_inputs.append("greedy.axes")
    else:
        reduce_attrs["axes"] = [-1]
    graph.node.extend([
        helper.make_node("ArgMax", [io.LOGITS], [io.NEXT_TOKEN], name="greedy.argmax", axis=-1, keepdims=0),
        helper.make_node("Mul", [io.LOGITS, zero.name], ["greedy.zeroed"], name="greedy.zeroed"),
        helper.make_node("ReduceSum", reduce_inputs, [io.LOGITS_CHECK], name="greedy.check", **reduce_attrs),
    ])
    graph.output.extend([helper.make_tensor_value_info(io.NEXT_TOKEN, TensorProto.INT64, rows),
                         helper.make_tensor_value_info(io.LOGITS_CHECK, TensorProto.FLOAT, rows)])
