"""MultiDecode: several sequences decoded together, one TLM call per step, over one shared cache
(docs/runtime.md, "MultiDecode"): parallel sampling (branch i reproduces alone with seed + i) and
questions over one context, as requests of the engine (runtime/engine.py). It does not speculate:
the branches share each call instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from runtime.artifact import Artifact
from runtime.engine import Engine, Event, Request, check_fits, make_requests
from runtime.load import artifact_of
from runtime.model_runner import NonFiniteLogitsError
from runtime.request import Decoding, check_int, check_optional_bool, decoding, encode_prompt, token_ids
from runtime.results import GenerationResult, TextPieces


@dataclass
class MultiMetrics:
    prompt_tokens: int  # prompt tokens processed: a shared context counts once
    new_tokens: int  # summed over branches
    steps: int  # decode steps: each advances every live branch
    tlm_calls: int
    ttft_s: float  # prefill + the first tokens of all branches
    total_s: float
    tokens_per_s: float  # new tokens summed over branches / total time
    load_s: float


@dataclass
class MultiResult:
    branches: list[GenerationResult]  # one per completion, in request order
    seeds: list[int]  # branch i's seed: generate(..., seed=seeds[i], speculative=False) reproduces it
    metrics: MultiMetrics


class MultiGeneration:
    """Sequences decoded together by the engine: iterate for (sequence, token) as they come; `.result`
    when all end. `context` (may be empty) is prefilled once and forked by every sequence; sequence i
    then feeds `chains[i]` (none: it starts from the context's last logits) and samples with seed + i."""

    def __init__(self, art: Artifact, context: list[int], chains: list[list[int]], n: int, max_new_tokens: int,
                 d: Decoding, what: str) -> None:
        self.art, self.context, self.chains, self.n = art, context, chains, n
        base = int(np.random.SeedSequence().entropy % 2**31) if d.seed is None else d.seed
        self.seeds = [base + i for i in range(n)]
        self.result: MultiResult | None = None
        self.events: list[tuple[int, Event]] = []
        own = [replace(d, max_new_tokens=max_new_tokens, seed=s) for s in self.seeds]
        listeners = [lambda e, i=i: self.events.append((i, e)) for i in range(n)]
        if chains:  # each its own prompt, after a shared context prefilled once (by a request that generates nothing)
            self.group = [Request(context + c, o.with_recipe(art), max_new_tokens, f)
                          for c, o, f in zip(chains, own, listeners, strict=True)]
            if context:
                lead = Request(list(context), d.with_recipe(art), 0, lambda e: self.events.append((-1, e)))
                for r in self.group:
                    r.leader = lead
                self.group.insert(0, lead)
        else:
            self.group = make_requests(art, context, own, listeners)
        check_fits(art, self.group, what)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        with self.art.exclusive():
            yield from self._run()

    def _run(self) -> Iterator[tuple[int, int]]:
        engine = Engine(self.art, prefix_cache=False)
        now = time.perf_counter()
        for r in self.group:  # the clock starts when the caller starts reading
            r.submitted = now
        engine.add(self.group)
        finish: list[str | None] = [None] * self.n
        own, first_step = self.group[-self.n:], None  # after the shared context's request, if any
        while engine.busy:
            engine.admit()
            engine.step()
            for i, event in self.events:
                if event.error:  # the engine's only error: NaN/Inf logits (a step that raises raises here)
                    raise NonFiniteLogitsError(event.error)
                if event.token is not None:
                    yield i, event.token
                elif i >= 0:  # not the shared context's request
                    finish[i] = event.finish
            self.events.clear()
            if first_step is None and all(r.tokens for r in own):
                first_step = engine.stats["steps"]
        results = [GenerationResult(r.tokens, self.art.tokenizer.decode(r.tokens, skip_special_tokens=True), f,
                                    r.metrics(self.art.load_seconds)) for r, f in zip(own, finish, strict=True)]
        start, end = now, max(r.finished for r in self.group)
        new = sum(len(r.tokens) for r in own)
        first = max(r.first_token or end for r in own)
        metrics = MultiMetrics(
            prompt_tokens=len(self.context) + sum(len(c) for c in self.chains), new_tokens=new,
            steps=engine.stats["steps"] - (first_step or 0), tlm_calls=engine.stats["calls"],
            ttft_s=first - start, total_s=end - start, tokens_per_s=new / (end - start) if end > start else 0.0,
            load_s=self.art.load_seconds)
        self.result = MultiResult(results, self.seeds, metrics)


def start_branches(artifact: str | Path | Artifact, prompt: str | Sequence[int], n: int, chat: bool | None = None,
                   speculative: bool | str | None = None, **sampling) -> MultiGeneration:
    """Check a parallel-sampling request (everything before any work) and set it up.

    sampling: max_new_tokens, do_sample, temperature, top_k, top_p, seed, stop (as generate()).
    """
    check_int("n", n, 1)
    d = decoding(**sampling)
    if speculative not in (None, False):
        raise ValueError("speculative decoding runs one sequence per call; with n the branches share each "
                         "call instead: leave speculative unset (or False)")
    check_optional_bool("chat", chat)
    art = artifact_of(artifact)
    d = d.with_recipe(art)
    if n > 1 and not d.params.do_sample:
        raise ValueError(f"n = {n} greedy branches would all be the same sequence: pass do_sample=True for "
                         "n samples, or use beam_search() for the n best sequences")
    ids, max_new = encode_prompt(art, prompt, chat), d.new_tokens(art)
    return MultiGeneration(art, ids, [], n, max_new, d, "branches")


def collect(gen: MultiGeneration) -> MultiResult:
    for _ in gen:
        pass
    assert gen.result is not None
    return gen.result


def generate_multi(artifact: str | Path | Artifact, context: str | Sequence[int] | None,
                   questions: Sequence[str | Sequence[int]], **sampling) -> MultiResult:
    """Answer several questions over one context, all decoded together (greedy unless do_sample).

    The context is prefilled once; each question sees the context and itself, never another
    question. Answer i equals a separate `generate(art, context_ids + question_ids)` (greedy), where
    a text question is tokenized on its own, without special tokens (and no chat template).
    context=None (or empty): the questions are unrelated prompts, each encoded as generate() would.
    Keywords: max_new_tokens, do_sample, temperature, top_k, top_p, seed (answer i uses seed + i), stop.
    Everything is checked before any work.
    """
    if isinstance(questions, (str, bytes)) or not isinstance(questions, Sequence):
        raise TypeError(f"questions must be a list of strings or token-id lists, got {type(questions).__name__}")
    if not questions:
        raise ValueError("questions is empty: give at least one question")
    d = decoding(**sampling)
    art = artifact_of(artifact)
    d, max_new = d.with_recipe(art), d.new_tokens(art)
    if context is None or len(context) == 0:
        shared, chains = [], [encode_prompt(art, q) for q in questions]
    else:
        shared, chains = encode_prompt(art, context, chat=False), []
        for i, q in enumerate(questions):  # follows the context: no special tokens (no second BOS)
            ids = art.tokenizer(q, add_special_tokens=False)["input_ids"] if isinstance(q, str) else token_ids(q)
            if not ids:
                raise ValueError(f"question {i} is empty")
            chains.append(encode_prompt(art, ids, chat=False))  # token ids checked
        encode_prompt(art, shared + max(chains, key=len), chat=False)  # the longest context + question fits
    return collect(MultiGeneration(art, shared, chains, len(chains), max_new, d, "questions"))


def stream_branches(
    artifact: str | Path | Artifact,
    prompt: str | Sequence[int],
    n: int,
    on_done: Callable[[MultiResult], None] | None = None,
    **kwargs,
) -> Iterator[tuple[int, str]]:
    """Parallel sampling, streamed: yield (branch, text piece) as each branch produces text."""
    return _stream(start_branches(artifact, prompt, n, **kwargs), on_done)


def _stream(gen: MultiGeneration, on_done: Callable[[MultiResult], None] | None) -> Iterator[tuple[int, str]]:
    pieces = [TextPieces(gen.art.tokenizer) for _ in range(gen.n)]
    for i, token in gen:
        piece = pieces[i].add(token)
        if piece:
            yield i, piece
    if gen.result is not None:
        for i, r in enumerate(gen.result.branches):
            if rest := pieces[i].rest(r.text):
                yield i, rest
        if on_done is not None:
            on_done(gen.result)
