"""Split a packed q/k/v call's output into rotated query and key heads and value heads in one op.

After packing (compiler/pack_matmuls.py) a layer's attention input is one MXMatMul, then a Split, a
Rotary for the queries and one for the keys, and a Reshape and a Transpose that turn the values into
heads (a graph output): five nodes that each move a few hundred floats, ~2 microseconds of dispatch
apiece on a 2-core decode step of ~4.5 ms. `ai.mxspd::RotaryQKV` (kernels/rotary.cc) reads the packed
output once and writes all three with the same float operations: the same bits.
"""

from __future__ import annotations

import onnx
from onnx import helper

from compiler.invariance import drop_dead
from compiler.layouts import HEADS_FIRST, Readers, attribute
from kernels import DOMAIN, ROTARY, ROTARY_QKV


def fuse_split_heads(model: onnx.ModelProto, shapes: dict[str, list[int | None]]) -> int:
    """Fuse every packed q/k/v Split with its two Rotary ops and the values' head layout (in place);
    returns how many. `shapes`: compiler.layouts.tensor_shapes of the exported graph."""
    graph = model.graph
    nodes = list(graph.node)  # one wrapper per node, so that id() names it throughout
    order = {id(n): i for i, n in enumerate(nodes)}
    producer = {o: n for n in nodes for o in n.output}
    readers = Readers(graph, nodes)

    after: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> the fused nodes that go right after it
    removed: set[int] = set()
    for split in nodes:
        if split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.output) != 3:
            continue
        rq, rk = (readers.sole(o, ROTARY, DOMAIN) for o in split.output[:2])
        reshape = readers.sole(split.output[2], "Reshape")
        transpose = reshape and readers.sole(reshape.output[0], "Transpose")
        if (not (rq and rk and transpose) or list(attribute(transpose, "perm", [])) != HEADS_FIRST
                or [rq.input[0], rk.input[0], reshape.input[0]] != list(split.output)):
            continue
        hq, hkv = attribute(rq, "heads", 0), attribute(rk, "heads", 0)
        widths = [(shapes.get(o) or [None])[-1] for o in split.output]
        heads = shapes.get(reshape.output[0]) or []
        rows = (shapes.get(split.output[2]) or [])[:2]
        if (not hq or not hkv or None in widths or widths[0] % hq or len(heads) != 4 or heads[:2] != rows
                or heads[2:] != [hkv, widths[0] // hq] or widths[1:] != [heads[2] * heads[3]] * 2
                or rq.input[1:] != rk.input[1:] or attribute(split, "axis", 0) not in (-1, 2)):
            continue
        # In the graph's order: after the Split and the angles, before anything that reads its outputs.
        at = max([order[id(split)], *(order[id(producer[a])] for a in rq.input[1:] if a in producer)])
        new = (rq.output[0], rk.output[0], transpose.output[0])
        if any(order[id(r)] <= at for o in new for r in readers.of.get(o, [])):
            continue
        after.setdefault(id(nodes[at]), []).append(helper.make_node(
            ROTARY_QKV, [split.input[0], *rq.input[1:]], list(new), name=f"{split.name or split.output[0]}.qkv",
            domain=DOMAIN, q_heads=hq, kv_heads=hkv))
        removed.update(id(n) for n in (split, rq, rk, reshape, transpose))
    if not after:
        return 0
    kept = [m for n in nodes for m in ([] if id(n) in removed else [n]) + after.get(id(n), [])]
    del graph.node[:]
    graph.node.extend(kept)
    drop_dead(graph)
    return sum(map(len, after.values()))
