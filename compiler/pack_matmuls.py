"""Concatenate the matmuls that read the same activations (q/k/v, gate/up) into one call and a Split.

Exported, a layer's q, k and v projections are three calls on the same input: three parallel
dispatches (and, for MXMatMul, three roundings of the same activations). mxspd's kernels store
weights by groups of output columns (MXMatMul: 16 columns, [ceil(N/16), K/32, bytes per block];
RowMatMul: panels of 64 columns, [ceil(N/64), K, 64]; kernels/layout.py), so the weights concatenated
along their first axis are the packed weight, and each output column is computed exactly as before
(the same bits) in one call. Weights pack only where every member but the last fills whole groups.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from compiler.invariance import Read, Store, drop_dead, initializer_array
from kernels import DOMAIN, MX_MATMUL, ROW_MATMUL
from kernels.layout import GROUP, PANEL, TRIPLES

SEPARATOR = "|"  # a packed weight's name: its members' names joined (compiler.build checks each survived)
COLUMNS = {MX_MATMUL: GROUP, ROW_MATMUL: PANEL}  # the columns each op's weights group together


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _group(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> tuple | None:
    """What a node must share with others to be packed with them (None: not a packable call)."""
    if node.domain != DOMAIN or node.input[1] not in inits:
        return None
    a = _attributes(node)
    if node.op_type == MX_MATMUL:
        return (node.op_type, node.input[0], a["K"], a.get("activation_bits"), a.get("weight_bits", 6),
                a.get("layout", TRIPLES))
    if node.op_type == ROW_MATMUL:
        return node.op_type, node.input[0], tuple(inits[node.input[1]].dims[1:])
    return None


Concat = Callable[[list[onnx.TensorProto], str], onnx.TensorProto | None]


def pack_matmuls(model: onnx.ModelProto, read: Read = lambda t: t.raw_data, store: Store = lambda t: t,
                 concat: Concat = lambda members, name: None) -> int:
    """Pack every group of MXMatMuls (or RowMatMuls) with the same input and settings (in place);
    returns how many calls it saved. `concat` may give a packed weight without copying its members
    (common/onnx_store.py's SharedFile.span: they lie back to back in the weights file); where it gives
    None, the members are read, concatenated and stored."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if (key := _group(node, inits)) is not None:
            groups.setdefault(key, []).append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id(first member) -> its packed call and split; others -> []
    for i, members in enumerate(g for g in groups.values() if len(g) > 1):
        sizes = [int(_attributes(m)["N"]) for m in members]
        if any(n % COLUMNS[members[0].op_type] for n in sizes[:-1]):
            continue  # a member's last group is padded: concatenated groups would not be the packed weight
        name = SEPARATOR.join(m.input[1] for m in members)
        weights = [f"{name}.{j}" if j > 1 else name for j in range(1, len(members[0].input))]
        if name not in inits:  # the same weights on another input (shared layers): packed once
            for j, packed_name in enumerate(weights, start=1):
                inits[packed_name] = concat([inits[m.input[j]] for m in members], packed_name) or store(
                    numpy_helper.from_array(np.concatenate([initializer_array(inits[m.input[j]], read)
                                                            for m in members]), packed_name))
                graph.initializer.append(inits[packed_name])
            inits[name + ".sizes"] = numpy_helper.from_array(np.array(sizes, np.int64), name + ".sizes")
            graph.initializer.append(inits[name + ".sizes"])
        attributes = _attributes(members[0]) | {"N": sum(sizes)}
        packed = helper.make_node(members[0].op_type, [members[0].input[0], *weights], [f"{name}.y{i}"],
                                  name=f"{name}.packed{i}", domain=DOMAIN, **attributes)
        split = helper.make_node("Split", [f"{name}.y{i}", name + ".sizes"], [m.output[0] for m in members],
                                 name=f"{name}.split{i}", axis=-1)
        replaced[id(members[0])] = [packed, split]
        replaced.update({id(m): [] for m in members[1:]})
    if not replaced:
        return 0
    nodes = [n for node in graph.node for n in replaced.get(id(node), [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    drop_dead(graph)
    return sum(1 for v in replaced.values() if not v)
