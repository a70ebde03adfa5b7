"""A float16 KV cache on the CPU target (a recipe's `kv_cache = "float16"`): half the bytes that each
token's attention reads from the cache, and half the cache's memory.

mxspd's attention ops have float16-cache twins (kernels/attention.cc: AttentionHalfKV and
RotaryAttentionHalfKV) that round the call's new keys and values to float16 (to nearest, ties to even)
before attending, and return the rounded ones for the runtime to store. A key is then the same number
whether a call reads it as one of its new rows or from the cache, so speculation and batching still give
autoregressive decoding's bits; every row's output is the float32 kernel's on the rounded keys and values.

This pass makes each graph's past_key/past_value inputs and new_key/new_value outputs float16 and each
attention node its twin. The runtime allocates the cache in the graphs' type (ModelDims.kv_dtype), as it
does for the GPU target, whose graphs are float16 throughout (compiler/float16.py).
"""

from __future__ import annotations

import re

import onnx
from onnx import TensorProto

from kernels import ATTENTION, ATTENTION_HALF_KV, DOMAIN, ROTARY_ATTENTION, ROTARY_ATTENTION_HALF_KV

_PAST = re.compile(r"past_(key|value)\.\d+$")
_NEW = re.compile(r"new_(key|value)\.\d+$")


def half_kv_cache(model: onnx.ModelProto) -> int:
    """Turn `model` (after compiler/rotary_attention.py) to a float16 KV cache in place; returns how many
    attention nodes it changed. A plain Attention's new keys and values, which its producer wrote as the
    graph's outputs, now reach the graph through the node's own rounded outputs."""
    graph = model.graph
    outputs = {o.name for o in graph.output if _NEW.fullmatch(o.name)}
    changed = 0
    for node in graph.node:
        if node.domain != DOMAIN:
            continue
        if node.op_type == ROTARY_ATTENTION:
            node.op_type = ROTARY_ATTENTION_HALF_KV
        elif node.op_type == ATTENTION:
            _reroute(graph, node, outputs)
            node.op_type = ATTENTION_HALF_KV
        else:
            continue
        changed += 1
    halved = {i.name for i in graph.input if _PAST.fullmatch(i.name)} | outputs
    for v in [*graph.input, *graph.output]:
        if v.name in halved:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    kept = [v for v in graph.value_info if v.name not in halved]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return changed


def _reroute(graph: onnx.GraphProto, node: onnx.NodeProto, outputs: set[str]) -> None:
    """AttentionHalfKV's outputs 1 and 2 (its new keys and values, rounded): where a graph output is the
    new key (value) the node reads, the float32 tensor is renamed for its readers and the graph output
    comes from the node; otherwise the rounded tensor gets a name of its own."""
    extra = []
    for slot in (3, 4):
        name = node.input[slot]
        if name not in outputs:
            extra.append(f"{node.name or node.output[0]}.kv{slot}.float16")
            continue
        renamed = f"{name}.float32"
        for n in graph.node:
            n.output[:] = [renamed if o == name else o for o in n.output]
            n.input[:] = [renamed if i == name else i for i in n.input]
        extra.append(name)
    node.output[:] = [node.output[0], *extra]
