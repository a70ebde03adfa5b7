"""Resolves a model reference to a local checkpoint folder and loads it, offline only.

A reference is a local folder, a Hugging Face id already in the local cache, `builtin:NAME`
(the embedded default pair, built on first use), or a GGUF file (a path, or `package:PKG/FILE.gguf`
inside an installed package; export/gguf_checkpoint.py). Nothing is downloaded: a missing model is
an error that says where we looked and how to supply it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.initialization import no_init_weights
from transformers.utils import logging as hf_logging

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "codegen")


class ModelNotFoundError(FileNotFoundError):
    """A model reference that does not resolve to a local checkpoint."""


def hf_cache_dir() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def resolve_model_dir(reference: str, role: str = "model") -> Path:
    """Map a reference to a local folder holding config.json, or raise ModelNotFoundError."""
    if reference.startswith("builtin:"):
        from recipes.builtin import builtin_model_dir

        return builtin_model_dir(reference.removeprefix("builtin:"))
    from export.gguf_checkpoint import gguf_file, is_gguf_reference, metadata_dir

    if is_gguf_reference(reference):
        try:
            return metadata_dir(gguf_file(reference))
        except FileNotFoundError as exc:
            raise ModelNotFoundError(f"{role}: {exc}") from None
    path = Path(reference).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{role} folder {path} has no config.json: not a Hugging Face checkpoint")
        return path
    snapshots = hf_cache_dir() / f"models--{reference.replace('/', '--')}" / "snapshots"
    if snapshots.is_dir():
        for snap in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
            if (snap / "config.json").is_file():
                return snap
    raise ModelNotFoundError(
        f"{role} {reference!r} is not available offline: it is neither a local folder nor in the "
        f"Hugging Face cache ({snapshots.parent}). Download it on a machine with network access "
        f"(`huggingface-cli download {reference}`) and copy the cache, or pass a local checkpoint "
        f"folder or .gguf file with --{role.lower()} PATH."
    )


def resolve_recipe_file(reference: str, key: str, suffix: str, how: str) -> Path:
    """A file a recipe names under `key`: builtin:NAME (recipes/builtin/NAME<suffix>) or a path; `how`
    says how to make it or do without it."""
    if reference.startswith("builtin:"):
        from recipes.default_pair import BUILTIN_DIR

        path = BUILTIN_DIR / f"{reference.removeprefix('builtin:')}{suffix}"
    else:
        path = Path(reference).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"{key} {reference!r}: {path} does not exist ({how})")
    return path


def resolve_ngram_table(reference: str) -> Path:
    return resolve_recipe_file(reference, "ngram_table", ".npz",
                               'make it with `python -m recipes.ngram_draft`, or set ngram_table = "" for none')


def resolve_calibration_text(reference: str) -> Path:
    return resolve_recipe_file(reference, "mx_calibration", ".txt", "make it with `python -m recipes.calibration_text`"
                               ', or set mx_calibration = "" to round to nearest')


def is_available(reference: str) -> bool:
    if reference.startswith("builtin:"):
        return True
    try:
        resolve_model_dir(reference)
    except ModelNotFoundError:
        return False
    return True


def check_supported(config: PretrainedConfig, context_length: int) -> None:
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and context_length > window:
        raise ValueError(
            f"context length {context_length} exceeds the model's sliding window {window}; "
            "sliding-window masks are not built by the host yet"
        )


class CheckpointError(ValueError):
    """A local checkpoint that exists but cannot be used (unreadable config, NaN weights)."""


def read_config(model_dir: Path, context_length: int, trust_remote_code: bool = False) -> PretrainedConfig:
    """The checkpoint's config, checked to be readable and supported at this context length."""
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{Path(model_dir) / 'config.json'} cannot be read as a model config: {exc}") from None
    check_supported(config, context_length)
    return config


def placeholder_model(model_dir: Path, context_length: int, trust_remote_code: bool = False) -> PreTrainedModel:
    """The checkpoint's model with every parameter a zero-memory placeholder of the right shape.

    Tracing needs shapes, not values: each parameter is a broadcast scalar (stride 0), so the model
    costs nothing whatever its size. Buffers computed at construction (RoPE frequencies) are real;
    tied parameters stay tied. The weights themselves are streamed later (export/weights.py).
    """
    config = read_config(model_dir, context_length, trust_remote_code)
    with no_init_weights():  # parameters are allocated but never written, so never resident
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code,
                                                 dtype=torch.float32, attn_implementation="eager")
    model.tie_weights()  # skipped with the initialisation
    placeholders: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in placeholders:
                    placeholders[id(p)] = torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                                             requires_grad=False)
                module._parameters[name] = placeholders[id(p)]
    if (Path(model_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    return model.eval()


def load_model(
    model_dir: Path, context_length: int, trust_remote_code: bool = False, progress: bool = True
) -> PreTrainedModel:
    read_config(model_dir, context_length, trust_remote_code)
    was_enabled = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            dtype=torch.float32,
            attn_implementation="eager",
        )
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    return model.eval()
