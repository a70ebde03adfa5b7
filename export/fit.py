"""What an export needs in memory and on disk, from the checkpoints' configs, before any weight is loaded.

The estimates describe this exporter as it is: it loads each model in float32 and traces its
graphs one at a time (each saved before the next), and the compiler keeps each graph's optimised
copy (weights and prepacked blobs) until it merges them. Measured on the llama2-7b-spd recipe
with two 162M-parameter models (benchmarks.make_checkpoint llama-160m as TLM and DLM): peak RSS
4.22 GiB against 4.43 predicted, peak disk 7.43 GiB against 8.0 (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.recipe import ModelSpec
from common.resources import GIB, check_disk, check_memory
from export.loader import read_config

BASELINE = GIB // 2  # the interpreter, torch and onnx before any model
ARTIFACT_BYTES_PER_PARAMETER = {"mx": 3.5, "float": 7.4}  # weights.bin: raw + prepacked (measured)


def parameter_count(model_dir: Path, context_length: int, trust_remote_code: bool = False) -> int:
    """Parameters of a checkpoint, from its config alone (the model is built on the meta device)."""
    config = read_config(model_dir, context_length, trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def export_memory(params: dict[str, int]) -> int:
    """Peak bytes: every model in float32, and while one graph is traced, about 4.5 more float32
    copies of that model in the ONNX exporter (fitted; each graph is saved before the next)."""
    loaded = sum(4 * p for p in params.values())
    return BASELINE + loaded + int(max(4 * 4.5 * p for p in params.values()))


def export_disk(params: dict[str, int], graphs: dict[str, int], specs: dict[str, ModelSpec]) -> int:
    """Peak bytes on disk: the float32 exports and their converted copies, the artifact, and the
    compiler's per-graph optimised copies of the largest model."""
    artifact = {role: ARTIFACT_BYTES_PER_PARAMETER["mx" if specs[role].mx_format else "float"] * p
                for role, p in params.items()}
    staging = sum(5.3 * p for p in params.values())
    return int(staging + sum(artifact.values()) + max((graphs[r] + 1) * artifact[r] for r in params))


def check_export_fits(dirs: dict[str, Path], graphs: dict[str, int], specs: dict[str, ModelSpec],
                      out_dir: Path, context_length: int) -> None:
    """Refuse an export that would be killed for memory or fill the disk, before it loads anything
    (an unreadable or unsupported config is refused here too, as loading would)."""
    params = {role: parameter_count(d, context_length) for role, d in dirs.items()}
    sizes = ", ".join(f"{role.upper()} {p / 1e9:.2f}B parameters" for role, p in params.items())
    check_memory(export_memory(params), f"exporting {sizes}",
                 "float32 weights in torch and in the ONNX exporter while a graph is traced; the exporter "
                 "does not stream yet")
    check_disk(export_disk(params, graphs, specs), out_dir.parent, f"exporting {sizes}",
               "float32 exports, the artifact, and the compiler's per-graph copies")
