"""Fuse each layer's RotaryQKV into the Attention that alone reads its queries: ai.mxspd::RotaryAttention.

After compiler/split_heads.py a layer's attention is two nodes: RotaryQKV turns the packed q/k/v
projection into rotated query and key heads and value heads, and Attention reads them. The first
costs a decode step of SmolLM2 ~0.2 ms over its 30 layers (1 thread), almost all of it dispatch of
a node that moves ~1,000 floats. The fused op (kernels/attention.cc) computes the same heads with
the same operations (kernels/rotary.h), so the same bits, and still writes the new keys and values,
which the runtime stores in its cache.
"""

from __future__ import annotations

import onnx
from onnx import helper

from compiler.layouts import Readers, attribute, replace_nodes
from kernels import ATTENTION, DOMAIN, ROTARY_ATTENTION, ROTARY_QKV


def fuse_rotary_attention(model: onnx.ModelProto) -> int:
    """Fuse every RotaryQKV whose queries only an Attention reads, and whose keys and values that
    Attention reads as its new ones, into that Attention (in place; the fused node takes the
    Attention's place, and any other reader of the keys and values must come after it); returns how
    many."""
    graph = model.graph
    nodes = list(graph.node)  # one wrapper per node, so that id() names it throughout
    order = {id(n): i for i, n in enumerate(nodes)}
    readers = Readers(graph, nodes)
    fused: dict[int, onnx.NodeProto | None] = {}  # id(attention) -> the fused node; id(rotary) -> None
    for rotary in nodes:
        if rotary.op_type != ROTARY_QKV or rotary.domain != DOMAIN:
            continue
        q, k, v = rotary.output
        att = readers.sole(q, ATTENTION, DOMAIN)
        if (att is None or list(att.input[:1]) + list(att.input[3:5]) != [q, k, v]
                or any(order[id(r)] < order[id(att)] for o in (k, v) for r in readers.of[o] if r is not att)):
            continue
        fused[id(att)] = helper.make_node(
            ROTARY_ATTENTION, [*rotary.input, att.input[1], att.input[2], att.input[5]], [att.output[0], k, v],
            name=f"{att.name or att.output[0]}.rotary", domain=DOMAIN, q_heads=attribute(rotary, "q_heads"),
            kv_heads=attribute(rotary, "kv_heads"), scale=attribute(att, "scale"),
            tokens_major=attribute(att, "tokens_major", 0))
        fused[id(rotary)] = None
    if fused:
        replace_nodes(graph, nodes, fused)
    return sum(1 for n in fused.values() if n is not None)
