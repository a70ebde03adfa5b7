"""Lowers standard MX weights (FLOAT6 or FLOAT4 DequantizeLinear with E8M0 scales) to what ONNX Runtime runs.

ONNX Runtime rejects FLOAT6, FLOAT4 and E8M0, and a dequantization evaluated at every step is far too slow.
The exact lowering keeps the codes packed 6-bit on disk (6.25 bits per element with the scale byte)
and puts a small unpacking subgraph in front of them, made only of constants, which ONNX Runtime's
constant folding evaluates once when a session loads (the compiler turns folding off while it
optimises, so the artifact stays small); the kernel lowerings store what their kernel reads. Then:

- `fused` (E2M3 and E2M1): every E2M3 value is a multiple of 1/8 in [-7.5, 7.5] (E2M1: of 1/2 in
  [-6, 6]), so a block is exactly an int8 block (8 * value, or 2 * value, stored with zero point 128)
  with scale 2^(e-127) / 8 (or / 2): the MatMul becomes
  `com.microsoft.MatMulNBits(bits=8, block_size=32)` and dequantization happens inside the kernel.
  accuracy_level 4 lets the kernel quantize each 32-element block of activations to int8 (the fast
  path on CPU); weights stay exact, activations lose up to half an int8 step per block.
- `exact`: the unpacking yields the float32 weights themselves, exactly the MX values, and the
  MatMul is left alone.
- `native` / `native8` (E2M3 and E2M1): the MatMul becomes mxspd's own `ai.mxspd::MXMatMul`
  (kernels/mx_matmul.cc), which keeps the weights 6-bit in memory (6.25 bits per weight read per
  token, against MatMulNBits' 9; in the layout the build machine's library decodes fastest,
  kernels.preferred_mx_layout) and rounds activations per block to int16 (`native`: within
  1/65534 of the block's largest, closer than float16) or int8 (`native8`, as `fused`). MXFP4 weights
  (4.25 bits per weight in memory, weight_bits 4) always take int8 activations: their own rounding is
  ~30x coarser than int8's, and the kernel multiplies bytes (kernels/mx_matmul.cc). Every row
  is computed alike whatever the call's rows. Needs the kernel library built at install
  (kernels.library_path()); the compiler falls back to `fused` with a warning without it.

MXINT8 weights (a recipe's `mx_int8`: INT8 codes whose stored exponent already holds the 2^-6) take
every lowering too: exact (Cast and scale), fused (MatMulNBits, codes + 128) and native (MXMatMul
with weight_bits = 8: 32 code bytes and one exponent byte per 32 weights, 8.25 bits).

gpu (what native and native8 become for the ort-cuda target): ai.mxspd::MXMatMulGPU, mxspd's CUDA
kernel (kernels/cuda/), which reads MXFP6 at 6.25 bits per weight (MXINT8 at 8.25) in the per-column
layout its warps read (kernels/mx_gpu_layout.h), with float16 activations. The CPU library holds its
reference kernel, so the build's CPU-side optimiser and the tests can run the graph.

An MXINT8 embedding table (`mx_embedding`: [V, K] blocked along K, read by a Gather of token ids) is
lowered alike in every lowering: the Gather picks the rows' int8 codes and exponent bytes, and only
those rows are dequantized (a Cast, the scale table, a Mul), so the artifact never holds the table in
float32 (_lower_gathered).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from common.graph_io import MX_BASE_OPSET_KEY as BASE_OPSET_KEY
from common.graph_io import MX_BLOCK as BLOCK
from common.onnx_store import rewrite_graph, set_default_opset
from common.recipe import MX_LOWERINGS
from kernels import DOMAIN as NATIVE_DOMAIN
from kernels import GPU_LOWERING, MX_MATMUL, MX_MATMUL_GPU, NATIVE_LOWERINGS, preferred_mx_layout
from kernels.layout import (
    PLANES8,
    pack_columns,
    pack_fp4_columns,
    pack_gpu,
    pack_gpu_scales,
    pack_int8_columns,
    pack_scales,
)
from quant import element_values, pack_fp6, unpack_fp4, unpack_fp6

NATIVE_ACTIVATION_BITS = dict(zip(NATIVE_LOWERINGS, (16, 8), strict=True))
LOWERINGS = (*MX_LOWERINGS, GPU_LOWERING)
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations per block (levels 0-3 take a ~40x slower path here)
MX_TYPES = {onnx.TensorProto.FLOAT6E2M3: "fp6_e2m3", onnx.TensorProto.FLOAT6E3M2: "fp6_e3m2",
            onnx.TensorProto.FLOAT4E2M1: "fp4_e2m1",
            onnx.TensorProto.INT8: "int8"}  # DequantizeLinear data types with E8M0 scales: the MX weights
# The formats whose values are integers times one power of two per block (fused, native), and that
# integer step: value * step is an int8 (MXINT8's stored exponent already holds its 2^-6).
INTEGER_STEPS = {"fp6_e2m3": 8, "fp4_e2m1": 2, "int8": 1}
WEIGHT_BITS = {"fp6_e2m3": 6, "fp4_e2m1": 4, "int8": 8}  # MXMatMul's attribute weight_bits per format
MS_DOMAIN = "com.microsoft"
FUSED_SUFFIX = ".int8"  # the fused kernel's weight input: <weight>.int8
NATIVE_SUFFIX = ".mx6"  # the native kernel's weight input: <weight>.mx6 (and its scales <weight>.e8m0)
NATIVE_SCALE_SUFFIX = ".e8m0"
GPU_SUFFIX = ".mxgpu"  # the GPU kernel's weight input: <weight>.mxgpu (and its scales <weight>.e8m0gpu)
# The op each kernel lowering turns a MatMul into, and the suffix of its weight input.
KERNEL_OPS = {"fused": (MS_DOMAIN, "MatMulNBits", FUSED_SUFFIX),
              GPU_LOWERING: (NATIVE_DOMAIN, MX_MATMUL_GPU, GPU_SUFFIX)} | {
    name: (NATIVE_DOMAIN, MX_MATMUL, NATIVE_SUFFIX) for name in NATIVE_ACTIVATION_BITS}
_SHIFTS = np.array([1, 64, 64**2, 64**3], dtype=np.int32)  # 4 codes of a 24-bit group, LSB first
_BYTE_WEIGHTS = np.array([1, 256, 65536], dtype=np.int32)


class LoweringError(ValueError):
    """An MX graph that the requested lowering cannot represent exactly."""


Store = Callable[[onnx.TensorProto], onnx.TensorProto]  # a new initializer -> what the graph keeps
Read = Callable[[onnx.TensorProto], bytes]  # an initializer -> its bytes


Memo = dict[tuple, onnx.TensorProto]  # (weight's source, constant's name) -> the stored constant


class _Builder:
    """Adds constant tensors and nodes to a graph, with names unique to one weight.

    With a `memo` shared by the graphs of one model, a weight's constants are computed and stored
    once (its `source` names where the MX weight's bytes came from), and later graphs take the
    stored tensor: the lowering of a 7B model's weights is then done once, not once per graph."""

    def __init__(self, graph: onnx.GraphProto, store: Store, memo: Memo | None = None) -> None:
        self.graph, self.store, self.memo = graph, store, memo
        self.nodes: list[onnx.NodeProto] = []
        self.shared: set[str] = set()
        self.source: tuple | None = None  # set per weight by lower_model; None: nothing memoised

    def const(self, name: str, array: np.ndarray | Callable[[], np.ndarray]) -> str:
        """`array` may be a function that computes it, called only if no memoised copy is there."""
        if name not in self.shared:
            key = (self.source, name)
            stored = self.memo.get(key) if self.memo is not None and self.source else None
            if stored is None:
                value = array() if callable(array) else array
                stored = self.store(numpy_helper.from_array(np.ascontiguousarray(value), name))
                if self.memo is not None and self.source:
                    self.memo[key] = stored
            self.graph.initializer.append(stored)  # a copy: the memo's message stays as it was
            self.shared.add(name)
        return name

    def node(self, op: str, inputs: list[str], output: str, domain: str = "", **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, domain=domain, **attrs))
        return output


def _unpack(b: _Builder, prefix: str, codes: np.ndarray, table: np.ndarray, table_name: str, shape: list[int]) -> str:
    """Store `codes` packed 6-bit; emit the subgraph that unpacks them and maps each through `table`.

    Callers pad K to whole blocks of 32, so the codes fill whole 3-byte groups (4 codes each).
    """
    assert codes.size % 4 == 0
    packed = pack_fp6(codes).reshape(-1, 3)
    stored = b.const(prefix + ".packed6", packed)
    wide = b.node("Cast", [stored], prefix + ".i32", to=onnx.TensorProto.INT32)
    weights = b.const("mx.byte_weights", _BYTE_WEIGHTS)
    group = b.node("ReduceSum", [b.node("Mul", [wide, weights], prefix + ".bytes"), b.const("mx.axis1", np.array([1]))],
                   prefix + ".group", keepdims=1)
    shifted = b.node("Div", [group, b.const("mx.shifts", _SHIFTS)], prefix + ".shifted")
    code = b.node("Mod", [shifted, b.const("mx.code_span", np.array(64, dtype=np.int32))], prefix + ".code4")
    flat = b.node("Reshape", [code, b.const("mx.flat", np.array([-1]))], prefix + ".flat")
    values = b.node("Gather", [b.const(table_name, table), flat], prefix + ".values")
    return b.node("Reshape", [values, b.const(prefix + ".shape", np.array(shape))], prefix + ".unpacked")


def _scale_table(divisor: float) -> np.ndarray:
    """float32 2^(e-127) / divisor for every E8M0 byte e (255 is NaN)."""
    table = np.ldexp(1.0 / divisor, np.arange(256) - 127)  # float64: 2^128 / divisor fits before NaN replaces it
    table[255] = np.nan
    return table.astype(np.float32)


def _scales(b: _Builder, prefix: str, exponents: str, divisor: float) -> str:
    """E8M0 bytes (a uint8 tensor) to float32 2^(e-127) / divisor through a 256-entry table."""
    idx = b.node("Cast", [exponents], prefix + ".e8m0_i32", to=onnx.TensorProto.INT32)
    return b.node("Gather", [b.const(f"mx.scale_table_{int(divisor)}", _scale_table(divisor)), idx], prefix + ".scale")


def _lower_exact(b: _Builder, name: str, fmt: str, codes: np.ndarray, exps: np.ndarray) -> None:
    k, n = codes.shape
    kb = exps.shape[0]
    padded = np.zeros((kb * BLOCK, n), dtype=codes.dtype)
    padded[:k] = codes
    if fmt == "int8":  # the stored exponent holds MXINT8's 2^-6: value = code * scale
        stored = b.const(name + ".int8", padded.reshape(kb, BLOCK, n))
        values = b.node("Cast", [stored], name + ".unpacked", to=onnx.TensorProto.FLOAT)
    else:
        values = _unpack(b, name, padded, element_values(fmt), f"mx.values_{fmt}", [kb, BLOCK, n])
    scale = b.node("Reshape", [_scales(b, name, b.const(name + ".e8m0", exps), 1.0),
                               b.const(name + ".scale_shape", np.array([kb, 1, n]))], name + ".scale3")
    w = b.node("Mul", [values, scale], name + ".blocks")
    if kb * BLOCK == k:
        b.node("Reshape", [w, b.const(name + ".kn", np.array([k, n]))], name)
    else:
        full = b.node("Reshape", [w, b.const(name + ".kn", np.array([kb * BLOCK, n]))], name + ".padded")
        b.node("Slice", [full, b.const("mx.zero", np.array([0])), b.const(name + ".k", np.array([k]))], name)


def _lower_gathered(b: _Builder, name: str, load: Callable[[], tuple[np.ndarray, np.ndarray]],
                    gathers: list[onnx.NodeProto]) -> None:
    """An MXINT8 embedding table [V, K] read by Gathers of token ids, in any lowering: each Gather picks
    its rows' int8 codes and E8M0 bytes, and only those are dequantized (a decode step reads one row;
    folding the whole table to float32 would put it back at 4 bytes per weight)."""
    codes, exps = load()
    v, k = codes.shape
    kb = exps.shape[1]
    padded = np.zeros((v, kb * BLOCK), dtype=np.int8)
    padded[:, :k] = codes
    rows = b.const(name + ".rows_int8", padded.reshape(v, kb, BLOCK))
    row_exps = b.const(name + ".rows_e8m0", exps)
    for g in gathers:
        out, ids = g.output[0], g.input[1]
        values = b.node("Cast", [b.node("Gather", [rows, ids], out + ".codes")], out + ".values",
                        to=onnx.TensorProto.FLOAT)
        scale = _scales(b, out, b.node("Gather", [row_exps, ids], out + ".e8m0"), 1.0)
        blocks = b.node("Mul", [values, b.node("Unsqueeze", [scale, b.const("mx.last_axis", np.array([-1]))],
                                               out + ".scale1")], out + ".blocks")
        shape = b.node("Concat", [b.node("Shape", [ids], out + ".ids_shape"), b.const(name + ".k_padded",
                                                                                       np.array([kb * BLOCK]))],
                       out + ".shape", axis=0)
        flat = b.node("Reshape", [blocks, shape], out if kb * BLOCK == k else out + ".padded")
        if kb * BLOCK != k:
            b.node("Slice", [flat, b.const("mx.zero", np.array([0])), b.const(name + ".k", np.array([k])),
                             b.const("mx.last_axis", np.array([-1]))], out)


def _need_integers(name: str, fmt: str, lowering: str) -> None:
    if fmt not in INTEGER_STEPS:
        raise LoweringError(
            f"weight {name!r}: the {lowering} lowering needs fp6_e2m3 or fp4_e2m1 ({fmt} values are not int8 "
            "multiples of one power of two: 16 * 28 = 448); use mx_lowering = 'exact'"
        )


def _lower_native(b: _Builder, name: str, fmt: str, k: int, n: int, load: Callable[[], tuple[np.ndarray, np.ndarray]],
                  matmuls: list, activation_bits: int, layout: int) -> None:
    """MatMul -> ai.mxspd::MXMatMul(A, codes and E8M0 bytes in the kernel's layout, kernels/layout.py;
    MXFP6 in `layout`, the one this machine's library multiplies fastest; MXFP4 in its one layout, with
    int8 activations). `load()`: the [K, N] codes and the E8M0 bytes."""
    _need_integers(name, fmt, "native")  # either native lowering: the same weights, other activation bits
    pack = {"int8": pack_int8_columns, "fp4_e2m1": pack_fp4_columns}.get(fmt, lambda c: pack_columns(c, layout))
    weights = b.const(name + NATIVE_SUFFIX, lambda: pack(load()[0]))
    scales = b.const(name + NATIVE_SCALE_SUFFIX, lambda: pack_scales(load()[1]))
    fp4 = fmt == "fp4_e2m1"
    for mm in matmuls:
        mm.op_type, mm.domain = MX_MATMUL, NATIVE_DOMAIN
        mm.input[:] = [mm.input[0], weights, scales]
        mm.attribute.extend([helper.make_attribute("K", k), helper.make_attribute("N", n),
                             helper.make_attribute("activation_bits", 8 if fp4 else activation_bits),
                             helper.make_attribute("weight_bits", WEIGHT_BITS[fmt])])
        if fmt != "int8":
            mm.attribute.append(helper.make_attribute("layout", PLANES8 if fp4 else layout))


def _lower_gpu(b: _Builder, name: str, fmt: str, k: int, n: int, load: Callable[[], tuple[np.ndarray, np.ndarray]],
               matmuls: list) -> None:
    """MatMul -> ai.mxspd::MXMatMulGPU(A, codes and E8M0 bytes column by column, kernels/layout.pack_gpu)."""
    if fmt not in ("fp6_e2m3", "int8"):
        raise LoweringError(f"weight {name!r}: the {GPU_LOWERING} lowering (the ort-cuda target's kernel) reads "
                            f"fp6_e2m3 and MXINT8 only, not {fmt}; use mx_lowering = 'exact'")
    wbits = WEIGHT_BITS[fmt]
    weights = b.const(name + GPU_SUFFIX, lambda: pack_gpu(load()[0], wbits))
    scales = b.const(name + ".e8m0gpu", lambda: pack_gpu_scales(load()[1]))
    for mm in matmuls:
        mm.op_type, mm.domain = MX_MATMUL_GPU, NATIVE_DOMAIN
        mm.input[:] = [mm.input[0], weights, scales]
        mm.attribute.extend([helper.make_attribute("K", k), helper.make_attribute("N", n),
                             helper.make_attribute("weight_bits", wbits)])


def _by_column(fmt: str, codes: np.ndarray, kb: int) -> np.ndarray:
    """MatMulNBits' 8-bit weights: per output column, K in blocks, zero point 128."""
    k, n = codes.shape
    by_column = np.full((n, kb * BLOCK), 128, dtype=np.uint8)
    if fmt == "int8":  # the codes themselves, with zero point 128 (the default for bits = 8)
        by_column[:, :k] = (codes.T.astype(np.int16) + 128).astype(np.uint8)
    else:
        as_int8 = np.round(element_values(fmt) * INTEGER_STEPS[fmt]).astype(np.int32)  # exact: integer steps
        by_column[:, :k] = (as_int8 + 128).astype(np.uint8)[codes.T]
    return by_column.reshape(n, kb, BLOCK)


def _lower_fused(b: _Builder, name: str, fmt: str, k: int, n: int, kb: int,
                 load: Callable[[], tuple[np.ndarray, np.ndarray]], matmuls: list) -> None:
    """Computed here, tensor by tensor, not as a subgraph for ONNX Runtime to fold: folding every
    weight's unpacking at once held about 17 bytes per weight (5.6 GB for a 325M model)."""
    _need_integers(name, fmt, "fused")
    weights = b.const(name + FUSED_SUFFIX, lambda: _by_column(fmt, load()[0], kb))
    scales = b.const(name + ".scale", lambda: _scale_table(INTEGER_STEPS[fmt])[load()[1].T.reshape(-1)])
    for mm in matmuls:
        mm.op_type, mm.domain = "MatMulNBits", MS_DOMAIN
        mm.input[:] = [mm.input[0], weights, scales]
        mm.attribute.extend([
            helper.make_attribute("K", k), helper.make_attribute("N", n), helper.make_attribute("bits", 8),
            helper.make_attribute("block_size", BLOCK), helper.make_attribute("accuracy_level", ACCURACY_LEVEL),
        ])


def _source(t: onnx.TensorProto) -> tuple | None:
    """Where an external tensor's bytes are (file, offset, length): the same place, the same bytes."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return tuple(sorted((e.key, e.value) for e in t.external_data))


def lower_model(model: onnx.ModelProto, lowering: str, read: Read = lambda t: t.raw_data,
                store: Store = lambda t: t, memo: Memo | None = None) -> dict[str, str]:
    """Replace every MX DequantizeLinear in `model` (in place); returns {weight name: format} of the
    matmul weights (an MXINT8 embedding table is lowered too, by _lower_gathered, but not listed).

    One weight at a time: `read` gives an MX initializer's bytes (the graph may be loaded without
    its external data) and `store` receives each new initializer as soon as it is made (for
    example to write it to a weights file and keep only a pointer), so memory holds one weight.
    `memo`: shared by the graphs of one model (whose external weights are read from one place), so
    that a weight lowered for one graph is not computed again for the next (fused and native).
    """
    if lowering not in LOWERINGS:
        raise ValueError(f"unknown MX lowering {lowering!r}; choose one of {LOWERINGS}")
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    b = _Builder(graph, store, memo)
    lowered: dict[str, str] = {}
    tables: list[str] = []  # embedding tables, gathered then dequantized: no kernel reads them
    dropped: set[str] = set()
    for node in list(graph.node):
        if node.op_type != "DequantizeLinear" or inits.get(node.input[0]) is None:
            continue
        data, scale = inits[node.input[0]], inits[node.input[1]]
        if data.data_type not in MX_TYPES or scale.data_type != onnx.TensorProto.FLOAT8E8M0:
            continue
        fmt = MX_TYPES[data.data_type]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        w = node.output[0]
        users = consumers.get(w, [])
        table = attrs.get("axis") == 1 and fmt == "int8" and bool(users) and all(
            u.op_type == "Gather" and u.input[0] == w and _gather_axis(u) == 0 for u in users)
        if attrs.get("axis") != (1 if table else 0) or attrs.get("block_size") != BLOCK or len(data.dims) != 2:
            raise LoweringError(f"{node.name}: only [K, N] weights blocked by {BLOCK} along K (axis 0), and MXINT8 "
                                "tables [V, K] blocked along K (axis 1) that Gathers read, are lowered")
        k, n = data.dims
        load = functools.cache(lambda data=data, scale=scale, fmt=fmt, k=k, n=n: _codes(read, data, scale, fmt, k, n))
        where = (_source(data), _source(scale))
        if table:
            b.source = ("gathered", *where) if None not in where else None
            _lower_gathered(b, w, load, users)
            for u in users:
                graph.node.remove(u)
            tables.append(w)
        elif lowering == "exact":
            b.source = None
            _lower_exact(b, w, fmt, *load())
        else:
            if not users or any(u.op_type != "MatMul" or u.input[1] != w for u in users):
                raise LoweringError(f"weight {w!r}: the {lowering} lowering needs it to feed MatMul weights only")
            layout = (preferred_mx_layout(activation_bits=NATIVE_ACTIVATION_BITS[lowering])
                      if lowering in NATIVE_ACTIVATION_BITS else None)
            b.source = ((lowering, layout, fmt, data.data_type, tuple(data.dims), tuple(scale.dims), *where)
                        if None not in where else None)
            if lowering == "fused":
                _lower_fused(b, w, fmt, k, n, scale.dims[0], load, users)
            elif lowering == GPU_LOWERING:
                _lower_gpu(b, w, fmt, k, n, load, users)
            else:
                _lower_native(b, w, fmt, k, n, load, users, NATIVE_ACTIVATION_BITS[lowering], layout)
        graph.node.remove(node)
        dropped |= {data.name, scale.name}
        if not table:
            lowered[w] = fmt
    if not lowered and not tables:
        return lowered
    rewrite_graph(graph, [t for t in graph.initializer if t.name not in dropped], b.nodes)
    _restore_opset(model, KERNEL_OPS[lowering][0] if lowering in KERNEL_OPS else None)
    return lowered


def _gather_axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _codes(read: Read, data: onnx.TensorProto, scale: onnx.TensorProto, fmt: str, k: int, n: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """A weight's [K, N] codes and its E8M0 exponent bytes, from its MX initializers."""
    raw = np.frombuffer(read(data), dtype=np.uint8)
    unpack = {"int8": lambda r, _: r.view(np.int8), "fp4_e2m1": unpack_fp4}.get(fmt, unpack_fp6)
    codes = unpack(raw, k * n).reshape(k, n)
    return codes, np.frombuffer(read(scale), dtype=np.uint8).reshape(tuple(scale.dims))


def _restore_opset(model: onnx.ModelProto, domain: str | None) -> None:
    """The MX ops are gone: go back to the opset the model had before the quant pass."""
    props = {p.key: p.value for p in model.metadata_props}
    if BASE_OPSET_KEY not in props:
        raise LoweringError(f"the MX graph does not record its opset before the quant pass ({BASE_OPSET_KEY})")
    base = int(props[BASE_OPSET_KEY])
    if base < 13:  # the unpacking uses ReduceSum with axes as an input
        raise LoweringError(f"MX lowering needs opset >= 13, the graph has {base}")
    set_default_opset(model, base)
    if domain and not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))
