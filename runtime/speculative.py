"""Speculative decoding: the drafter of each method, with its policy, for a generation on the engine.

Each round a drafter (runtime/draft_model.py, prompt_lookup.py, lookahead.py) proposes a token
tree under the root (the last committed token); the engine (runtime/engine.py) scores the root,
the tree and any rows the drafter needs in one call, runtime/rejection.py accepts one root-to-node
path exactly and emits one more token, and the rejected rows leave the cache. An empty proposal is
a plain decode step (the policies choose one when drafting does not pay). Invariant between rounds:
the TLM has processed every committed token but the last.
"""

from __future__ import annotations

from collections.abc import Callable, Container

import numpy as np

from common import graph_io
from common.recipe import LookaheadSettings, PromptLookupSettings
from runtime.artifact import Artifact
from runtime.draft_model import DraftModelDrafter
from runtime.draft_policy import DraftPolicy
from runtime.forest import Forest
from runtime.lookahead import Lookahead, LookaheadPolicy
from runtime.prompt_lookup import PromptLookup, table_priors
from runtime.proposal import Drafter
from runtime.request import Speculation, lookahead_rows, scoring_draft_lengths
from runtime.sampling import SamplingParams


def _policy(art: Artifact, key: tuple, make: Callable[[], DraftPolicy], adaptive: bool) -> DraftPolicy:
    """An adaptive policy (greedy TLM, nothing fixed) is kept on the artifact per method and
    settings, so what it measured serves the next generation too."""
    if adaptive and key in art.policies:
        art.policies[key].new_generation()
        return art.policies[key]
    policy = make()
    if adaptive:
        art.policies[key] = policy
    return policy


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


def make_drafter(art: Artifact, method: str, settings: object, params: SamplingParams,
                 draft_params: SamplingParams, rng: np.random.Generator, draft_length: int | None,
                 dlm: Forest | None, counters: dict) -> Drafter:
    """The drafter for `method`, with its policy costed from the compiler's measured graph costs; `dlm`:
    the engine's forest over the draft model's cache, `counters` its stats."""
    tlm = art.manifest.models["tlm"].graphs
    sizes = {name: g.tokens for name, g in tlm.items()}

    def cost(rows: int) -> float:
        return tlm[graph_io.fitting_graph(sizes, rows)].cost_ms

    decode, adapt = tlm[graph_io.DECODE].cost_ms, not params.do_sample
    if method == "draft":
        ks = scoring_draft_lengths(art)
        dlm_step = art.manifest.models["dlm"].graphs[graph_io.DECODE].cost_ms or None
        policy = _policy(art, ("draft",), lambda: DraftPolicy(
            {k: cost(k + 1) for k in ks}, decode, dlm_step, draft_length, adapt), adapt and draft_length is None)
        warm_up(art, method, settings)
        return DraftModelDrafter(dlm, draft_params, rng, policy, counters)
    if method == "prompt_lookup":
        assert isinstance(settings, PromptLookupSettings)
        warm_up(art, method, settings)
        fixed = draft_length or (None if settings.adaptive else settings.max_draft)
        table = art.ngram_table if settings.table else None
        key = ("prompt_lookup", settings.ngram, settings.max_draft, table is not None, settings.min_confidence)
        policy = _policy(art, key, lambda: DraftPolicy(
            {k: cost(k + 1) for k in range(1, settings.max_draft + 1)}, decode, 0.0, fixed, adapt, independent=False,
            priors=table_priors(table)), adapt and fixed is None)
        return PromptLookup(settings, policy, table)
    assert method == "lookahead" and isinstance(settings, LookaheadSettings)
    t = lookahead_rows(art, settings)
    warm_up(art, method, settings)
    fixed = None if settings.adaptive else 1
    key = ("lookahead", settings.ngram, settings.window, settings.guesses)
    policy = _policy(art, key, lambda: LookaheadPolicy({1: cost(t)}, decode, 0.0, fixed, adapt),
                     adapt and fixed is None)
    return Lookahead(settings, policy)


def batch_drafter(art: Artifact, spec: Speculation, params: SamplingParams, rng: np.random.Generator,
                  dlm: Forest | None, table_kinds: Container[int], counters: dict) -> Drafter:
    """A batched request's drafter (the server's): the engine sets each round's length (its batch policy's
    for a greedy request, the request's own when it samples), so the drafter's policy is fixed at the most."""
    if spec.method == "draft":
        assert dlm is not None
        return DraftModelDrafter(dlm, params, rng, counters=counters)
    if spec.method == "prompt_lookup":
        policy = DraftPolicy({k: 0.0 for k in spec.lengths if k}, 1.0, 0.0, spec.k, adapt_costs=False,
                             independent=False)
        return PromptLookup(spec.settings, policy, art.ngram_table, table_kinds)
    return Lookahead(spec.settings, LookaheadPolicy({1: 1.0}, 1.0, 0.0, fixed=1))
