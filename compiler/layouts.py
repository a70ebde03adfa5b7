"""Fold the head layout changes around attention into mxspd's kernels: no node only moves data.

Exported, each layer turns its attention output from heads-major [B, Hq, T, D] back to the
projection's [B, T, Hq * D] with a Transpose and a Reshape, and reshapes the query and key
projections into heads before their rotary embedding: four nodes per layer that copy a few hundred
floats each. The Attention kernel can write its output token-major (`tokens_major = 1`), and the
Rotary kernel can read the projection itself (`heads = H`: the same memory as the reshaped
tensor), so those nodes go. Values are untouched: the same bits.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import helper, shape_inference

from compiler.invariance import drop_dead
from kernels import ATTENTION, DOMAIN, ROTARY

HEADS_FIRST = [0, 2, 1, 3]  # Transpose perm: [B, T, H, D] <-> [B, H, T, D]


def tensor_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Every tensor's inferred shape (None for an unknown dimension); take it before adding mxspd's ops,
    whose outputs ONNX cannot infer."""
    inferred = shape_inference.infer_shapes(model)  # the graph alone: weights stay external
    values = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    return {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
            for v in values}


def attribute(node: onnx.NodeProto, name: str, default: object = None) -> object:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


class Readers:
    """Which nodes read each tensor of a graph, for the fusion passes: a tensor fuses into its reader only
    when that reader is the only one (a graph output counts as read by the caller)."""

    def __init__(self, graph: onnx.GraphProto, nodes: Iterable[onnx.NodeProto]) -> None:
        self.of: dict[str, list[onnx.NodeProto]] = {}
        for n in nodes:
            for i in n.input:
                self.of.setdefault(i, []).append(n)
        self.outputs = {o.name for o in graph.output}

    def sole(self, name: str, op_type: str, domain: str = "") -> onnx.NodeProto | None:
        """The node that alone reads `name`, if it is an `op_type` of `domain`."""
        r = self.of.get(name, [])
        one = len(r) == 1 and name not in self.outputs
        return r[0] if one and r[0].op_type == op_type and r[0].domain == domain else None


def replace_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], by: dict[int, onnx.NodeProto | None]) -> None:
    """The graph's nodes become `nodes` in order, each node n replaced by by[id(n)] if given (None: removed)."""
    kept = [by.get(id(n), n) for n in nodes if by.get(id(n), n) is not None]
    del graph.node[:]
    graph.node.extend(kept)


def fold_layouts(model: onnx.ModelProto, shapes: dict[str, list[int | None]]) -> int:
    """Fold every attention output transpose and rotary input reshape (in place); returns how many.
    `shapes`: tensor_shapes of the exported graph."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers = Readers(graph, graph.node)
    folded, moved = 0, []  # moved: the Transposes and Reshapes an Attention now does itself
    for node in graph.node:
        if node.domain != DOMAIN:
            continue
        if node.op_type == ATTENTION and attribute(node, "tokens_major", 0) == 0:
            transpose = readers.sole(node.output[0], "Transpose")
            reshape = transpose and readers.sole(transpose.output[0], "Reshape")
            heads = shapes.get(node.output[0]) or []
            flat = shapes.get(reshape.output[0]) if reshape else None
            if (transpose and list(attribute(transpose, "perm", [])) == HEADS_FIRST and len(heads) == 4
                    and None not in heads and flat == [heads[0], heads[2], heads[1] * heads[3]]):
                node.output[0] = reshape.output[0]
                node.attribute.append(helper.make_attribute("tokens_major", 1))
                moved += [transpose, reshape]
                folded += 1
        elif node.op_type == ROTARY and attribute(node, "heads", 0) == 0:
            reshape = producer.get(node.input[0])
            if reshape is None or reshape.op_type != "Reshape":
                continue
            flat, split = shapes.get(reshape.input[0]) or [], shapes.get(reshape.output[0]) or []
            if (len(flat) == 3 and len(split) == 4 and None not in flat + split
                    and split[:2] == flat[:2] and split[2] * split[3] == flat[2]):
                node.input[0] = reshape.input[0]
                node.attribute.append(helper.make_attribute("heads", split[2]))
                folded += 1
    for node in moved:
        graph.node.remove(node)
    if folded:
        drop_dead(graph)
    return folded
