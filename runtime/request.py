"""Turning a caller's arguments into a checked request: prompts, numbers, methods, stop strings.

Everything is validated before any model work, so bad input fails fast and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from numbers import Integral

import numpy as np

from common import graph_io
from common.recipe import SPECULATION_METHODS, LookaheadSettings, PromptLookupSettings, settings_from
from runtime.artifact import Artifact
from runtime.sampling import SamplingParams


class PromptTooLongError(ValueError):
    """A prompt that does not fit the artifact's context length or prompt limit."""


def token_ids(prompt: object) -> list[int]:
    """A prompt given as token ids: a sequence (or 1-D array) of integers, nothing else."""
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise TypeError(f"prompt: token ids must be 1-D, got an array of shape {prompt.shape}")
    if not isinstance(prompt, (Sequence, np.ndarray)) or isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}")
    bad = [t for t in prompt if isinstance(t, (bool, np.bool_)) or not isinstance(t, Integral)]
    if bad:
        raise TypeError(f"prompt: token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__})")
    return [int(t) for t in prompt]


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_optional_bool(name: str, value: object) -> None:
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True, False or None, got {value!r} ({type(value).__name__})")


def speculation_method(art: Artifact, speculative: object) -> str | None:
    """The speculation method a generation uses (None: autoregressive).

    None follows the recipe (its method, if speculative; "draft" without a draft model is off);
    True is the recipe's method; False is off; a string names a method.
    """
    recipe = art.manifest.recipe
    default = recipe.get("speculation", "draft")
    if speculative is None:
        on = recipe.get("speculative", False) and (default != "draft" or "dlm" in art.runners)
        return default if on else None
    if isinstance(speculative, str):
        if speculative not in SPECULATION_METHODS:
            raise ValueError(f"speculative: {speculative!r} is not one of {SPECULATION_METHODS} (or True/False)")
        method = speculative
    else:
        check_optional_bool("speculative", speculative)
        method = default if speculative else None
    if method == "draft":
        art.dlm  # noqa: B018 - raises a clear error when the artifact has no draft model
    return method


def method_settings(art: Artifact, method: str | None, lookahead: object, prompt_lookup: object) -> object:
    """The method's settings: the recipe's, updated by the caller's dict (every key checked)."""
    recipe = art.manifest.recipe
    for name, given in (("lookahead", lookahead), ("prompt_lookup", prompt_lookup)):
        if given is not None and not isinstance(given, dict):
            raise TypeError(f"{name} must be a dict of settings, got {type(given).__name__}")
    if method == "lookahead":
        return settings_from(LookaheadSettings, recipe.get("lookahead", {}) | (lookahead or {}), "lookahead")
    if method == "prompt_lookup":
        settings = settings_from(PromptLookupSettings, recipe.get("prompt_lookup", {}) | (prompt_lookup or {}),
                                 "prompt_lookup")
        if settings.max_draft >= (biggest := largest_graph(art)):
            raise ValueError(f"prompt_lookup max_draft {settings.max_draft} needs a graph of T = "
                             f"{settings.max_draft + 1}; this artifact's largest is T = {biggest}")
        return settings
    return None


def largest_graph(art: Artifact) -> int:
    """The most rows one TLM call takes."""
    return max(g.tokens for g in art.manifest.models["tlm"].graphs.values())


def lookahead_rows(art: Artifact, settings: LookaheadSettings) -> int:
    """The rows of a full lookahead step with these settings, refused if no compiled graph holds them."""
    t = graph_io.lookahead_tokens(settings.ngram, settings.window, settings.guesses)
    if t > largest_graph(art):
        raise ValueError(f"lookahead {settings} needs a graph of T = {t}; this artifact's largest is "
                         f"T = {largest_graph(art)}: export with these settings in the recipe's [lookahead] table")
    return t


def scoring_draft_lengths(art: Artifact) -> list[int]:
    """The compiled draft lengths whose k + 1 rows fit one call."""
    return [k for k in graph_io.draft_lengths(art.manifest.k) if k < largest_graph(art)]


def check_draft_length(art: Artifact, method: str | None, settings: object, draft_length: object) -> None:
    if draft_length is None:
        return
    check_int("draft_length", draft_length, 1)
    if method in (None, "lookahead"):
        raise ValueError("draft_length applies to speculative='draft' and 'prompt_lookup', not "
                         f"{method or 'autoregressive decoding'}")
    if method == "draft" and draft_length not in scoring_draft_lengths(art):
        raise ValueError(f"draft_length {draft_length} is not compiled in this artifact; available: "
                         f"{scoring_draft_lengths(art)} (None: chosen per round)")
    if method == "prompt_lookup" and draft_length > settings.max_draft:
        raise ValueError(f"draft_length {draft_length} exceeds prompt_lookup max_draft {settings.max_draft}")


@dataclass(frozen=True)
class Speculation:
    """A server request's speculation, which the engine turns into its drafter and draft policy at
    admission (a generation's are made by its caller). The cache reserves `k` slots for a round's drafts."""

    method: str  # "draft", "prompt_lookup" or "lookahead"
    k: int  # the most tokens a round drafts (lookahead: a step's rows beyond the root)
    settings: PromptLookupSettings | LookaheadSettings | None = None
    fixed: int | None = None  # draft_length: every round drafts this many (where it can)


def batched_speculation(art: Artifact, speculative: object, draft_length: object = None) -> Speculation | None:
    """A server request's speculation (None: the method is off)."""
    method = speculation_method(art, speculative)
    settings = method_settings(art, method, None, {"max_draft": draft_length} if method == "prompt_lookup" and
                               isinstance(draft_length, int) else None)  # the body's one way to draft longer
    check_draft_length(art, method, settings, draft_length)
    if method is None:
        return None
    if method == "lookahead":  # each request keeps its own window; a step scores all its rows
        assert isinstance(settings, LookaheadSettings)
        return Speculation(method, lookahead_rows(art, settings) - 1, settings)
    assert draft_length is None or isinstance(draft_length, int)
    most = max(scoring_draft_lengths(art)) if method == "draft" else settings.max_draft
    return Speculation(method, draft_length or most, settings, draft_length)


def stop_strings(stop: object) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop: an empty stop string would match everywhere; remove it")
    return tuple(stop)


def encode_prompt(art: Artifact, prompt: str | Sequence[int], chat: bool | None = None) -> list[int]:
    if not isinstance(prompt, str):
        ids = token_ids(prompt)
    else:
        chat = art.manifest.recipe.get("chat_template", False) if chat is None else chat
        tok = art.tokenizer
        if chat and tok.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        else:
            ids = tok(prompt)["input_ids"]
    if not ids:
        raise ValueError("the prompt is empty")
    vocab = art.manifest.models["tlm"].dims.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}); got {min(ids)}..{max(ids)}")
    limit = art.manifest.context_length - 1
    if len(ids) > limit:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens but the artifact's context length "
            f"{art.manifest.context_length} leaves room for at most {limit} (plus one generated "
            "token); shorten the prompt or export with a longer context_length"
        )
    most = art.manifest.recipe.get("max_prompt_length")
    if most is not None and len(ids) > most:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens but the recipe's max_prompt_length is {most}; shorten the "
            f"prompt or export with a larger max_prompt_length (below context_length {art.manifest.context_length})"
        )
    return ids


SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")


@dataclass(frozen=True)
class Decoding:
    """The decoding keywords every entry point takes, checked. Sampling values the caller left
    unset come from the recipe's [sampling] table (`with_recipe`)."""

    params: SamplingParams
    given: dict  # the sampling values the caller set
    max_new_tokens: int | None
    seed: int | None
    stop: tuple[str, ...]

    def with_recipe(self, art: Artifact) -> Decoding:
        recipe = art.manifest.recipe.get("sampling", {})
        values = {k: recipe[k] for k in SAMPLING_KEYS if k in recipe} | self.given
        return replace(self, params=SamplingParams(**values))

    def new_tokens(self, art: Artifact) -> int:
        """max_new_tokens, or the recipe's default."""
        return int(art.manifest.recipe.get("max_new_tokens", 128)) if self.max_new_tokens is None \
            else self.max_new_tokens


def decoding(max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop: Sequence[str] = ()) -> Decoding:
    """Check the keywords (None: the recipe's value, once `with_recipe` is applied)."""
    given = {k: v for k, v in zip(SAMPLING_KEYS, (do_sample, temperature, top_k, top_p), strict=True) if v is not None}
    params = SamplingParams(**given)  # checks what was given
    if max_new_tokens is not None:
        check_int("max_new_tokens", max_new_tokens, 1)
    if seed is not None:
        check_int("seed", seed, 0)
    return Decoding(params, given, max_new_tokens, seed, stop_strings(stop))
