"""Speculative decoding: the DLM drafts k tokens, the TLM scores them in one call, MRS decides.

k is chosen per round by runtime/draft_policy.py (0: a plain decode step when drafting does not pay).

Invariants between rounds (`committed` = prompt + emitted tokens):
- the TLM has processed committed[:-1]: the last token is scored at the start of the next round;
- the DLM has processed committed[:dlm.length]; the rest (`pending`: 1 token, 2 after a full accept
  (the last draft and the bonus token), more after plain decode steps) it catches up on before
  drafting.
Purging is a rewind of each cache's valid length: rejected tokens are never attended to again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from common import graph_io
from runtime.artifact import Artifact
from runtime.draft_policy import DraftPolicy
from runtime.rejection import rejection_sample
from runtime.sampling import SamplingParams, next_token, sample, warp


class RoundStats:
    """Counters for the metrics users expect from SpD (acceptance, calls, step costs)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.rounds = self.drafted = self.accepted = self.tlm_calls = self.dlm_calls = 0  # calls: set at the end
        self.plain_steps = 0  # rounds in which the policy decoded without drafting
        self.k_used: dict[int, int] = {}
        self.drafted_at = np.zeros(k, np.int64)
        self.accepted_at = np.zeros(k, np.int64)
        self.tlm_s = self.dlm_s = self.round_s = 0.0

    def record(self, k: int, n_acc: int) -> None:
        self.rounds += 1
        self.k_used[k] = self.k_used.get(k, 0) + 1
        self.drafted += k
        self.accepted += n_acc
        self.drafted_at[:k] += 1
        self.accepted_at[:n_acc] += 1

    def summary(self) -> dict:
        a = self.accepted / self.drafted if self.drafted else 0.0
        tlm_step = self.tlm_s / max(self.rounds, 1)
        dlm_step = self.dlm_s / max(self.drafted, 1)  # a round makes k DLM calls for k drafts
        c = dlm_step / tlm_step if tlm_step else 0.0
        k = self.drafted / self.rounds if self.rounds else self.k  # the mean draft length used
        predicted = (1 - a ** (k + 1)) / ((1 - a) * (c * k + 1)) if a < 1 else (k + 1) / (c * k + 1)
        host = self.round_s - self.tlm_s - self.dlm_s
        return {
            "k": self.k,
            "draft_lengths_used": dict(sorted(self.k_used.items())),
            "plain_decode_steps": self.plain_steps,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": a,
            "mean_accepted_length": 1 + self.accepted / max(self.rounds, 1),
            "per_position_acceptance": (self.accepted_at / np.maximum(self.drafted_at, 1)).tolist(),
            "tlm_calls": self.tlm_calls,
            "dlm_calls": self.dlm_calls,
            "tlm_score_step_s": tlm_step,
            "dlm_step_s": dlm_step,
            "cost_ratio_c": c,
            "predicted_speedup": predicted,
            "host_overhead_per_round_s": host / max(self.rounds, 1),
        }


def draft_policy(art: Artifact, fixed: int | None, adapt_costs: bool) -> DraftPolicy:
    """The round policy, from the compiler's measured graph costs. An adaptive one (greedy TLM, no
    fixed k) is kept on the artifact, so what it measured serves the next generation too."""
    if fixed is None and adapt_costs and art.draft_policy is not None:
        art.draft_policy.new_generation()
        return art.draft_policy
    tlm, dlm = art.manifest.models["tlm"].graphs, art.manifest.models["dlm"].graphs
    scores = {k: tlm[graph_io.score_graph(k)].cost_ms for k in graph_io.draft_lengths(art.manifest.k)
              if graph_io.score_graph(k) in tlm}
    policy = DraftPolicy(scores, tlm[graph_io.DECODE].cost_ms, dlm[graph_io.DECODE].cost_ms, fixed, adapt_costs)
    if fixed is None and adapt_costs:
        art.draft_policy = policy
    return policy


def _catch_up(dlm, pending: list[int]) -> np.ndarray:
    """Feed the DLM the committed tokens it has not seen; returns the last one's logits."""
    if len(pending) == 1:
        return dlm.forward(graph_io.DECODE, np.array(pending))[0]
    if len(pending) == 2:
        return dlm.forward(graph_io.CATCHUP, np.array(pending))[-1]
    return dlm.prefill(np.array(pending))  # after plain decode rounds


def speculative(
    art: Artifact,
    prompt: np.ndarray,
    params: SamplingParams,
    draft_params: SamplingParams,
    rng: np.random.Generator,
    stats_out: dict,
    draft_length: int | None = None,
) -> Iterator[int]:
    tlm, dlm = art.tlm, art.dlm
    policy = draft_policy(art, draft_length, adapt_costs=not params.do_sample)
    stats = RoundStats(policy.k_max)
    tlm.rewind(0)
    dlm.rewind(0)
    tlm_calls0, dlm_calls0 = tlm.calls, dlm.calls
    token = next_token(tlm.prefill(prompt), params, rng)
    dlm.prefill(prompt)
    pending = [token]  # committed tokens the DLM has not processed; the TLM has not the last one
    try:
        yield token
        while tlm.length < tlm.context:
            k = policy.choose(tlm.context - 1 - tlm.length)  # scoring uses slots length..length+k
            t0 = time.perf_counter()
            if k == 0:  # drafting does not pay now (or no room): exactly an autoregressive step
                token = next_token(tlm.forward(graph_io.DECODE, np.array(pending[-1:]))[0], params, rng)
                pending.append(token)
                policy.observe(0, 0, (time.perf_counter() - t0) * 1e3)
                stats.plain_steps += 1
                yield token
                continue
            # 1. speculate: catch up on pending tokens, then draft k tokens
            logits = _catch_up(dlm, pending)
            # A catch-up on more than a round's 1-2 tokens pays for earlier plain steps: not this k's cost.
            behind_s = time.perf_counter() - t0 if len(pending) > 2 else 0.0
            drafts, q = np.zeros(k, np.int64), np.zeros((k, logits.shape[-1]))
            for i in range(k):
                q[i] = warp(logits, draft_params)
                drafts[i] = sample(q[i], rng)
                if i < k - 1:
                    logits = dlm.forward(graph_io.DECODE, drafts[i : i + 1])[0]
            t1 = time.perf_counter()
            # 2. score x_n, t_1..t_k in one TLM call
            start = tlm.length
            p = warp(tlm.forward(graph_io.score_graph(k), np.concatenate([pending[-1:], drafts])), params)
            t2 = time.perf_counter()
            # 3. accept a prefix (MRS) and emit a correction or bonus token
            n_acc, nxt = (int(x[0]) for x in rejection_sample(drafts[None], q[None], p[None], rng))
            # 4. purge: keep x_n, t_1..t_a in the TLM; the DLM keeps what it processed of them
            tlm.rewind(start + 1 + n_acc)
            dlm.rewind(min(dlm.length, start + 1 + n_acc))
            pending = [int(drafts[k - 1]), nxt] if n_acc == k else [nxt]
            round_s = time.perf_counter() - t0
            policy.observe(k, n_acc, (round_s - behind_s) * 1e3)
            stats.record(k, n_acc)
            stats.dlm_s += t1 - t0
            stats.tlm_s += t2 - t1
            stats.round_s += round_s
            for t in [*drafts[:n_acc].tolist(), nxt]:
                yield int(t)
    finally:
        stats.tlm_calls, stats.dlm_calls = tlm.calls - tlm_calls0, dlm.calls - dlm_calls0
        stats_out.update(stats.summary())
