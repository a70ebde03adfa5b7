"""The weight passes: decoder linear weights become standard ONNX MX blocks; float16 storage.

Each selected MatMul weight W[K, N] (`layers.<i>.<...>.weight.T`, CodeGen's `h.<i>.<...>`; the LM
head on request) is
replaced by FLOAT6 codes [K, N] (packed 4 in 3 bytes), FLOAT8E8M0 scales [ceil(K/32), N] and a
`DequantizeLinear(axis=0, block_size=32)` whose output keeps the weight's name, so the graph's
consumers are untouched. This is the portable form (opset 28): ONNX Runtime cannot run FLOAT6,
so the compiler lowers it per target. Norms stay as they are, and embeddings unless asked (below).

Weights a recipe names as sensitive (`mx_int8`, "lm_head" among them) are MXINT8 instead: INT8
codes k with value k * 2^-6 * 2^(e-127); the graph stores the exponent e - 6 (INT8_EXPONENT_SHIFT)
so that a standard DequantizeLinear (k * scale) gives exactly the MX value.
Those it names in `mx_fp6` are MXFP6 E2M3 (a tier between MXFP4 and MXINT8); MXINT8 wins where both do.

On request (`embedding`), the token embedding table E[V, K] (read by a Gather of the input ids) is
MXINT8 too, blocked along K: INT8 codes [V, K], scales [V, ceil(K/32)], `DequantizeLinear(axis=1)`.
In float32 it is the largest tensor of a small model's artifact (SmolLM2-135M: 113 MB beside 126 MB
of MX weights), and a decode step reads one row of it, so the compiler gathers the row's codes and
dequantizes only them.

A pass works one weight at a time (`store`: the tensors that replace it) and then adds, to each
graph, the nodes that turn the stored tensors back into the weight (`nodes`). The exporter streams
a checkpoint's tensors through the passes into the weights file, so no graph ever holds the whole
model; `apply_passes` runs the same passes over an in-memory graph.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
import onnx
from onnx import helper, numpy_helper

from common.graph_io import MX_BASE_OPSET_KEY as BASE_OPSET_KEY
from common.graph_io import MX_BLOCK as BLOCK
from common.onnx_store import default_opset, embedding_tables, matmul_weights, rewrite_graph, set_default_opset
from common.recipe import MX_FP6 as FP6  # the mx_fp6 tier's format
from quant.error_feedback import feedback_factor, quantize_with_feedback
from quant.mx import quantize
from quant.packing import pack_fp4, pack_fp6

MX_OPSET = 28  # first DequantizeLinear accepting FLOAT6 data with E8M0 scales
CODES_SUFFIX, SCALES_SUFFIX = ".mx_codes", ".mx_scales"
ONNX_TYPES = {"fp6_e2m3": onnx.TensorProto.FLOAT6E2M3, "fp6_e3m2": onnx.TensorProto.FLOAT6E3M2,
              "fp4_e2m1": onnx.TensorProto.FLOAT4E2M1, "int8": onnx.TensorProto.INT8}
INT8_EXPONENT_SHIFT = 6  # MXINT8's element scale 2^-6, folded into the stored E8M0 exponent
DECODER_LINEAR = re.compile(r"^(layers|h)\.\d+\..+\.weight\.T$")  # decoder blocks: Llama family, CodeGen
LM_HEAD = "lm_head.weight.T"


@dataclass(frozen=True)
class QuantSummary:
    """What the pass did, recorded in export.json and the manifest."""

    format: str
    block_size: int
    rounding: str
    scale: str  # how block exponents were chosen (quant.mx.SCALE_CHOICES)
    lm_head: bool  # the LM head is quantized (in `format`, or MXINT8 if `int8` names it)
    embedding: bool  # the token embedding table is MXINT8 (not counted in tensors, elements, bytes)
    int8: tuple[str, ...]  # name fragments of the weights stored MXINT8 instead of `format`
    int8_tensors: int
    fp6: tuple[str, ...]  # name fragments of the weights stored MXFP6 E2M3 instead of `format` (and not MXINT8)
    fp6_tensors: int
    calibration: str  # what the error feedback's input statistics came from ("": rounded to nearest)
    tensors: int
    elements: int
    mx_bytes: int  # packed codes + scales, as stored
    fp16_bytes: int  # the same weights in FP16

    @property
    def ratio_to_fp16(self) -> float:
        return self.mx_bytes / self.fp16_bytes


def selected(name: str, lm_head: bool) -> bool:
    return bool(DECODER_LINEAR.match(name)) or (lm_head and name == LM_HEAD)


def _int8_graph_form(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXINT8 (codes, exponents e) -> (codes, e - 6) for DequantizeLinear. A block whose e < 6 (all of
    its values below 2^-120) cannot store e - 6: its codes are shifted right instead (to zero, in
    practice). NaN (255) stays NaN."""
    e = scales.astype(np.int32)
    shift = np.where(e == 255, 0, np.maximum(INT8_EXPONENT_SHIFT - e, 0))
    stored = np.where(e == 255, 255, e - INT8_EXPONENT_SHIFT + shift).astype(np.uint8)
    if shift.any():
        k = codes.view(np.int8).astype(np.int32)
        codes = np.round(k / np.ldexp(1.0, np.repeat(shift, BLOCK, axis=-1)[..., : k.shape[-1]])).astype(np.int8)
    return codes.view(np.uint8), stored


def embedding_tensors(name: str, table: np.ndarray, rounding: str, scale: str = "spec"
                      ) -> tuple[onnx.TensorProto, onnx.TensorProto]:
    """An embedding table E[V, K] as MXINT8 blocked along K, row by row: (codes [V, K], E8M0 scales
    [V, ceil(K/32)]) in the graph form of _int8_graph_form."""
    v, k = table.shape
    t = quantize(table, "int8", axis=1, block_size=BLOCK, rounding=rounding, name=name, scale=scale)
    codes, scales = _int8_graph_form(t.codes[:, :k], t.scales)
    code_t = helper.make_tensor(name + CODES_SUFFIX, onnx.TensorProto.INT8, [v, k], codes.tobytes(), raw=True)
    scale_t = helper.make_tensor(name + SCALES_SUFFIX, onnx.TensorProto.FLOAT8E8M0, list(scales.shape),
                                 scales.tobytes(), raw=True)
    return code_t, scale_t


def mx_tensors(name: str, w: np.ndarray, fmt: str, rounding: str, scale: str = "spec"
               ) -> tuple[onnx.TensorProto, onnx.TensorProto]:
    """Quantize W[K, N] along K into (codes [K, N], E8M0 scales [ceil(K/32), N]) initializers: FLOAT6
    codes packed 4 in 3 bytes, FLOAT4 codes 2 in a byte, or INT8 codes with the exponents shifted
    (_int8_graph_form)."""
    k, n = w.shape
    t = quantize(w, fmt, axis=0, block_size=BLOCK, rounding=rounding, name=name, scale=scale)
    codes, scales = t.codes, t.scales
    if fmt == "int8":
        codes, scales = _int8_graph_form(codes, scales)
    codes = np.ascontiguousarray(codes[:, :k].T)  # quantize moved K last: back to [K, N]
    # ONNX raw_data holds exactly ceil(6n/8) bytes of FLOAT6, ceil(n/2) of FLOAT4
    data = (codes if fmt == "int8" else pack_fp4(codes) if fmt == "fp4_e2m1"
            else pack_fp6(codes)[: math.ceil(6 * k * n / 8)])
    code_t = helper.make_tensor(name + CODES_SUFFIX, ONNX_TYPES[fmt], [k, n], data.tobytes(), raw=True)
    scale_t = helper.make_tensor(
        name + SCALES_SUFFIX, onnx.TensorProto.FLOAT8E8M0, [scales.shape[1], n],
        np.ascontiguousarray(scales.T).tobytes(), raw=True,
    )
    return code_t, scale_t


class WeightPass(Protocol):
    def store(self, t: onnx.TensorProto, matmul: bool, embedding: bool = False) -> list[onnx.TensorProto]:
        """The tensors stored in place of weight `t` (`matmul`: it is a MatMul's weight input;
        `embedding`: the table a Gather of the input ids reads)."""

    def nodes(self, names: Iterable[str]) -> list[onnx.NodeProto]:
        """For the weights among `names` that this pass replaced, the nodes that rebuild them."""

    def finish(self, model: onnx.ModelProto) -> None:
        """Model-level changes once a graph's nodes are in (opset)."""

    def info(self) -> dict:
        """What the pass did, for export.json."""


class MXPass:
    """Selected MatMul weights -> MX codes, E8M0 scales and a DequantizeLinear named as the weight.

    `int8`: name fragments (e.g. "lm_head", "layers.0.", "down_proj") of the weights stored MXINT8
    instead of `fmt`; "lm_head" also selects the LM head. `fp6`: likewise MXFP6 E2M3, where `int8` does
    not name the weight too. `hessians`, when set: each weight's input
    statistics (export/calibration.py), for rounding with error feedback (quant/error_feedback.py)
    instead of to nearest, each dropped once used; `calibration` says where they came from.
    `embedding`: the token embedding table too, MXINT8 rounded to nearest (it is gathered, not
    multiplied, so error feedback has nothing to compensate with)."""

    def __init__(self, fmt: str = "fp6_e2m3", lm_head: bool = False, rounding: str = "even",
                 scale: str = "spec", int8: tuple[str, ...] = (), embedding: bool = False,
                 fp6: tuple[str, ...] = ()) -> None:
        if fmt not in ONNX_TYPES:
            raise ValueError(f"MX format {fmt!r} has no ONNX graph form; choose one of {sorted(ONNX_TYPES)}")
        self.fmt, self.rounding, self.scale = fmt, rounding, scale
        self.tiers = {"int8": tuple(int8), FP6: tuple(fp6)}  # in precedence order
        self.hessians: dict[str, np.ndarray] | None = None  # set by the exporter where a recipe calibrates
        self.calibration = ""
        self._last: tuple[np.ndarray, tuple[np.ndarray, np.ndarray]] | None = None
        self.lm_head = lm_head or any(f in LM_HEAD for f in int8 + fp6)
        self.embedding = embedding
        self.quantized: dict[str, tuple[str, str]] = {}  # weight -> (codes, scales) names
        self.tables: dict[str, tuple[str, str]] = {}  # embedding tables -> (codes, scales) names
        self.elements = self.stored_bytes = 0
        self.tensors = dict.fromkeys(self.tiers, 0)  # weights stored in each tier
        self.matched: set[tuple[str, str]] = set()  # (tier, fragment) that chose a weight's format

    def format_of(self, name: str) -> str:
        """The MX element format weight `name` is stored in: the first tier that names it, else `fmt`."""
        for tier, fragments in self.tiers.items():
            if hits := {(tier, f) for f in fragments if f in name}:
                self.matched |= hits
                return tier
        return self.fmt

    def store(self, t: onnx.TensorProto, matmul: bool, embedding: bool = False) -> list[onnx.TensorProto]:
        if embedding and self.embedding and not matmul:
            codes, scales = embedding_tensors(t.name, _float_matrix(t), self.rounding, self.scale)
            self.tables[t.name] = (codes.name, scales.name)
            return [codes, scales]
        if not (matmul and selected(t.name, self.lm_head)):
            if matmul and t.name != LM_HEAD and len(t.dims) == 2 and min(t.dims) >= BLOCK:
                # never leave a decoder weight in full precision because its name was not recognised
                raise ValueError(f"MatMul weight {t.name!r} {list(t.dims)} is not a recognised decoder "
                                 "linear or LM head: refusing to leave it unquantized silently")
            return [t]
        w = _float_matrix(t)
        fmt = self.format_of(t.name)
        if self.hessians is not None:
            if t.name not in self.hessians:
                raise ValueError(f"weight {t.name!r} has no calibration statistics: the calibration run saw no "
                                 "input for it")
            order, u = self._factor(self.hessians.pop(t.name))
            w = quantize_with_feedback(w, u, fmt, self.scale, self.rounding, order)
        codes, scales = mx_tensors(t.name, w, fmt, self.rounding, self.scale)
        if fmt in self.tensors:
            self.tensors[fmt] += 1
        self.quantized[t.name] = (codes.name, scales.name)
        self.elements += w.size
        self.stored_bytes += len(codes.raw_data) + len(scales.raw_data)
        return [codes, scales]

    def _factor(self, hessian: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """feedback_factor, once for consecutive weights that read one input (q/k/v, gate/up)."""
        if self._last is None or self._last[0] is not hessian:
            self._last = (hessian, feedback_factor(hessian))
        return self._last[1]

    def nodes(self, names: Iterable[str]) -> list[onnx.NodeProto]:
        return [helper.make_node("DequantizeLinear", list(stored[n]), [n], name=f"mx_dequant/{n}",
                                 axis=axis, block_size=BLOCK, output_dtype=onnx.TensorProto.FLOAT)
                for n in names for stored, axis in ((self.quantized, 0), (self.tables, 1)) if n in stored]

    def finish(self, model: onnx.ModelProto) -> None:
        helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                       BASE_OPSET_KEY: str(default_opset(model))})
        set_default_opset(model, MX_OPSET)

    def summary(self) -> QuantSummary:
        return QuantSummary(self.fmt, BLOCK, self.rounding, self.scale, self.lm_head, bool(self.tables),
                            self.tiers["int8"], self.tensors["int8"], self.tiers[FP6], self.tensors[FP6],
                            self.calibration, len(self.quantized), self.elements, self.stored_bytes, 2 * self.elements)

    def info(self) -> dict:
        """Once every weight has been stored; a mx_int8 or mx_fp6 fragment that chose no weight's format is
        refused (a typo would otherwise leave the tensors it meant in the main format, silently)."""
        if self.embedding and not self.tables:
            raise ValueError("mx_embedding: the graphs read no embedding table (a Gather of the input ids)")
        for tier, fragments in self.tiers.items():
            if unused := [f for f in fragments if (tier, f) not in self.matched]:
                raise ValueError(f"mx_{tier.split('_')[0]} fragment(s) {unused} match no quantized weight"
                                 + (" that mx_int8 does not take" if tier == FP6 else "")
                                 + f" (decoder linears and the LM head, e.g. {sorted(self.quantized)[:3]})")
        s = self.summary()
        return {"quant": asdict(s) | {"ratio_to_fp16": round(s.ratio_to_fp16, 4)}}


def _float_matrix(t: onnx.TensorProto) -> np.ndarray:
    w = numpy_helper.to_array(t)
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"weight {t.name!r}: expected a float32 matrix, got {w.dtype} {w.shape}")
    return w


class Float16Pass:
    """Float32 weight matrices stored as float16, each behind a Cast back to float32.

    The Cast of a constant is folded when a session loads, so this halves the artifact on disk and
    keeps float32 arithmetic (ONNX Runtime's CPU kernels are float32); the weights' values are the
    float16-rounded ones.
    """

    def __init__(self) -> None:
        self.cast: set[str] = set()

    def store(self, t: onnx.TensorProto, matmul: bool, embedding: bool = False) -> list[onnx.TensorProto]:
        if t.data_type != onnx.TensorProto.FLOAT or len(t.dims) != 2:
            return [t]
        full = numpy_helper.to_array(t)
        if np.isnan(full).any():
            raise ValueError(f"weight {t.name!r} contains NaN")
        if np.isinf(full).any():
            raise ValueError(f"weight {t.name!r} contains Inf")
        with np.errstate(over="ignore"):
            half = full.astype(np.float16)
        if not np.isfinite(half).all():
            raise ValueError(f"weight {t.name!r} has values beyond float16's range (65504)")
        self.cast.add(t.name)
        return [numpy_helper.from_array(half, t.name + ".fp16")]

    def nodes(self, names: Iterable[str]) -> list[onnx.NodeProto]:
        return [helper.make_node("Cast", [n + ".fp16"], [n], name=f"fp16/{n}", to=onnx.TensorProto.FLOAT)
                for n in names if n in self.cast]

    def finish(self, model: onnx.ModelProto) -> None:
        pass

    def info(self) -> dict:
        return {"storage_dtype": "float16"}


class PassChain:
    """Passes applied in turn (a later pass sees what an earlier one stored): what the exporter runs."""

    def __init__(self, passes: Sequence[WeightPass] = ()) -> None:
        self.passes = list(passes)

    def store(self, t: onnx.TensorProto, matmul: bool, embedding: bool = False) -> list[onnx.TensorProto]:
        stored = [t]
        for p in self.passes:
            stored = [s for x in stored for s in p.store(x, matmul, embedding)]
        return stored

    def nodes(self, model: onnx.ModelProto, names: list[str]) -> list[onnx.NodeProto]:
        """The rebuilding nodes for the weights `names` of `model`; each pass that adds any finishes it."""
        nodes = []
        for p in self.passes:
            added = p.nodes(names)
            if added:
                p.finish(model)
            nodes += added
        return nodes

    def info(self) -> dict:
        return {k: v for p in self.passes for k, v in p.info().items()}


def apply_passes(model: onnx.ModelProto, passes: Sequence[WeightPass]) -> int:
    """Run `passes` over an in-memory graph's initializers; returns how many weights were replaced."""
    graph, chain = model.graph, PassChain(passes)
    matmul, tables = matmul_weights(graph), embedding_tables(graph)
    names = [t.name for t in graph.initializer]
    stored = [s for t in graph.initializer for s in chain.store(t, t.name in matmul, t.name in tables)]
    nodes = chain.nodes(model, names)
    if nodes:
        rewrite_graph(graph, stored, nodes)
    return len(nodes)


def quantize_model(model: onnx.ModelProto, fmt: str = "fp6_e2m3", lm_head: bool = False,
                   rounding: str = "even") -> int:
    """Quantize an in-memory graph's decoder linear weights (see MXPass); returns how many."""
    return apply_passes(model, [MXPass(fmt, lm_head, rounding)])


def store_float16(model: onnx.ModelProto) -> int:
    """Store an in-memory graph's weight matrices as float16 (see Float16Pass); returns how many."""
    return apply_passes(model, [Float16Pass()])
