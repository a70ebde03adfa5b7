"""The quant pass: decoder linear weights become standard ONNX MX blocks.

Each selected MatMul weight W[K, N] (`layers.<i>.<...>.weight.T`, CodeGen's `h.<i>.<...>`; the LM
head on request) is
replaced by FLOAT6 codes [K, N] (packed 4 in 3 bytes), FLOAT8E8M0 scales [ceil(K/32), N] and a
`DequantizeLinear(axis=0, block_size=32)` whose output keeps the weight's name, so the graph's
consumers are untouched. This is the portable form (opset 28): ONNX Runtime cannot run FLOAT6,
so the compiler lowers it per target. Embeddings and norms stay as they are.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from tqdm import tqdm

from common.graph_io import MX_BASE_OPSET_KEY as BASE_OPSET_KEY
from common.graph_io import MX_BLOCK as BLOCK
from common.onnx_store import load_with_weights, rewrite_graph, save_shared
from quant.mx import quantize
from quant.packing import pack_fp6

MX_OPSET = 28  # first DequantizeLinear accepting FLOAT6 data with E8M0 scales
CODES_SUFFIX, SCALES_SUFFIX = ".mx_codes", ".mx_scales"
ONNX_TYPES = {"fp6_e2m3": onnx.TensorProto.FLOAT6E2M3, "fp6_e3m2": onnx.TensorProto.FLOAT6E3M2}
DECODER_LINEAR = re.compile(r"^(layers|h)\.\d+\..+\.weight\.T$")  # decoder blocks: Llama family, CodeGen
LM_HEAD = "lm_head.weight.T"


@dataclass(frozen=True)
class QuantSummary:
    """What the pass did, recorded in export.json and the manifest."""

    format: str
    block_size: int
    rounding: str
    lm_head: bool
    tensors: int
    elements: int
    mx_bytes: int  # packed codes + scales, as stored
    fp16_bytes: int  # the same weights in FP16

    @property
    def ratio_to_fp16(self) -> float:
        return self.mx_bytes / self.fp16_bytes


def selected(name: str, lm_head: bool) -> bool:
    return bool(DECODER_LINEAR.match(name)) or (lm_head and name == LM_HEAD)


def mx_tensors(name: str, w: np.ndarray, fmt: str, rounding: str) -> tuple[onnx.TensorProto, onnx.TensorProto]:
    """Quantize W[K, N] along K into (FLOAT6 codes [K, N], E8M0 scales [ceil(K/32), N]) initializers."""
    k, n = w.shape
    t = quantize(w, fmt, axis=0, block_size=BLOCK, rounding=rounding, name=name)
    codes = np.ascontiguousarray(t.codes[:, :k].T)  # quantize moved K last: back to [K, N]
    packed = pack_fp6(codes)[: math.ceil(6 * k * n / 8)]  # ONNX raw_data holds exactly ceil(6n/8) bytes
    code_t = helper.make_tensor(name + CODES_SUFFIX, ONNX_TYPES[fmt], [k, n], packed.tobytes(), raw=True)
    scale_t = helper.make_tensor(
        name + SCALES_SUFFIX, onnx.TensorProto.FLOAT8E8M0, [t.scales.shape[1], n],
        np.ascontiguousarray(t.scales.T).tobytes(), raw=True,
    )
    return code_t, scale_t


def quantize_model(
    model: onnx.ModelProto,
    fmt: str = "fp6_e2m3",
    lm_head: bool = False,
    rounding: str = "even",
    cache: dict | None = None,
) -> int:
    """Rewrite `model` in place; returns how many weights were quantized.

    `cache` (name -> tensors) lets the graphs of one model share the work, since they hold the same weights.
    """
    if fmt not in ONNX_TYPES:
        raise ValueError(f"MX format {fmt!r} has no ONNX graph form; choose one of {sorted(ONNX_TYPES)}")
    cache = {} if cache is None else cache
    graph = model.graph
    matmul_weights = {n.input[1] for n in graph.node if n.op_type == "MatMul"}
    keep, nodes = [], []
    for init in graph.initializer:
        if not (init.name in matmul_weights and selected(init.name, lm_head)):
            if init.name in matmul_weights and init.name != LM_HEAD and len(init.dims) == 2 and min(init.dims) >= BLOCK:
                # never leave a decoder weight in full precision because its name was not recognised
                raise ValueError(f"MatMul weight {init.name!r} {list(init.dims)} is not a recognised decoder "
                                 "linear or LM head: refusing to leave it unquantized silently")
            keep.append(init)
            continue
        if init.name not in cache:
            w = numpy_helper.to_array(init)
            if w.ndim != 2 or w.dtype != np.float32:
                raise ValueError(f"weight {init.name!r}: expected a float32 [K, N] matrix, got {w.dtype} {w.shape}")
            cache[init.name] = mx_tensors(init.name, w, fmt, rounding)
        codes, scales = cache[init.name]
        keep += [codes, scales]
        nodes.append(helper.make_node(
            "DequantizeLinear", [codes.name, scales.name], [init.name], name=f"mx_dequant/{init.name}",
            axis=0, block_size=BLOCK, output_dtype=onnx.TensorProto.FLOAT,
        ))
    if not nodes:
        return 0
    rewrite_graph(graph, keep, nodes)
    base = next(o for o in model.opset_import if o.domain in ("", "ai.onnx"))
    helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                   BASE_OPSET_KEY: str(base.version)})
    base.version = MX_OPSET
    return len(nodes)


def summarize(cache: dict, fmt: str, rounding: str, lm_head: bool) -> QuantSummary:
    """Sizes from quantize_model's cache (name -> (codes, scales)), as they will be stored."""
    elements = sum(math.prod(codes.dims) for codes, _ in cache.values())
    stored = sum(len(codes.raw_data) + len(scales.raw_data) for codes, scales in cache.values())
    return QuantSummary(fmt, BLOCK, rounding, lm_head, len(cache), elements, stored, 2 * elements)


def store_float16(model: onnx.ModelProto, cache: dict | None = None) -> int:
    """Store the remaining float32 weight matrices as float16, each behind a Cast back to float32.

    The Cast of a constant is folded when a session loads, so this halves the artifact on disk and
    keeps float32 arithmetic (ONNX Runtime's CPU kernels are float32); the weights' values are the
    float16-rounded ones.
    """
    cache = {} if cache is None else cache
    graph = model.graph
    keep, nodes = [], []
    for init in graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT or len(init.dims) != 2:
            keep.append(init)
            continue
        if init.name not in cache:
            full = numpy_helper.to_array(init)
            if np.isnan(full).any():
                raise ValueError(f"weight {init.name!r} contains NaN")
            if np.isinf(full).any():
                raise ValueError(f"weight {init.name!r} contains Inf")
            with np.errstate(over="ignore"):
                half = full.astype(np.float16)
            if not np.isfinite(half).all():
                raise ValueError(f"weight {init.name!r} has values beyond float16's range (65504)")
            cache[init.name] = numpy_helper.from_array(half, init.name + ".fp16")
        keep.append(cache[init.name])
        nodes.append(helper.make_node("Cast", [init.name + ".fp16"], [init.name], name=f"fp16/{init.name}",
                                      to=onnx.TensorProto.FLOAT))
    rewrite_graph(graph, keep, nodes)
    return len(nodes)


def _rewrite_export(export_dir: Path, rewrite, desc: str, progress: bool, **info_update) -> None:
    """Apply `rewrite(model, cache)` to every graph of an export folder and save it back.

    The folder is the pipeline's private staging folder, so files are replaced one by one;
    each saved graph is checked from disk (models over 2 GiB cannot be checked in memory).
    """
    export_dir = Path(export_dir)
    info = json.loads((export_dir / "export.json").read_text())
    cache: dict = {}

    def rewritten() -> Iterator[tuple[str, onnx.ModelProto]]:  # one graph's weights in memory at a time
        for name in tqdm(info["graphs"], desc=desc, disable=not progress):
            model = load_with_weights(export_dir / f"{name}.onnx")
            if not rewrite(model, cache):
                raise ValueError(f"graph {name!r} of {export_dir} has no weights for {desc}")
            yield name, model

    with tempfile.TemporaryDirectory(dir=export_dir) as tmp:
        for path in save_shared(rewritten(), Path(tmp), info["weights"]).values():
            onnx.checker.check_model(str(path), full_check=True)
        for f in Path(tmp).iterdir():
            f.replace(export_dir / f.name)
    info.update({k: v(cache) if callable(v) else v for k, v in info_update.items()})
    (export_dir / "export.json").write_text(json.dumps(info, indent=2))


def quantize_export(
    export_dir: Path, fmt: str = "fp6_e2m3", lm_head: bool = False, rounding: str = "even", progress: bool = True
) -> dict:
    """Quantize every graph of an exported model folder in place; returns the summary stored in export.json."""
    def summary(cache: dict) -> dict:
        s = summarize(cache, fmt, rounding, lm_head)
        return asdict(s) | {"ratio_to_fp16": round(s.ratio_to_fp16, 4)}

    _rewrite_export(export_dir, lambda m, c: quantize_model(m, fmt, lm_head, rounding, c), f"quantize {fmt}",
                    progress, quant=summary)
    return json.loads((Path(export_dir) / "export.json").read_text())["quant"]


def float16_export(export_dir: Path, progress: bool = True) -> None:
    """Store an exported model's weight matrices as float16 (see store_float16)."""
    _rewrite_export(export_dir, store_float16, "store float16", progress, storage_dtype="float16")
