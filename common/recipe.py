"""Recipe schema: a declarative model pair plus the shapes and defaults it is compiled for.

A recipe is a TOML file. Validation is strict (unknown keys and wrong types are errors that name
the offending key) because a typo in a deployment config should fail at export, not at serving.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DTYPES = ("float32", "float16")
# MXFP6 E2M3 (6.25 bits per weight), MXFP6 E3M2 (exact lowering only), MXFP4 E2M1 (4.25 bits).
MX_FORMATS = ("fp6_e2m3", "fp6_e3m2", "fp4_e2m1")
# How the compiler runs MX weights (compiler/mx_lowering.py): mxspd's kernel with int16 or int8
# activations (the default `native8`: on every licence text it loses less than llama.cpp's Q6_K and
# multiplies many rows 1.4-1.6x faster, docs/formats.md; MXFP4 weights always take int8; falls back to
# `fused` where its library was not built),
# ONNX Runtime's MatMulNBits on 8-bit codes, or float32 MatMul on the MX values.
MX_LOWERINGS = ("native", "native8", "fused", "exact")
# How the quantizer picks each MX block's shared exponent (quant.mx.SCALE_CHOICES; the encoding is
# standard MX either way): the spec's rule, or whichever of it and the one above errs less.
MX_SCALES = ("spec", "min_error")
# How a model with MX weights stores its LM head and its token embedding table, both read every token
# (at Llama-2-7B widths a float32 head is 524 of the 1,155 MB one decode step reads): MXINT8 (8.25 bits
# per weight; the default: on SmolLM2 an MXINT8 head kept top-1 agreement with float32 at 90.2% where an
# MXFP6 head fell to 85.7%, docs/formats.md), MXFP6 E2M3 (6.25 bits, whatever mx_format), the head in the
# recipe's own mx_format, or float32.
MX_LM_HEADS = ("int8", "fp6", "format", "float32")
MX_FP6 = "fp6_e2m3"  # the format of a recipe's mx_fp6 tier (and of mx_lm_head = "fp6")
MX_EMBEDDINGS = ("int8", "float32")
LM_HEAD_WEIGHT = "lm_head.weight.T"  # the LM head's MatMul weight in the exported graphs
TARGETS = ("ort-cpu", "ort-cuda")
# The KV cache's type: "" the target's (float32 on the CPU; the GPU target's graphs are float16 throughout,
# its cache too), or float16 on the CPU (mxspd's kernels round each new key and value once: half the
# bytes a token's attention reads; compiler/half_kv.py).
KV_CACHES = ("", "float32", "float16")
# What drafts the tokens the TLM verifies: the draft model, n-grams of the text so far, or
# lookahead decoding's Jacobi n-gram pool (the last two need no draft model).
SPECULATION_METHODS = ("draft", "prompt_lookup", "lookahead")


MIN_CALIBRATION_TOKENS = 256  # fewer say little about a model's inputs


class RecipeError(ValueError):
    """A recipe that does not match the schema."""


@dataclass(frozen=True)
class ModelSpec:
    model: str  # local path, Hugging Face id (resolved in the local cache only) or builtin:NAME
    dtype: str = "float32"
    mx_format: str | None = None
    mx_lm_head: str = "int8"  # MX_LM_HEADS; with mx_format only
    mx_lowering: str = "native8"
    mx_scale: str = "spec"
    # Name fragments of the weights stored MXINT8 (8.25 bits per weight) instead of mx_format:
    # e.g. "down_proj" or "layers.0." for sensitive ones (the LM head: mx_lm_head).
    mx_int8: tuple[str, ...] = ()
    # Name fragments of the weights stored MXFP6 E2M3 (6.25 bits) instead of mx_format (MXFP4 or E3M2): a tier
    # between four and eight bits; where mx_int8 names a weight too, MXINT8 wins.
    mx_fp6: tuple[str, ...] = ()
    # A text the model reads so that the MX quantizer rounds with error feedback (GPTQ-style,
    # quant/error_feedback.py): builtin:NAME (recipes/builtin/NAME.txt) or a path; "": round to nearest.
    mx_calibration: str = ""
    mx_calibration_tokens: int = 2048
    # The token embedding table (MX_EMBEDDINGS; with mx_format only): MXINT8 blocks gathered row by row,
    # then dequantized; in float32 it is the largest tensor of a small model's artifact.
    mx_embedding: str = "int8"

    @property
    def mx_head(self) -> bool:
        """The LM head is stored in MX blocks (MXINT8 or mx_format)."""
        return self.mx_format is not None and self.mx_lm_head != "float32"

    @property
    def mx_int8_fragments(self) -> tuple[str, ...]:
        """Name fragments of the weights stored MXINT8: mx_int8's, and the LM head's where it is MXINT8."""
        head = ("lm_head",) if self.mx_lm_head == "int8" and not selects_head(self.mx_int8) else ()
        return self.mx_int8 + head

    @property
    def mx_fp6_fragments(self) -> tuple[str, ...]:
        """Name fragments of the weights stored MXFP6 E2M3: mx_fp6's, and the LM head's where it is MXFP6."""
        head = ("lm_head",) if self.mx_lm_head == "fp6" and not selects_head(self.mx_fp6) else ()
        return self.mx_fp6 + head

    @property
    def mx_table(self) -> bool:
        """The token embedding table is stored MXINT8."""
        return self.mx_format is not None and self.mx_embedding == "int8"


def selects_head(fragments: tuple[str, ...]) -> bool:
    return any(f in LM_HEAD_WEIGHT for f in fragments)


@dataclass(frozen=True)
class SamplingDefaults:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class LookaheadSettings:
    """Lookahead decoding: N-gram size, Jacobi window width W, n-gram candidates verified per step G.

    Defaults measured on this project's 2-core CPU (docs/benchmarks-history.md), where a wide step is not
    free: T = 1 + (N-1)(W+G) rows per call.
    """

    ngram: int = 3
    window: int = 3
    guesses: int = 3
    adaptive: bool = True  # False: a lookahead step every round, even when plain decoding is faster

    def check(self, where: str = "lookahead") -> LookaheadSettings:
        _check_ints(self, where, {"ngram": 2, "window": 1, "guesses": 1})
        return self


@dataclass(frozen=True)
class PromptLookupSettings:
    """Prompt lookup: match the last `ngram` tokens (falling back to shorter) in the text so far and
    propose up to `max_draft` tokens that followed the latest match."""

    ngram: int = 3
    max_draft: int = 8
    adaptive: bool = True  # False: always score the whole match, even when it does not pay
    # Where the text so far offers no match of 2+ tokens, draft from the artifact's n-gram table (if it
    # ships one: the recipe's ngram_table), each guess at least min_confidence sure.
    table: bool = True
    min_confidence: float = 0.4

    def check(self, where: str = "prompt_lookup") -> PromptLookupSettings:
        _check_ints(self, where, {"ngram": 1, "max_draft": 1})
        if self.ngram > 64:  # match lengths are kinds of draft below the table's (runtime/prompt_lookup.py)
            raise ValueError(f"{where}.ngram must be <= 64, got {self.ngram}")
        if not isinstance(self.table, bool):
            raise TypeError(f"{where}.table must be true or false, got {self.table!r}")
        if isinstance(self.min_confidence, bool) or not isinstance(self.min_confidence, int | float) \
                or not 0 < self.min_confidence <= 1:
            raise ValueError(f"{where}.min_confidence must be a number in (0, 1], got {self.min_confidence!r}")
        return self


def _check_ints(settings: object, where: str, minimum: dict[str, int]) -> None:
    if not isinstance(settings.adaptive, bool):
        raise TypeError(f"{where}.adaptive must be true or false, got {settings.adaptive!r}")
    for key, low in minimum.items():
        value = getattr(settings, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}.{key} must be an integer, got {value!r}")
        if value < low:
            raise ValueError(f"{where}.{key} must be >= {low}, got {value}")


def settings_from(cls: type, values: object, where: str):
    """Method settings from a dict (recipe table or runtime keyword), every key checked by name."""
    if not isinstance(values, dict):
        raise TypeError(f"{where} must be a dict of settings, got {type(values).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown}; allowed: {sorted(known)}")
    return cls(**values).check(where)


@dataclass(frozen=True)
class Recipe:
    name: str
    tlm: ModelSpec
    dlm: ModelSpec | None = None
    description: str = ""
    k: int = 4
    prefill_chunk: int = 32
    context_length: int = 256  # the longest sequence (prompt + new tokens), in positions
    kv_slots: int = 0  # KV cache slots, shared by all of a server's requests (0: context_length)
    kv_cache: str = ""  # KV_CACHES
    max_prompt_length: int = 128
    max_new_tokens: int = 128
    batch_size: int = 1
    target: str = "ort-cpu"
    batch_invariant: bool = True  # compiler/invariance.py: off only to measure what it costs
    speculative: bool = True
    speculation: str = "draft"  # one of SPECULATION_METHODS, used when speculative is on
    lookahead: LookaheadSettings = field(default_factory=LookaheadSettings)
    prompt_lookup: PromptLookupSettings = field(default_factory=PromptLookupSettings)
    chat_template: bool = False
    # An n-gram draft table shipped in the artifact for prompt lookup (builtin:NAME for
    # recipes/builtin/NAME.npz, or a path), made by `python -m recipes.ngram_draft`; "": none.
    ngram_table: str = ""
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    prompts: tuple[str, ...] = ()

    @property
    def capacity(self) -> int:
        """The KV cache's slots: what every request in flight shares."""
        return self.kv_slots or self.context_length

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def with_mx_format(spec: ModelSpec, mx_format: str | None) -> ModelSpec:
    """`spec` in another MX format; None (float weights) drops the settings that only MX weights have."""
    if mx_format is None:
        return replace(spec, mx_format=None, mx_int8=(), mx_fp6=(), mx_calibration="")
    return replace(spec, mx_format=mx_format, mx_fp6=() if mx_format == MX_FP6 else spec.mx_fp6)


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a table, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    kwargs = {}
    for key, value in data.items():
        kind = known[key].type
        path = f"{where}.{key}"
        if kind.removesuffix(" | None") in _TABLES:
            value = _build(_TABLES[kind.removesuffix(" | None")], value, path)
        elif kind == "tuple[str, ...]":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise RecipeError(f"{path}: expected a list of strings")
            value = tuple(value)
        elif key in ("mx_lm_head", "mx_embedding") and isinstance(value, bool):
            values = ', "fp6", "format"' if key == "mx_lm_head" else ""
            raise RecipeError(f'{path}: expected a string, "int8" (the default){values} or "float32", not a boolean '
                              "(its earlier form)")
        else:
            _check_scalar(kind, value, path)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required key is missing
        raise RecipeError(f"{where}: {exc}") from None


_TABLES = {cls.__name__: cls for cls in (ModelSpec, SamplingDefaults, LookaheadSettings, PromptLookupSettings)}


def _check_scalar(kind: str, value: Any, path: str) -> None:
    expected = {
        "str": (str,), "str | None": (str,), "bool": (bool,), "int": (int,), "float": (int, float),
    }[kind]
    if isinstance(value, bool) and kind != "bool":
        raise RecipeError(f"{path}: expected {kind}, got a boolean")
    if not isinstance(value, expected):
        raise RecipeError(f"{path}: expected {kind}, got {type(value).__name__} {value!r}")


def _validate_model(spec: ModelSpec, where: str) -> None:
    if spec.dtype not in DTYPES:
        raise RecipeError(f"{where}.dtype: {spec.dtype!r} is not one of {DTYPES}")
    if spec.mx_format is not None and spec.mx_format not in MX_FORMATS:
        raise RecipeError(f"{where}.mx_format: {spec.mx_format!r} is not one of {MX_FORMATS}")
    if spec.mx_format is None and (spec.mx_int8 or spec.mx_fp6 or spec.mx_calibration):
        raise RecipeError(f"{where}: mx_int8, mx_fp6 and mx_calibration need mx_format (MX weights) to be set")
    if spec.mx_format == MX_FP6 and spec.mx_fp6:
        raise RecipeError(f"{where}.mx_fp6: the weights are {MX_FP6} already (mx_format); the tier is for "
                          "mx_format fp4_e2m1 or fp6_e3m2")
    if spec.mx_lm_head not in MX_LM_HEADS:
        raise RecipeError(f"{where}.mx_lm_head: {spec.mx_lm_head!r} is not one of {MX_LM_HEADS}")
    if spec.mx_embedding not in MX_EMBEDDINGS:
        raise RecipeError(f"{where}.mx_embedding: {spec.mx_embedding!r} is not one of {MX_EMBEDDINGS}")
    for key in ("mx_int8", "mx_fp6"):
        if any(not f for f in getattr(spec, key)):
            raise RecipeError(f"{where}.{key}: an empty name fragment would select every weight")
    if spec.mx_lm_head != "int8" and selects_head(spec.mx_int8):
        raise RecipeError(f"{where}: mx_int8 {list(spec.mx_int8)} names the LM head, but mx_lm_head is "
                          f"{spec.mx_lm_head!r}: set mx_lm_head = \"int8\" (the default) instead")
    if spec.mx_calibration_tokens < MIN_CALIBRATION_TOKENS:
        raise RecipeError(f"{where}.mx_calibration_tokens: must be >= {MIN_CALIBRATION_TOKENS}, "
                          f"got {spec.mx_calibration_tokens}")
    if spec.mx_lm_head != "fp6" and selects_head(spec.mx_fp6):
        raise RecipeError(f"{where}: mx_fp6 {list(spec.mx_fp6)} names the LM head, but mx_lm_head is "
                          f"{spec.mx_lm_head!r}: set mx_lm_head = \"fp6\" instead")
    if spec.mx_scale not in MX_SCALES:
        raise RecipeError(f"{where}.mx_scale: {spec.mx_scale!r} is not one of {MX_SCALES}")
    if spec.mx_lowering not in MX_LOWERINGS:
        raise RecipeError(f"{where}.mx_lowering: {spec.mx_lowering!r} is not one of {MX_LOWERINGS}")
    if spec.mx_format == "fp6_e3m2" and spec.mx_lowering != "exact":
        raise RecipeError(
            f"{where}: mx_lowering {spec.mx_lowering!r} needs fp6_e2m3 (E3M2 values do not fit int8 blocks); "
            "set mx_lowering = 'exact' for fp6_e3m2"
        )


def _validate_target_formats(spec: ModelSpec, where: str, target: str) -> None:
    if spec.mx_format == "fp4_e2m1" and target == "ort-cuda" and spec.mx_lowering in ("native", "native8"):
        raise RecipeError(f"{where}: the ort-cuda target's MX kernel reads MXFP6 and MXINT8 only; use fp4_e2m1 on "
                          "target ort-cpu, or mx_lowering = 'fused' (MatMulNBits, 8-bit codes) or 'exact'")


def validate(recipe: Recipe) -> Recipe:
    """Cross-field checks that a single type annotation cannot express."""
    _validate_model(recipe.tlm, "tlm")
    if recipe.dlm is not None:
        _validate_model(recipe.dlm, "dlm")
    if recipe.target not in TARGETS:
        raise RecipeError(f"target: {recipe.target!r} is not one of {TARGETS}")
    for spec, where in ((recipe.tlm, "tlm"), (recipe.dlm, "dlm")):
        if spec is not None:
            _validate_target_formats(spec, where, recipe.target)
    for key in ("k", "prefill_chunk", "context_length", "max_prompt_length", "max_new_tokens"):
        if getattr(recipe, key) < 1:
            raise RecipeError(f"{key}: must be >= 1, got {getattr(recipe, key)}")
    if recipe.batch_size != 1:
        raise RecipeError(f"batch_size: only 1 is supported for now, got {recipe.batch_size}")
    if recipe.max_prompt_length >= recipe.context_length:
        raise RecipeError("max_prompt_length must be smaller than context_length")
    if recipe.kv_slots and recipe.kv_slots < recipe.context_length:
        raise RecipeError(f"kv_slots ({recipe.kv_slots}) must hold at least one whole sequence of context_length "
                          f"({recipe.context_length}) slots, or be 0 (= context_length)")
    if recipe.prefill_chunk > recipe.context_length:
        raise RecipeError("prefill_chunk must not exceed context_length")
    if recipe.kv_cache not in KV_CACHES:
        raise RecipeError(f"kv_cache: {recipe.kv_cache!r} is not one of {KV_CACHES[1:]} (or \"\", the target's)")
    if recipe.kv_cache == "float32" and recipe.target == "ort-cuda":
        raise RecipeError('kv_cache: the ort-cuda target computes in float16, its KV cache too; use "float16" or ""')
    if recipe.speculation not in SPECULATION_METHODS:
        raise RecipeError(f"speculation: {recipe.speculation!r} is not one of {SPECULATION_METHODS}")
    if recipe.speculative and recipe.speculation == "draft" and recipe.dlm is None:
        raise RecipeError('speculative = true with speculation = "draft" needs a [dlm] table '
                          '(or choose speculation = "lookahead" or "prompt_lookup", which need none)')
    try:
        recipe.lookahead.check()
        recipe.prompt_lookup.check()
    except (TypeError, ValueError) as exc:
        raise RecipeError(str(exc)) from None
    s = recipe.sampling
    if not (s.temperature > 0 and 0 < s.top_p <= 1 and s.top_k >= 0):
        raise RecipeError("sampling: need temperature > 0, top_k >= 0 and 0 < top_p <= 1")
    return recipe


def recipe_from_dict(data: dict[str, Any], where: str = "recipe") -> Recipe:
    return validate(_build(Recipe, data, where))


def relative_to_recipe(reference: str, folder: Path) -> str:
    """A relative path in a recipe file, taken from the file's folder where something is there.

    A recipe then means the same from any working directory. Hugging Face ids, `builtin:` and
    `package:` references and absolute paths stay as written, and so does a relative path with
    nothing beside the recipe (the working directory's, as before)."""
    if not reference or reference.startswith("~") or ":" in reference.split("/", 1)[0] or Path(reference).is_absolute():
        return reference
    beside = folder / reference
    # normpath, not resolve: a link keeps its own name (a .gguf linked into the Hugging Face cache
    # must still end in .gguf)
    return os.path.normpath(beside.absolute()) if beside.exists() else reference


def load_recipe_file(path: Path) -> Recipe:
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}") from None
    folder = Path(path).parent
    for table in (data.get("tlm"), data.get("dlm")):
        for key in ("model", "mx_calibration"):
            if isinstance(table, dict) and isinstance(table.get(key), str):
                table[key] = relative_to_recipe(table[key], folder)
    if isinstance(data.get("ngram_table"), str):
        data["ngram_table"] = relative_to_recipe(data["ngram_table"], folder)
    return recipe_from_dict(data, where=str(path))
