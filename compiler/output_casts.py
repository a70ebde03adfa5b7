"""Drop a graph output's Cast to float32 of a tensor that is float32 already.

The exported graphs end in transformers' `logits.float()`: a Cast that ONNX Runtime's optimiser keeps
because its output is the graph's, so each call copies its logits once more (a 64-row serving step's
12.6 MB at SmolLM2's vocabulary, ~1.8 ms on one thread). Where mxspd's matmuls (float32 outputs) make
the tensor, their output takes the graph output's name instead: the same values, one copy fewer.
"""

from __future__ import annotations

import onnx

from compiler.layouts import Readers, attribute, replace_nodes
from kernels import DOMAIN, MX_MATMUL, ROW_MATMUL

FLOAT_OUTPUTS = {MX_MATMUL, ROW_MATMUL}  # mxspd's ops whose output is float32


def drop_output_casts(model: onnx.ModelProto) -> int:
    """Drop every float32 Cast between one of mxspd's matmuls and a graph output (in place); returns how many."""
    graph = model.graph
    nodes = list(graph.node)  # one wrapper per node, so that id() names it throughout
    producer = {o: n for n in nodes for o in n.output}
    readers = Readers(graph, nodes)
    dropped: dict[int, onnx.NodeProto | None] = {}
    for cast in nodes:
        src = producer.get(cast.input[0]) if cast.op_type == "Cast" and cast.domain in ("", "ai.onnx") else None
        if (src is None or src.domain != DOMAIN or src.op_type not in FLOAT_OUTPUTS
                or attribute(cast, "to") != onnx.TensorProto.FLOAT or cast.output[0] not in readers.outputs
                or readers.sole(cast.input[0], "Cast") is not cast):
            continue
        src.output[list(src.output).index(cast.input[0])] = cast.output[0]
        dropped[id(cast)] = None
    replace_nodes(graph, nodes, dropped)
    return len(dropped)
