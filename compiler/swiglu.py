"""Fuse each Llama MLP's gate (Split, QuickGelu, Mul) into ai.mxspd::SwiGLU.

After packing (compiler/pack_matmuls.py) and ONNX Runtime's own fusion of x * sigmoid(x) into
QuickGelu, a layer's MLP splits the packed gate/up output, applies QuickGelu to the gate and
multiplies: three nodes on a decode step's 2 x 1536 floats. The kernel (kernels/swiglu.cc) reads
the packed output once. Its sigmoid is its own (the same on every code path), not QuickGelu's, so
logits differ from an unfused build in the last bits (not from one row to another). It runs on the
graph ONNX Runtime has optimised, where the mxspd kernels are.
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from compiler.layouts import Readers, attribute, replace_nodes
from compiler.skip_norm import MS_DOMAIN
from kernels import DOMAIN, SWIGLU


def fuse_swiglu(model: onnx.ModelProto) -> int:
    """Fuse every Split into two halves read only by QuickGelu(alpha = 1, given: its default is 1.702)
    of the first and a Mul of that by the second (in place); returns how many."""
    graph = model.graph
    nodes = list(graph.node)  # one wrapper per node, so that id() names it throughout
    readers = Readers(graph, nodes)
    fused: dict[int, onnx.NodeProto | None] = {}  # id(mul) -> its SwiGLU; id(split), id(gelu) -> None
    for split in nodes:
        if split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.output) != 2:
            continue
        gelu, mul = readers.sole(split.output[0], "QuickGelu", MS_DOMAIN), readers.sole(split.output[1], "Mul")
        if (gelu is None or mul is None or attribute(gelu, "alpha") != 1.0
                or readers.sole(gelu.output[0], "Mul") is not mul
                or sorted(mul.input) != sorted([gelu.output[0], split.output[1]])
                or attribute(split, "axis", 0) != -1 or len(split.input) != 2):
            continue
        sizes = next((t for t in graph.initializer if t.name == split.input[1]), None)
        if sizes is None or len(set(numpy_helper.to_array(sizes).tolist())) != 1:
            continue  # halves of equal size only (a packed gate and up)
        fused[id(mul)] = helper.make_node(SWIGLU, [split.input[0]], [mul.output[0]],
                                          name=f"{mul.name or mul.output[0]}.swiglu", domain=DOMAIN)
        fused.update({id(split): None, id(gelu): None})
    if not fused:
        return 0
    replace_nodes(graph, nodes, fused)
    return sum(1 for n in fused.values() if n is not None)
