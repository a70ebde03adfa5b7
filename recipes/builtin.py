"""`builtin:NAME` model references: the shipped stdlib pair, its distilled draft, and the widened TLM
(built from the shipped one into the cache on first use)."""

from __future__ import annotations

from pathlib import Path

from recipes import distill, widen
from recipes.default_pair import CONFIGS, shipped_model_dir


def builtin_model_dir(name: str) -> Path:
    """The checkpoint folder of a builtin model."""
    if name in widen.WIDE_MODELS:
        return widen.wide_model_dir(name)
    shipped = {**CONFIGS, **distill.DISTILLED}
    if name not in shipped:
        raise ValueError(f"unknown builtin model {name!r}; available: {sorted(shipped) + sorted(widen.WIDE_MODELS)}")
    return shipped_model_dir(name, "recipes.distill" if name in distill.DISTILLED else "recipes.default_pair")
