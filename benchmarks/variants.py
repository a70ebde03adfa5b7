"""Artifacts of one recipe with a different TLM precision, built once and reused while unchanged."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from common.manifest import MANIFEST_NAME
from common.recipe import Recipe
from export.pipeline import build_artifact


def variant(recipe: Recipe, mx_format: str | None, lowering: str = "fused", with_dlm: bool = True) -> Recipe:
    """The recipe with its TLM in fp32 (mx_format None) or MX, and with or without its DLM."""
    tlm = replace(recipe.tlm, mx_format=mx_format, mx_lowering=lowering)
    dlm = recipe.dlm if with_dlm else None
    return replace(recipe, tlm=tlm, dlm=dlm, speculative=recipe.speculative and dlm is not None)


def build_cached(recipe: Recipe, out_dir: Path, progress: bool = True) -> Path:
    """Build `recipe` into out_dir unless an artifact of exactly this recipe is already there."""
    manifest = Path(out_dir) / MANIFEST_NAME
    if manifest.is_file() and json.loads(manifest.read_text()).get("recipe") == json.loads(
        json.dumps(recipe.to_dict())
    ):
        return Path(out_dir)
    return build_artifact(recipe, Path(out_dir), progress=progress)
