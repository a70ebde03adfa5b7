"""Generation: the public entry points and the autoregressive hot loop.

`generate()` returns a GenerationResult; `stream()` yields text as it is produced. Both run the
same token generator (autoregressive here, speculative in runtime/speculative.py), and the
stopping rules (EOS, max_new_tokens, stop strings, a full context) live in one place: `Generation`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path

import numpy as np

from common import graph_io
from common.recipe import SPECULATION_METHODS, LookaheadSettings, PromptLookupSettings, settings_from
from runtime.artifact import Artifact, load_artifact
from runtime.sampling import SamplingParams, next_token
from runtime.speculative import make_drafter, speculative


class PromptTooLongError(ValueError):
    """A prompt that does not fit the artifact's context length or prompt limit."""


@dataclass
class Metrics:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prefill + first token
    decode_s: float = 0.0
    total_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    e2e_tokens_per_s: float = 0.0
    load_s: float = 0.0
    speculative: dict = field(default_factory=dict)  # filled by speculative decoding


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos", "length" or "stop"
    metrics: Metrics


def autoregressive(art: Artifact, prompt: np.ndarray, params: SamplingParams, rng) -> Iterator[int]:
    """The hot loop: prefill, then one decode call per token until the context is full."""
    tlm = art.tlm
    tlm.rewind(0)
    token = next_token(tlm.prefill(prompt), params, rng)
    while True:
        yield token
        if tlm.length >= tlm.context:
            return
        token = next_token(tlm.forward(graph_io.DECODE, np.array([token]))[0], params, rng)


class Generation:
    """One generation: iterate for token ids as they come; `.result` is set when it ends."""

    def __init__(
        self,
        art: Artifact,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        seed: int | None,
        stop: Sequence[str],
        method: str | None,
        settings: object = None,
        draft_params: SamplingParams | None = None,
        draft_length: int | None = None,
    ) -> None:
        self.art, self.prompt_ids, self.max_new_tokens = art, prompt_ids, max_new_tokens
        self.params, self.stop, self.method, self.settings = params, tuple(stop), method, settings
        self.draft_params = draft_params or params
        self.draft_length = draft_length
        self.rng = np.random.default_rng(seed)
        self.result: GenerationResult | None = None
        self.stats: dict = {}

    def _tokens(self) -> Iterator[int]:
        prompt = np.asarray(self.prompt_ids, dtype=np.int64)
        if self.method is None:
            return autoregressive(self.art, prompt, self.params, self.rng)
        drafter = make_drafter(self.art, self.method, self.settings, self.params, self.draft_params, self.rng,
                               self.draft_length)
        return speculative(self.art, prompt, self.params, drafter, self.rng, self.stats)

    def _hit_stop(self, ids: list[int]) -> bool:
        if not self.stop:
            return False
        tail = self.art.tokenizer.decode(ids[-32:], skip_special_tokens=True)
        return any(s in tail for s in self.stop)

    def __iter__(self) -> Iterator[int]:
        with self.art.exclusive():
            yield from self._run()

    def _run(self) -> Iterator[int]:
        start = time.perf_counter()
        ids: list[int] = []
        finish, ttft = "length", 0.0
        tokens = self._tokens()
        try:
            for token in tokens:
                if not ids:
                    ttft = time.perf_counter() - start
                ids.append(token)
                yield token
                if token in self.art.eos_token_ids:
                    finish = "eos"
                    break
                if self._hit_stop(ids):
                    finish = "stop"
                    break
                if len(ids) >= self.max_new_tokens:
                    break
        finally:
            tokens.close()
        total = time.perf_counter() - start
        decode = total - ttft
        metrics = Metrics(
            prompt_tokens=len(self.prompt_ids),
            new_tokens=len(ids),
            ttft_s=ttft,
            decode_s=decode,
            total_s=total,
            decode_tokens_per_s=(len(ids) - 1) / decode if decode > 0 and len(ids) > 1 else 0.0,
            e2e_tokens_per_s=len(ids) / total if total > 0 else 0.0,
            load_s=self.art.load_seconds,
            speculative=self.stats,
        )
        text = self.art.tokenizer.decode(ids, skip_special_tokens=True)
        self.result = GenerationResult(ids, text, finish, metrics)


def _token_ids(prompt: object) -> list[int]:
    """A prompt given as token ids: a sequence (or 1-D array) of integers, nothing else."""
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise TypeError(f"prompt: token ids must be 1-D, got an array of shape {prompt.shape}")
    if not isinstance(prompt, (Sequence, np.ndarray)) or isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"prompt must be a string or a sequence of token ids, got {type(prompt).__name__}")
    bad = [t for t in prompt if isinstance(t, (bool, np.bool_)) or not isinstance(t, Integral)]
    if bad:
        raise TypeError(f"prompt: token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__})")
    return [int(t) for t in prompt]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_optional_bool(name: str, value: object) -> None:
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
        _check_optional_bool("speculative", speculative)
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
        return settings_from(PromptLookupSettings, recipe.get("prompt_lookup", {}) | (prompt_lookup or {}),
                             "prompt_lookup")
    return None


def _stop_strings(stop: object) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop: an empty stop string would match everywhere; remove it")
    return tuple(stop)


def encode_prompt(art: Artifact, prompt: str | Sequence[int], chat: bool | None = None) -> list[int]:
    if not isinstance(prompt, str):
        ids = _token_ids(prompt)
    else:
        chat = art.manifest.recipe.get("chat_template", False) if chat is None else chat
        tok = art.tokenizer
        if chat and tok.chat_template:
            ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                add_generation_prompt=True, return_dict=False))
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
    return ids


def start_generation(
    artifact: str | Path | Artifact,
    prompt: str | Sequence[int],
    max_new_tokens: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    speculative: bool | str | None = None,
    draft_sampling: SamplingParams | None = None,
    chat: bool | None = None,
    draft_length: int | None = None,
    lookahead: dict | None = None,
    prompt_lookup: dict | None = None,
) -> Generation:
    """Validate everything up front (so bad input fails before any work) and set up a Generation."""
    params = SamplingParams(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    if max_new_tokens is not None:
        _check_int("max_new_tokens", max_new_tokens, 1)
    if seed is not None:
        _check_int("seed", seed, 0)
    stop = _stop_strings(stop)
    if not isinstance(speculative, str):
        _check_optional_bool("speculative", speculative)
    _check_optional_bool("chat", chat)
    if draft_sampling is not None and not isinstance(draft_sampling, SamplingParams):
        raise TypeError(f"draft_sampling must be a SamplingParams or None, got {type(draft_sampling).__name__}")
    if draft_length is not None:
        _check_int("draft_length", draft_length, 1)
    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    method = speculation_method(art, speculative)
    settings = method_settings(art, method, lookahead, prompt_lookup)
    if draft_length is not None:
        if method == "lookahead":
            raise ValueError("draft_length applies to speculative='draft' and 'prompt_lookup', not lookahead")
        if method == "draft" and draft_length not in graph_io.draft_lengths(art.manifest.k):
            raise ValueError(f"draft_length {draft_length} is not compiled in this artifact; available: "
                             f"{list(graph_io.draft_lengths(art.manifest.k))} (None: chosen per round)")
        if method == "prompt_lookup" and draft_length > settings.max_draft:
            raise ValueError(f"draft_length {draft_length} exceeds prompt_lookup max_draft {settings.max_draft}")
    if max_new_tokens is None:
        max_new_tokens = int(art.manifest.recipe.get("max_new_tokens", 128))
    ids = encode_prompt(art, prompt, chat)
    return Generation(art, ids, max_new_tokens, params, seed, stop, method, settings, draft_sampling,
                      draft_length)


def generate(artifact: str | Path | Artifact, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
    """Generate from a compiled artifact (a path, or an Artifact from load_artifact for reuse).

    Keywords: max_new_tokens, do_sample, temperature, top_k, top_p, seed, stop, chat, and for
    speculation: speculative (None: the recipe's choice; True: the recipe's method; False: off;
    or "draft", "prompt_lookup", "lookahead"), lookahead=dict(ngram, window, guesses, adaptive),
    prompt_lookup=dict(ngram, max_draft, adaptive), draft_sampling, draft_length (None lets the
    runtime choose each round's draft length from measured costs and acceptance, an int fixes it).
    """
    gen = start_generation(artifact, prompt, **kwargs)
    for _ in gen:
        pass
    assert gen.result is not None
    return gen.result


def stream(
    artifact: str | Path | Artifact,
    prompt: str | Sequence[int],
    on_done: Callable[[GenerationResult], None] | None = None,
    **kwargs,
) -> Iterator[str]:
    """Yield decoded text pieces as tokens are produced (same keywords as generate()).

    Arguments are checked now, before the first piece is asked for.
    """
    return _stream(start_generation(artifact, prompt, **kwargs), on_done)


def _stream(gen: Generation, on_done: Callable[[GenerationResult], None] | None) -> Iterator[str]:
    tok = gen.art.tokenizer
    ids: list[int] = []
    shown = ""
    for token in gen:
        ids.append(token)
        text = tok.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            continue
        yield text[len(shown):]
        shown = text
    if gen.result is not None and len(gen.result.text) > len(shown):
        yield gen.result.text[len(shown):]  # a trailing incomplete character, shown as decoded
    if on_done is not None and gen.result is not None:
        on_done(gen.result)
