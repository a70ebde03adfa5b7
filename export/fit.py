"""What an export needs in memory and on disk, from the checkpoints' configs, before any weight is loaded.

The exporter streams: graphs are traced from a placeholder model and each weight goes from the
checkpoint to the weights file on its own, so the export itself holds a few copies of the largest
tensor. The compiler then lowers MX weights one at a time and optimises one graph at a time; its
peak is ONNX Runtime's session for one graph (for float weights, their prepacked copy; the MX weights
only mxspd's kernels read stay out of it). On disk: the exports, then per model its lowered weights
(written once: packed weights point at their members) and its artifact, the export deleted between.
Factors measured on a 325M-parameter checkpoint and on the llama2-7b-spd recipe's 7B-shaped
models (docs/benchmarks-history.md).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.recipe import ModelSpec
from common.resources import GIB, check_disk, check_memory
from export.loader import read_config

BASELINE = GIB // 2  # the interpreter, torch, transformers and onnx before any model
LARGEST_TENSOR_COPIES = 12  # float32 copies of the largest tensor in flight (trace, conversion, passes)
# Bytes per parameter, measured (docs/benchmarks-history.md; MX on the full Llama-2-7B shape with the MXINT8
# head and table, docs/benchmarks.md "Real sizes": 10.8 GB of disk at peak for 6.74B parameters, 1.60 bytes
# each, the export and the lowered weights side by side): ONNX Runtime optimising one graph (PSS above the
# baseline); weights.bin of the artifact (kernel form, and for float weights their prepacked copy); the
# export (MX blocks, float16 or float32); the lowered weights the compiler writes (each MX weight's kernel
# form once; the weights left alone, copied); ONNX Runtime's optimised copy of one graph (MX: none of the
# kernels' weights, which are graph inputs while it optimises).
COMPILE_BYTES_PER_PARAMETER = {"mx": 1.7, "float16": 4.0, "float32": 4.0}
ARTIFACT_BYTES_PER_PARAMETER = {"mx": 0.8, "float16": 7.6, "float32": 7.6}
EXPORT_BYTES_PER_PARAMETER = {"mx": 0.85, "float16": 2.0, "float32": 4.0}
LOWERED_BYTES_PER_PARAMETER = {"mx": 0.8, "float16": 2.0, "float32": 4.0}
OPTIMISED_BYTES_PER_PARAMETER = {"mx": 0.0, "float16": 7.6, "float32": 7.6}


def parameter_counts(model_dir: Path, context_length: int, trust_remote_code: bool = False) -> tuple[int, int]:
    """(all parameters, largest tensor's elements) of a checkpoint, from its config alone (meta device)."""
    config = read_config(model_dir, context_length, trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    sizes = [p.numel() for p in model.parameters()]
    return sum(sizes), max(sizes)


def _kind(spec: ModelSpec) -> str:
    return "mx" if spec.mx_format else spec.dtype


def export_memory(params: dict[str, tuple[int, int]], specs: dict[str, ModelSpec]) -> int:
    """Peak bytes: the larger of streaming one model's tensors and compiling one of its graphs."""
    streaming = max(LARGEST_TENSOR_COPIES * 4 * largest for _, largest in params.values())
    compiling = max(COMPILE_BYTES_PER_PARAMETER[_kind(specs[r])] * p for r, (p, _) in params.items())
    return BASELINE + int(max(streaming, compiling))


def export_disk(params: dict[str, tuple[int, int]], specs: dict[str, ModelSpec]) -> int:
    """Peak bytes on disk, phase by phase: every model's export is written first; then each model in turn
    is lowered beside the exports, its export deleted, and its artifact written beside its lowered weights
    and ONNX Runtime's optimised copy of one graph (compiler/build.py)."""
    def total(table: dict[str, float], role: str) -> float:
        return table[_kind(specs[role])] * params[role][0]

    held = sum(total(EXPORT_BYTES_PER_PARAMETER, r) for r in params)
    peak = 0.0
    for r in params:
        lowered = total(LOWERED_BYTES_PER_PARAMETER, r)
        peak = max(peak, held + lowered)
        held -= total(EXPORT_BYTES_PER_PARAMETER, r)
        artifact = total(ARTIFACT_BYTES_PER_PARAMETER, r)
        peak = max(peak, held + lowered + total(OPTIMISED_BYTES_PER_PARAMETER, r) + artifact)
        held += artifact
    return math.ceil(peak)


def check_export_fits(dirs: dict[str, Path], specs: dict[str, ModelSpec], out_dir: Path, context_length: int) -> None:
    """Refuse an export that would be killed for memory or fill the disk, before it reads any weight
    (an unreadable or unsupported config is refused here too, as exporting would)."""
    params = {role: parameter_counts(d, context_length) for role, d in dirs.items()}
    sizes = ", ".join(f"{role.upper()} {p / 1e9:.2f}B parameters" for role, (p, _) in params.items())
    check_memory(export_memory(params, specs), f"exporting {sizes}",
                 "ONNX Runtime optimising one graph of the largest model (the weights are streamed)")
    check_disk(export_disk(params, specs), out_dir.parent, f"exporting {sizes}",
               "the exports, then each model's lowered weights and artifact")
