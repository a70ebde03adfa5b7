"""Batch invariance: every row of a compiled graph is computed by the same arithmetic whatever shares its call.

A token's logits must not depend on which graph scores it (decode, score{k}, lookahead), on the other
rows of its call, or on whether a key it attends to is a cache slot or a new row: otherwise greedy
speculation, MultiDecode and batched serving drift from autoregressive decoding (an int8 activation
rounding or a near-tie turns a 1e-6 difference into another token). ONNX Runtime gives no such
guarantee: its float32 MatMul runs one row through another kernel than several (AVX2), and attention
over [cache; new] sums in an order that follows where the keys are stored.

So the compiler keeps each layer's `ai.mxspd::Attention` node (kernels/attention.cc: exact sums over
the visible keys, in any order) and turns every MatMul by a constant float32 weight into
`ai.mxspd::RowMatMul` (kernels/row_matmul.cc: one fixed fma chain per element), its weight packed
in panels here, at build time. MXFP6 weights already run through kernels that are row-invariant
(`MXMatMul`; MatMulNBits, measured). Without the kernel library (or off the CPU target), the
attention function is inlined instead and the artifact records that it is not batch-invariant.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, inliner, numpy_helper
from onnx.reference import ReferenceEvaluator

from kernels import ATTENTION, ATTENTION_HALF_KV, DOMAIN, ROTARY_ATTENTION, ROTARY_ATTENTION_HALF_KV, ROW_MATMUL
from kernels.layout import pack_panels

Store = Callable[[onnx.TensorProto], onnx.TensorProto]  # a new initializer -> what the graph keeps
Read = Callable[[onnx.TensorProto], bytes]  # an initializer -> its bytes
PANELS_SUFFIX = ".panels"  # RowMatMul's weight input: <weight>.panels
FLOAT_MATMULS = ("MatMul", "FusedMatMul", "Gemm")  # what must not read a constant weight once invariant


class InvarianceError(RuntimeError):
    """A graph that the batch-invariant pass cannot make (or keep) invariant."""


def inline_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """The fallback: ai.mxspd::Attention replaced by its function body (standard ONNX ops)."""
    return inliner.inline_local_functions(model)


def initializer_array(t: onnx.TensorProto, read: Read) -> np.ndarray:
    return numpy_helper.to_array(onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, raw_data=read(t)))


def constant_value(name: str, model: onnx.ModelProto, read: Read) -> np.ndarray | None:
    """The value of tensor `name` if it is computed from initializers only (None otherwise): an
    initializer, or the constant subgraph before it (a float16 Cast, the exact MX unpacking)."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    needed: set[int] = set()
    leaves: set[str] = set()
    pending = [name]
    while pending:
        t = pending.pop()
        if t in inits:
            leaves.add(t)
        elif t in producers:
            if id(producers[t]) not in needed:
                needed.add(id(producers[t]))
                pending += [i for i in producers[t].input if i]
        else:
            return None  # a graph input: not constant
    if name in inits:
        return initializer_array(inits[name], read)
    sub = helper.make_graph(
        [n for n in graph.node if id(n) in needed], "constant",  # in the graph's (topological) order
        [helper.make_tensor_value_info(t, inits[t].data_type, list(inits[t].dims)) for t in sorted(leaves)],
        [helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None)])
    evaluator = ReferenceEvaluator(helper.make_model(sub, opset_imports=list(model.opset_import)))
    return evaluator.run(None, {t: initializer_array(inits[t], read) for t in leaves})[0]


def drop_dead(graph: onnx.GraphProto) -> None:
    """Remove nodes whose outputs nothing reads, then initializers nothing reads."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if not any(o in read for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    read = {i for n in graph.node for i in n.input} | outputs
    keep = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def make_invariant(model: onnx.ModelProto, read: Read = lambda t: t.raw_data, store: Store = lambda t: t) -> int:
    """Keep the attention nodes for the kernel and turn constant-weight MatMuls into RowMatMul (in place);
    returns how many MatMuls were turned. One weight in memory at a time, as compiler.mx_lowering."""
    graph = model.graph
    kept = [f for f in model.functions if not (f.domain == DOMAIN and f.name == ATTENTION)]
    del model.functions[:]
    model.functions.extend(kept)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    packed: dict[str, tuple[str, int]] = {}
    turned = 0
    for node in graph.node:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        w = node.input[1]
        if w not in packed:
            value = constant_value(w, model, read)
            if value is None or value.ndim != 2:
                continue  # activations (or a batched constant): not a weight
            init = numpy_helper.from_array(pack_panels(value.astype(np.float32)), w + PANELS_SUFFIX)
            graph.initializer.append(store(init))
            packed[w] = (init.name, value.shape[1])
        node.op_type, node.domain = ROW_MATMUL, DOMAIN
        node.input[1] = packed[w][0]
        node.attribute.append(helper.make_attribute("N", packed[w][1]))
        turned += 1
    drop_dead(graph)
    return turned


def check_invariant(model: onnx.ModelProto, name: str) -> None:
    """After ONNX Runtime's optimisation: attention still runs in the kernel, no float matmul reads a weight."""
    inits = {t.name for t in model.graph.initializer}
    kernels = (ATTENTION, ROTARY_ATTENTION, ATTENTION_HALF_KV, ROTARY_ATTENTION_HALF_KV)
    attention = [n for n in model.graph.node if n.op_type in kernels and n.domain == DOMAIN]
    broken = [n.name or n.op_type for n in model.graph.node
              if (n.op_type in FLOAT_MATMULS and len(n.input) > 1 and n.input[1] in inits) or n.op_type == "Softmax"]
    if not attention or broken:
        raise InvarianceError(f"graph {name!r} is not batch-invariant after optimisation: "
                              f"{len(attention)} attention kernels, float ops {broken[:3]}")
