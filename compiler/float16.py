"""Float16 compute for the GPU target (ort-cuda): the article's FP16 baseline, and half the KV cache.

Runs on each graph after ONNX Runtime's provider-independent optimisation (constants folded in
float32, as on the CPU target), with the graph loaded without its weights: they are converted one
at a time into a new weights file, so memory holds one tensor (a 7B graph's 27 GB never is). The
logits stay
float32 (sampling and acceptance read them on the host); the KV cache inputs and outputs become
float16, so the runtime allocates its device cache in the graphs' own type (ModelDims.kv_dtype).
RMSNorm's statistic (Pow, ReduceMean, Add eps, Sqrt, Div) stays float32: a residual stream's
outlier of 256 or more squares past float16's range, and the norm would then return zeros.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnxruntime.transformers.float16 import convert_float_to_float16

from common import graph_io
from common.onnx_store import SharedFile, read_tensor, save_graph

KV_DTYPE = "float16"
FLOAT16_TINY, FLOAT16_MAX = 5.96e-08, 65504.0  # as ONNX Runtime's conversion clamps (convert_np_to_float16)


def float16_values(x: np.ndarray) -> np.ndarray:
    """float32 -> float16 as ONNX Runtime's `convert_np_to_float16` does it (bit for bit: nonzero
    magnitudes below float16's smallest clamped up to it, finite ones above its largest down to it,
    signs, zeros, infinities and NaN kept), without its twelve passes over the data: a 7B graph's
    weights are converted once per graph, and that was half of each graph's build time. A plain cast
    differs from the clamping only where it gives 0 for a nonzero value or infinity for a finite
    one, so only those few are recomputed."""
    with np.errstate(over="ignore"):  # overflows are what the clamping below redoes
        y = x.astype(np.float16, order="C")  # C order: the fixes below write through a flat view
    magnitude = y.view(np.uint16) & 0x7FFF  # float16's bits: zero is 0, infinity 0x7C00 (integer compares)
    fix = np.flatnonzero((magnitude == 0) | (magnitude == 0x7C00))
    if fix.size:
        v = x.reshape(-1)[fix]
        mag = np.abs(v)
        v = np.where((mag > 0) & (mag < FLOAT16_TINY), np.copysign(np.float32(FLOAT16_TINY), v), v)
        v = np.where((mag > FLOAT16_MAX) & (mag < np.inf), np.copysign(np.float32(FLOAT16_MAX), v), v)
        y.reshape(-1)[fix] = v.astype(np.float16)
    return y


def norm_statistics(graph: onnx.GraphProto) -> list[list[onnx.NodeProto]]:
    """Each RMSNorm's x -> x / sqrt(mean(x^2) + eps) as its nodes: Pow, ReduceMean, then the
    single-consumer chain (Add, Sqrt, Div) whose output the norm's weight multiplies."""
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    chains = []
    for n in graph.node:
        source = producer.get(n.input[0]) if n.op_type == "ReduceMean" else None
        if source is None or source.op_type != "Pow":
            continue
        chain = [source, n]
        while len(nxt := consumers.get(chain[-1].output[0], [])) == 1 and nxt[0].op_type in ("Add", "Sqrt", "Div"):
            chain.append(nxt[0])
        chains.append(chain)
    return chains


def _keep_float32(graph: onnx.GraphProto, chains: list[list[str]], constants: dict[str, onnx.TensorProto]) -> None:
    """Run converted chains (node names) in float32 again: their float32 constants back, one Cast in
    per float16 tensor a chain reads (x, read by Pow and Div) before its first node, and a Cast out
    after its last, in graph order; the float16 constants no node reads any more go."""
    before: dict[str, list[onnx.NodeProto]] = {}
    after: dict[str, onnx.NodeProto] = {}
    by_name = {n.name: n for n in graph.node}
    initializers = {t.name for t in graph.initializer}
    for names in chains:
        chain = [by_name[name] for name in names]
        inside = {o for n in chain for o in n.output}
        for n in chain:
            for i, name in enumerate(n.input):
                if name in inside or name in initializers and name not in constants:  # ReduceMean's axes
                    continue
                if name in constants:
                    n.input[i] = f"{name}.{n.name}.fp32"
                    own = _copied(constants[name])
                    own.name = n.input[i]
                    graph.initializer.append(own)
                    continue
                n.input[i] = cast = f"{name}.{chain[0].name}.fp32"  # float16 from outside the chain: x
                casts = before.setdefault(chain[0].name, [])
                if all(c.output[0] != cast for c in casts):
                    casts.append(helper.make_node("Cast", [name], [cast], name=f"{cast}.cast", to=TensorProto.FLOAT))
        last = chain[-1]
        out = last.output[0]
        last.output[0] = f"{out}.fp32"
        after[last.name] = helper.make_node("Cast", [last.output[0]], [out], name=f"{out}.cast", to=TensorProto.FLOAT16)
    nodes = list(graph.node)
    del graph.node[:]
    for n in nodes:
        graph.node.extend([*before.get(n.name, []), n, *([after[n.name]] if n.name in after else [])])
    read = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def to_float16(path: Path) -> Path:
    """Rewrite the graph at `path` (its weights in `<stem>.bin` beside it) to compute in float16."""
    model = onnx.load(str(path), load_external_data=False)
    for i, n in enumerate(model.graph.node):  # the chains are kept by node name
        n.name = n.name or f"{n.op_type}_{i}"
    chains = norm_statistics(model.graph)
    floats = {t.name: t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    external = {t.name for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    constants = {i: _copied(floats[i]) for chain in chains for n in chain for i in n.input
                 if i in floats and i not in external}
    names = [[n.name for n in chain] for chain in chains]
    retyped = external & set(floats)
    weights = _as_inputs(model.graph, retyped)  # so that the conversion retypes them without reading them
    model = convert_float_to_float16(model, keep_io_types=[graph_io.LOGITS], disable_shape_infer=True)
    inputs = [i for i in model.graph.input if i.name not in retyped]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    for t in weights:
        t.data_type = TensorProto.FLOAT16
    model.graph.initializer.extend(weights)
    _keep_float32(model.graph, names, constants)
    del model.graph.value_info[:]  # float16 now where the chains are float32 again: ONNX Runtime infers them
    _convert_weights(model.graph, external, retyped, path.parent / f"{path.stem}.bin")
    return save_graph(model, path)


def _as_inputs(graph: onnx.GraphProto, names: set[str]) -> list[onnx.TensorProto]:
    """Take these initializers out of the graph, declared as float32 inputs in their place; returns them."""
    taken = [t for t in graph.initializer if t.name in names]
    kept = [t for t in graph.initializer if t.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(helper.make_tensor_value_info(t.name, TensorProto.FLOAT, t.dims) for t in taken)
    return taken


def _convert_weights(graph: onnx.GraphProto, external: set[str], retyped: set[str], data: Path) -> None:
    """Write the external weights again into `data`, one at a time, the `retyped` ones converted from
    float32 to float16 (clamped to its range, as the conversion does inline tensors)."""
    converted = data.with_suffix(".float16")
    with open(converted, "wb") as f:
        out = SharedFile(f, data.name)
        for t in graph.initializer:
            if t.name not in external:
                continue
            raw = read_tensor(t, data.parent)
            if t.name in retyped:
                raw = float16_values(np.frombuffer(raw, np.float32)).tobytes()
            t.CopyFrom(out.external(onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, raw_data=raw)))
    os.replace(converted, data)


def _copied(t: onnx.TensorProto) -> onnx.TensorProto:
    copy = onnx.TensorProto()
    copy.CopyFrom(t)
    return copy
