"""Speculative decoding: the drafter and the draft policy of each method, for the engine's requests.

A round (docs/runtime.md, "Speculation methods"): a drafter (runtime/draft_model.py, prompt_lookup.py,
lookahead.py) proposes a token tree under the last committed token, the engine scores and verifies it; an
empty proposal is a plain step. Invariant between rounds: the TLM has processed every committed token but the last.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from common import graph_io
from common.recipe import LookaheadSettings, PromptLookupSettings
from runtime.artifact import Artifact
from runtime.draft_model import DraftModelDrafter
from runtime.draft_policy import DraftPolicy
from runtime.forest import Forest
from runtime.lookahead import Lookahead
from runtime.prompt_lookup import PromptLookup, table_priors
from runtime.proposal import Drafter
from runtime.request import lookahead_rows, scoring_draft_lengths
from runtime.sampling import SamplingParams


def warm_up(art: Artifact, method: str | None, settings: object) -> None:
    """Run once each graph that a generation with `method` may call and that has not run yet: a
    session's first run allocates (ModelRunner.warm_up), and inside a generation it would cost a
    first probe or the first token several steps' time."""
    tlm = art.tlm
    rows = {None: [], "draft": [k + 1 for k in scoring_draft_lengths(art)],
            "lookahead": [lookahead_rows(art, settings)] if method == "lookahead" else []}.get(method)
    if rows is None:  # prompt lookup
        rows = [k + 1 for k in range(1, settings.max_draft + 1)]
    tlm.warm_up([tlm.prefill_graph, graph_io.DECODE, *(tlm.graph_for(r) for r in rows)])
    if method == "draft":
        art.dlm.warm_up(art.dlm.graphs)


def make_drafter(art: Artifact, method: str, settings: object, draft_params: SamplingParams,
                 rng: np.random.Generator, dlm: Forest | None, counters: dict) -> Drafter:
    """The drafter for `method`; `dlm`: the engine's forest over the draft model's cache, `counters` its
    stats. It drafts the lengths the engine's policy gives (`make_policy`)."""
    warm_up(art, method, settings)
    if method == "draft":
        assert dlm is not None
        return DraftModelDrafter(dlm, draft_params, rng, counters)
    if method == "prompt_lookup":
        assert isinstance(settings, PromptLookupSettings)
        return PromptLookup(settings, art.ngram_table if settings.table else None)
    assert method == "lookahead" and isinstance(settings, LookaheadSettings)
    return Lookahead(settings)


def make_policy(art: Artifact, method: str, settings: object, fixed: int | None, adapt: bool,
                price: Callable[[str, int], float]) -> DraftPolicy:
    """The draft policy of `method`'s requests (runtime/draft_policy.py): its lengths are the compiled ones
    (prompt lookup: up to max_draft; lookahead: a whole step), `fixed` one of them, `price` the engine's."""
    if method == "draft":
        return DraftPolicy(method, price, scoring_draft_lengths(art), fixed=fixed, adapt=adapt)
    if method == "prompt_lookup":
        assert isinstance(settings, PromptLookupSettings)
        fixed = fixed or (None if settings.adaptive else settings.max_draft)
        priors = table_priors(art.ngram_table if settings.table else None)
        return DraftPolicy(method, price, range(1, settings.max_draft + 1), fixed=fixed, adapt=adapt, priors=priors)
    assert method == "lookahead" and isinstance(settings, LookaheadSettings)
    return DraftPolicy(method, price, [1], window=lookahead_rows(art, settings) - 1,
                       fixed=None if settings.adaptive else 1, adapt=adapt)
