"""Speculative decoding over a token tree: one round loop for every drafter.

Each round a drafter (runtime/draft_model.py, prompt_lookup.py, lookahead.py) proposes a token
tree under the root (the last committed token); the TLM scores the root, the tree and any rows
the drafter needs in one call; runtime/rejection.py accepts one root-to-node path exactly and
emits one more token; the root and the accepted path are committed to the TLM's cache, nothing
else. An empty proposal is a plain decode step (the policies choose one when drafting does not
pay). Invariant between rounds: the TLM has processed every committed token but the last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from common import graph_io
from common.recipe import LookaheadSettings, PromptLookupSettings
from runtime.artifact import Artifact
from runtime.draft_model import DraftModelDrafter
from runtime.draft_policy import DraftPolicy
from runtime.lookahead import Lookahead, LookaheadPolicy
from runtime.prompt_lookup import PromptLookup, table_priors
from runtime.proposal import Drafter, Proposal
from runtime.rejection import verify_greedy, verify_round
from runtime.request import lookahead_rows, scoring_draft_lengths
from runtime.sampling import SamplingParams, argmax_rows, next_token


class RoundStats:
    """Counters for the metrics users expect of speculation (step compression, acceptance, calls, time)."""

    def __init__(self) -> None:
        self.rounds = self.plain_steps = self.drafted = self.accepted = self.delivered = 0
        self.drafted_at: list[int] = []  # rounds whose tree reached depth d + 1
        self.accepted_at: list[int] = []
        self.draft_s = self.tlm_s = self.round_s = 0.0
        self.spec_draft_s = self.score_s = 0.0  # the same, on drafting rounds only (the chain model's c)

    def record(self, proposal: Proposal, n_acc: int, draft_s: float, tlm_s: float, round_s: float) -> None:
        self.draft_s += draft_s
        self.tlm_s += tlm_s
        self.round_s += round_s
        if proposal.empty:
            self.plain_steps += 1  # a decode step (a lookahead window without candidates is a round)
            return
        self.rounds += 1
        self.spec_draft_s += draft_s
        self.score_s += tlm_s
        self.drafted += len(proposal.tokens)
        self.accepted += n_acc
        depth = proposal.depth
        for counts, n in ((self.drafted_at, depth), (self.accepted_at, n_acc)):
            counts.extend([0] * (depth - len(counts)))
            for d in range(n):
                counts[d] += 1

    def summary(self, method: str, tlm_calls: int) -> dict:
        a = self.accepted / self.drafted if self.drafted else 0.0
        steps = self.rounds + self.plain_steps
        tlm_step = self.tlm_s / max(steps, 1)
        score_step = self.score_s / max(self.rounds, 1)
        out = {
            "method": method,
            "rounds": self.rounds,
            "plain_decode_steps": self.plain_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": a,
            "mean_accepted_length": 1 + self.accepted / max(self.rounds, 1),
            "tokens_per_tlm_call": self.delivered / max(steps, 1),  # step compression
            "per_position_acceptance": [n / max(d, 1) for n, d in zip(self.accepted_at, self.drafted_at,
                                                                        strict=True)],
            "tlm_calls": tlm_calls,
            "draft_s": self.draft_s,
            "drafting_rounds_draft_s": self.spec_draft_s,  # proposing, on the rounds that drafted
            "tlm_s": self.tlm_s,
            "host_s": self.round_s - self.draft_s - self.tlm_s,
            "tlm_step_s": tlm_step,
            "tlm_score_step_s": score_step,
        }
        if method != "lookahead" and self.rounds:  # the i.i.d. chain model of shared/notes/spd-math.md
            c = self.spec_draft_s / max(self.drafted, 1) / score_step if score_step else 0.0
            k = self.drafted / self.rounds
            out["cost_ratio_c"] = c
            out["predicted_speedup"] = ((1 - a ** (k + 1)) / ((1 - a) * (c * k + 1)) if a < 1
                                        else (k + 1) / (c * k + 1))
        return out


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
                 draft_params: SamplingParams, rng: np.random.Generator, draft_length: int | None) -> Drafter:
    """The drafter for `method`, with its policy costed from the compiler's measured graph costs."""
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
        return DraftModelDrafter(art.dlm, draft_params, policy, rng)
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


def speculative(art: Artifact, prompt: np.ndarray, params: SamplingParams, drafter: Drafter,
                rng: np.random.Generator, stats_out: dict) -> Iterator[int]:
    """Prefill, then rounds of propose, score in one TLM call, verify, commit, until the context is full."""
    tlm, stats = art.tlm, RoundStats()
    calls0 = tlm.calls
    fetch = params.do_sample or not tlm.greedy_outputs  # greedy on a device target: tokens, not logits
    logits = tlm.start(prompt, fetch)
    token = next_token(logits, params, rng) if fetch else int(tlm.argmax()[-1])
    committed = [*prompt.tolist(), token]
    drafter.start(committed)
    try:
        yield token
        while tlm.length < tlm.max_length:
            t0 = time.perf_counter()
            proposal = drafter.propose(committed, room=tlm.max_length - 1 - tlm.length)
            t1 = time.perf_counter()
            if proposal.empty:  # a plain decode step, as lean as the autoregressive loop's
                logits = tlm.forward(graph_io.DECODE, np.array(committed[-1:]), fetch)
                best = argmax_rows(logits) if fetch else tlm.argmax().__getitem__
                t2 = time.perf_counter()
                path, emitted = [], [next_token(logits[0], params, rng) if fetch else int(best(0))]
            else:
                tokens, parents, sees = proposal.rows(committed[-1])
                logits = tlm.run(tlm.graph_for(len(tokens)), tokens, sees, fetch)
                best = argmax_rows(logits) if fetch else tlm.argmax().__getitem__
                t2 = time.perf_counter()
                if fetch:
                    path, nxt = verify_round(tokens[: len(parents)], parents, proposal.q, logits, params, rng)
                else:
                    path, nxt = verify_greedy(tokens[: len(parents)], parents, best)
                tlm.commit([0, *path])
                emitted = [*tokens[path].tolist(), nxt]
            round_s = time.perf_counter() - t0
            drafter.observe(proposal, len(path), emitted, best, round_s * 1e3)
            stats.record(proposal, len(path), t1 - t0, t2 - t1, round_s)
            committed += emitted
            for t in emitted:
                stats.delivered += 1  # what the caller took: it may stop inside a round's tokens
                yield t
    finally:
        stats_out.update(stats.summary(drafter.name, tlm.calls - calls0) | drafter.summary())
