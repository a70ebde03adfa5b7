"""Fuse each residual Add and the RMS norm after it into ONNX Runtime's SkipSimplifiedLayerNormalization.

A Llama layer adds its attention and MLP outputs to the residual stream and normalises the sum: an
Add then a SimplifiedLayerNormalization (ONNX Runtime's own fusion of the exported RMS norm), 60 of
a SmolLM2 decode step's nodes. The contrib op (com.microsoft, CPU) computes both, its fourth output
being the sum, which the next residual Add reads. It runs on the graph ONNX Runtime has optimised
(its optimiser does not make this fusion itself here), for the CPU target. Its norm is computed
with other roundings than the unfused op's, so logits differ in the last bits from an unfused
build (not from one row to another: it normalises each row alone).
"""

from __future__ import annotations

import onnx
from onnx import helper

from compiler.layouts import attribute, replace_nodes

MS_DOMAIN = "com.microsoft"


def fuse_skip_norms(model: onnx.ModelProto, shapes: dict[str, list[int | None]]) -> int:
    """Fuse every Add of two computed tensors of one known shape ([B, T, H] or [N, H]: the op does not
    broadcast) normalised by a SimplifiedLayerNormalization over the last axis with a constant scale
    (in place); returns how many. `shapes`: compiler.layouts.tensor_shapes of the exported graph,
    whose tensor names ONNX Runtime's optimiser keeps."""
    graph = model.graph
    nodes = list(graph.node)  # one wrapper per node, so that id() names it throughout
    producer = {o: n for n in nodes for o in n.output}
    constants = {t.name for t in graph.initializer}
    fused: dict[int, onnx.NodeProto | None] = {}  # id(add) -> the fused node; id(norm) -> None
    for norm in nodes:
        is_norm = norm.op_type == "SimplifiedLayerNormalization" and norm.domain in ("", "ai.onnx")
        add = producer.get(norm.input[0]) if is_norm else None
        if (add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or id(add) in fused
                or not all(i in producer for i in add.input) or attribute(norm, "axis", -1) != -1
                or len(norm.input) != 2 or norm.input[1] not in constants or len(norm.output) != 1):
            continue
        a, b = (shapes.get(i) for i in add.input)
        if not a or a != b or None in a or len(a) not in (2, 3):
            continue
        fused[id(add)] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0]], name=f"{norm.name or norm.output[0]}.skip", domain=MS_DOMAIN,
            epsilon=attribute(norm, "epsilon", 1e-5))
        fused[id(norm)] = None
    if not fused:
        return 0
    replace_nodes(graph, nodes, fused)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return sum(1 for n in fused.values() if n is not None)
