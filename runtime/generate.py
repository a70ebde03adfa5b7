"""Generation: the public entry points and the autoregressive hot loop.

`generate()` returns a GenerationResult; `stream()` yields text as it is produced. Both run the
same token generator (autoregressive here, speculative in runtime/speculative.py) inside
`Generation`, which applies the shared stopping rules (runtime/results.py). With `n`, generate()
hands over to MultiDecode (runtime/multi.py): n sampled branches in one call per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from common import graph_io
from runtime.artifact import Artifact
from runtime.load import load_artifact
from runtime.multi import MultiResult, collect, start_branches
from runtime.request import (
    check_draft_length,
    check_optional_bool,
    decoding,
    encode_prompt,
    method_settings,
    speculation_method,
)
from runtime.results import GenerationResult, Metrics, TextPieces, finish_reason
from runtime.sampling import SamplingParams, next_token
from runtime.speculative import make_drafter, speculative


def autoregressive(art: Artifact, prompt: np.ndarray, params: SamplingParams, rng) -> Iterator[int]:
    """The hot loop: prefill, then one decode call per token until the context is full. Greedy on a
    device target reads each call's greedy token, not its logits (ModelRunner.run_rows: fetch)."""
    tlm = art.tlm
    fetch = params.do_sample or not tlm.greedy_outputs
    logits = tlm.start(prompt, fetch)
    token = next_token(logits, params, rng) if fetch else int(tlm.argmax()[-1])
    while True:
        yield token
        if tlm.length >= tlm.max_length:
            return
        logits = tlm.forward(graph_io.DECODE, np.array([token]), fetch)
        token = next_token(logits[0], params, rng) if fetch else int(tlm.argmax()[0])


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
                reason = finish_reason(self.art, ids, self.stop, self.max_new_tokens)
                if reason:
                    finish = reason
                    break
        finally:
            tokens.close()
        total = time.perf_counter() - start
        decode = total - ttft
        metrics = Metrics(
            prompt_tokens=len(self.prompt_ids),
            cached_prompt_tokens=self.art.tlm.reused,
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


def start_generation(
    artifact: str | Path | Artifact,
    prompt: str | Sequence[int],
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
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
    d = decoding(max_new_tokens, do_sample, temperature, top_k, top_p, seed, stop)
    if not isinstance(speculative, str):
        check_optional_bool("speculative", speculative)
    check_optional_bool("chat", chat)
    if draft_sampling is not None and not isinstance(draft_sampling, SamplingParams):
        raise TypeError(f"draft_sampling must be a SamplingParams or None, got {type(draft_sampling).__name__}")
    art = artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
    method = speculation_method(art, speculative)
    settings = method_settings(art, method, lookahead, prompt_lookup)
    check_draft_length(art, method, settings, draft_length)
    ids, d = encode_prompt(art, prompt, chat), d.with_recipe(art)
    return Generation(art, ids, d.new_tokens(art), d.params, seed, d.stop, method, settings, draft_sampling,
                      draft_length)


def generate(artifact: str | Path | Artifact, prompt: str | Sequence[int], n: int | None = None,
             **kwargs) -> GenerationResult | MultiResult:
    """Generate from a compiled artifact (a path, or an Artifact from load_artifact for reuse).

    Keywords: max_new_tokens, do_sample, temperature, top_k, top_p (unset: the recipe's [sampling]
    values), seed, stop, chat, and for
    speculation: speculative (None: the recipe's choice; True: the recipe's method; False: off;
    or "draft", "prompt_lookup", "lookahead"), lookahead=dict(ngram, window, guesses, adaptive),
    prompt_lookup=dict(ngram, max_draft, adaptive, table, min_confidence), draft_sampling,
    draft_length (None lets the runtime choose each round's draft length from measured costs and
    acceptance, an int fixes it).
    With n: parallel sampling (runtime/multi.py), a MultiResult of n completions decoded together,
    branch i reproducible alone with seed + i; speculation does not apply.
    """
    if n is not None:
        return collect(start_branches(artifact, prompt, n, **kwargs))
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
    pieces = TextPieces(gen.art.tokenizer)
    for token in gen:
        piece = pieces.add(token)
        if piece is not None:
            yield piece
    if gen.result is not None:
        if rest := pieces.rest(gen.result.text):
            yield rest
        if on_done is not None:
            on_done(gen.result)
