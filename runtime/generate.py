"""Generation: the public entry points.

`generate()` returns a GenerationResult; `stream()` yields text as it is produced. Both run one
request on the artifact's engine (runtime/engine.py), autoregressive or with a speculation method's
drafter (runtime/speculative.py makes it); the engine applies the stopping rules
(runtime/results.py). With `n`, generate() hands over to MultiDecode (runtime/multi.py): n sampled
branches in one call per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from runtime.artifact import Artifact
from runtime.engine import Request, check_fits, engine_of
from runtime.load import artifact_of
from runtime.model_runner import NonFiniteLogitsError
from runtime.multi import MultiResult, collect, start_branches
from runtime.request import (
    Decoding,
    check_draft_length,
    check_optional_bool,
    decoding,
    encode_prompt,
    method_settings,
    speculation_method,
)
from runtime.results import GenerationResult, TextPieces
from runtime.round_stats import RoundStats
from runtime.sampling import SamplingParams
from runtime.speculative import make_drafter


class Generation:
    """One generation on the artifact's engine: iterate for token ids as they come; `.result` is set when
    it ends."""

    def __init__(self, art: Artifact, prompt_ids: list[int], max_new_tokens: int, d: Decoding, method: str | None,
                 settings: object = None, draft_params: SamplingParams | None = None,
                 draft_length: int | None = None) -> None:
        self.art, self.prompt_ids, self.method, self.settings = art, prompt_ids, method, settings
        # past the context, a generation ends ("length"): its new tokens are cut to what fits
        self.max_new_tokens = min(max_new_tokens, art.manifest.context_length - len(prompt_ids) + 1)
        self.d, self.draft_params, self.draft_length = d, draft_params or d.params, draft_length
        self.result: GenerationResult | None = None
        self.stats: dict = {}

    def __iter__(self) -> Iterator[int]:
        with self.art.exclusive():
            yield from self._run()

    def _run(self) -> Iterator[int]:
        engine, events = engine_of(self.art), []
        req = Request(list(self.prompt_ids), self.d, self.max_new_tokens, events.append)
        if self.method is not None:
            req.drafter = make_drafter(self.art, self.method, self.settings, self.draft_params, req.rng, engine.dlm,
                                       engine.stats)
            req.policy = engine.policy_for(self.method, self.settings, self.draft_length, not self.d.params.do_sample)
            req.rounds = RoundStats()
        check_fits(self.art, [req])
        calls0 = self.art.tlm.calls
        engine.add([req])
        finish = "length"
        try:
            while engine.busy:
                engine.admit()
                engine.step()
                for event in events:
                    if event.error:
                        raise NonFiniteLogitsError(event.error)
                    if event.token is None:
                        finish = event.finish
                    else:
                        yield event.token
                events.clear()
        except Exception:
            engine.abort(req, "error")
            raise
        finally:
            engine.abort(req)  # the caller stopped reading: its slots are free again
            if req.rounds is not None:
                self.stats.update(req.rounds.summary(self.method, self.art.tlm.calls - calls0) | req.drafter.summary())
        metrics = req.metrics(self.art.load_seconds)
        metrics.speculative = self.stats
        text = self.art.tokenizer.decode(req.tokens, skip_special_tokens=True)
        self.result = GenerationResult(req.tokens, text, finish, metrics)


def start_generation(artifact: str | Path | Artifact, prompt: str | Sequence[int], max_new_tokens: int | None = None,
                     do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                     top_p: float | None = None, seed: int | None = None, stop: Sequence[str] = (),
                     speculative: bool | str | None = None, draft_sampling: SamplingParams | None = None,
                     chat: bool | None = None, draft_length: int | None = None, lookahead: dict | None = None,
                     prompt_lookup: dict | None = None) -> Generation:
    """Validate everything up front (so bad input fails before any work) and set up a Generation."""
    d = decoding(max_new_tokens, do_sample, temperature, top_k, top_p, seed, stop)
    if not isinstance(speculative, str):
        check_optional_bool("speculative", speculative)
    check_optional_bool("chat", chat)
    if draft_sampling is not None and not isinstance(draft_sampling, SamplingParams):
        raise TypeError(f"draft_sampling must be a SamplingParams or None, got {type(draft_sampling).__name__}")
    art = artifact_of(artifact)
    method = speculation_method(art, speculative)
    settings = method_settings(art, method, lookahead, prompt_lookup)
    check_draft_length(art, method, settings, draft_length)
    ids, d = encode_prompt(art, prompt, chat), d.with_recipe(art)
    return Generation(art, ids, d.new_tokens(art), d, method, settings, draft_sampling, draft_length)


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
