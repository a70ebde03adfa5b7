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

from compiler.layouts import attribute
from compiler.skip_norm import MS_DOMAIN
from kernels import DOMAIN, SWIGLU


def fuse_swiglu(model: onnx.ModelProto) -> int:
    """Fuse every Split into two halves read only by QuickGelu(alpha = 1, given: its default is 1.702)
    of the first and a Mul of that by the second (in place); returns how many."""
    graph = model.graph
    nodes = list(graph.node)  # one wrapper per node, so that id() names it throughout
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}

    def only_reader(name: str) -> onnx.NodeProto | None:
        r = readers.get(name, [])
        return r[0] if len(r) == 1 and name not in outputs else None

    fused: dict[int, onnx.NodeProto | None] = {}  # id(mul) -> its SwiGLU; id(split), id(gelu) -> None
    for split in nodes:
        if split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.output) != 2:
            continue
        gelu, mul = only_reader(split.output[0]), only_reader(split.output[1])
        if (gelu is None or mul is None or gelu.op_type != "QuickGelu" or gelu.domain != MS_DOMAIN
                or attribute(gelu, "alpha") != 1.0 or only_reader(gelu.output[0]) is not mul
                or mul.op_type != "Mul" or sorted(mul.input) != sorted([gelu.output[0], split.output[1]])
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
    kept = [fused.get(id(n), n) for n in nodes if fused.get(id(n), n) is not None]
    del graph.node[:]
    graph.node.extend(kept)
    return sum(1 for n in fused.values() if n is not None)
