"""Fold each residual RMS norm and each MLP gate into the matmul that alone reads it (its `prologue`).

After the other fusions a SmolLM2 layer is 9 nodes, 4 of them SkipSimplifiedLayerNormalization (2)
and SwiGLU (1) plus the final norm's: 91 of a decode step's 284 nodes, each computing a few hundred
floats in less time than ONNX Runtime takes to dispatch it. MXMatMul and RowMatMul (float32 weights)
compute the same rows themselves first (kernels/prologue.h: the same bits as the ops they replace)
and write the residual sum as their second output. It runs on the graph ONNX Runtime has optimised, after
compiler/skip_norm.py and compiler/swiglu.py.
"""

from __future__ import annotations

import onnx
from onnx import helper

from compiler.layouts import Readers, attribute, replace_nodes
from compiler.skip_norm import MS_DOMAIN
from kernels import DOMAIN, MX_MATMUL, ROW_MATMUL, SWIGLU

PROLOGUE_SWIGLU, PROLOGUE_SKIP_RMS = 1, 2  # kernels/prologue.h


def _fused(matmul: onnx.NodeProto, inputs: list[str], outputs: list[str], prologue: int, **attrs: object
           ) -> onnx.NodeProto:
    node = helper.make_node(matmul.op_type, inputs, outputs, name=f"{matmul.name or matmul.output[0]}.prologue",
                            domain=DOMAIN, prologue=prologue, **attrs)
    node.attribute.extend(a for a in matmul.attribute if a.name not in ("prologue", *attrs))
    return node


def fuse_matmul_prologues(model: onnx.ModelProto) -> int:
    """Fold every SwiGLU, and every SkipSimplifiedLayerNormalization without bias whose normalised output
    only an MXMatMul or RowMatMul reads (as its input rows), into that matmul (in place); returns how many. The
    fused node takes the folded node's place in the order, where its inputs are ready."""
    graph = model.graph
    nodes = list(graph.node)  # one wrapper per node, so that id() names it throughout
    readers = Readers(graph, nodes)
    fused: dict[int, onnx.NodeProto | None] = {}  # id(folded node) -> the fused matmul; id(matmul) -> None
    for node in nodes:
        out = node.output[0] if node.output else ""
        matmul = readers.sole(out, MX_MATMUL, DOMAIN) or readers.sole(out, ROW_MATMUL, DOMAIN)
        if matmul is None or matmul.input[0] != out or attribute(matmul, "prologue", 0) or id(matmul) in fused:
            continue
        if node.op_type == SWIGLU and node.domain == DOMAIN:
            fused[id(node)] = _fused(matmul, [node.input[0], *matmul.input[1:]], list(matmul.output[:1]),
                                     PROLOGUE_SWIGLU)
        elif (node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == MS_DOMAIN
              and len(node.input) == 3 and not any(node.output[1:3])):
            total = node.output[3] if len(node.output) > 3 and node.output[3] else f"{out}.residual"
            fused[id(node)] = _fused(matmul, [*node.input[:1], *matmul.input[1:], node.input[1], node.input[2]],
                                     [matmul.output[0], total], PROLOGUE_SKIP_RMS,
                                     epsilon=float(attribute(node, "epsilon", 1e-12)))  # the op's default
        else:
            continue
        fused[id(matmul)] = None
    if fused:
        replace_nodes(graph, nodes, fused)
    return sum(1 for n in fused.values() if n is not None)
