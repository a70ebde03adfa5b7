"""Concatenate the MXMatMuls that read the same activations (q/k/v, gate/up) into one call and a Split.

Exported, a layer's q, k and v projections are three MXMatMul calls on the same input: three
roundings of the same activations and three parallel dispatches. The kernel stores weights column by
column ([N, K/32, bytes per block], kernels/layout.py), so the weights concatenated along N are the
packed weight, and each output column is computed exactly as before (the same bits) in one call.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from compiler.invariance import Read, Store, drop_dead
from kernels import DOMAIN, MX_MATMUL

SEPARATOR = "|"  # a packed weight's name: its members' names joined (compiler.build checks each survived)


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _array(t: onnx.TensorProto, read: Read) -> np.ndarray:
    return numpy_helper.to_array(onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, raw_data=read(t)))


def pack_matmuls(model: onnx.ModelProto, read: Read = lambda t: t.raw_data, store: Store = lambda t: t) -> int:
    """Pack every group of MXMatMuls with the same input and settings (in place); returns how many
    calls it saved."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type == MX_MATMUL and node.domain == DOMAIN:
            a = _attributes(node)
            key = (node.input[0], a["K"], a.get("activation_bits"), a.get("weight_bits", 6))
            groups.setdefault(key, []).append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id(first member) -> its packed call and split; others -> []
    for members in (g for g in groups.values() if len(g) > 1):
        name = SEPARATOR.join(m.input[1] for m in members)
        weights = np.concatenate([_array(inits[m.input[1]], read) for m in members])
        scales = np.concatenate([_array(inits[m.input[2]], read) for m in members])
        sizes = [int(_attributes(m)["N"]) for m in members]
        graph.initializer.extend([store(numpy_helper.from_array(weights, name)),
                                  store(numpy_helper.from_array(scales, name + ".scales")),
                                  numpy_helper.from_array(np.array(sizes, np.int64), name + ".sizes")])
        attributes = _attributes(members[0]) | {"N": sum(sizes)}
        packed = helper.make_node(MX_MATMUL, [members[0].input[0], name, name + ".scales"], [name + ".y"],
                                  name=name + ".packed", domain=DOMAIN, **attributes)
        split = helper.make_node("Split", [name + ".y", name + ".sizes"], [m.output[0] for m in members],
                                 name=name + ".split", axis=-1)
        replaced[id(members[0])] = [packed, split]
        replaced.update({id(m): [] for m in members[1:]})
    if not replaced:
        return 0
    nodes = [n for node in graph.node for n in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    drop_dead(graph)
    return sum(1 for v in replaced.values() if not v)
