"""Speculative decoding: the DLM drafts k tokens, the TLM scores them in one call, MRS decides.

Invariants between rounds (`committed` = prompt + emitted tokens):
- the TLM has processed committed[:-1]: the last token is scored at the start of the next round;
- the DLM has processed committed[:dlm.length]; the rest (`pending`, 1 or 2 tokens) it catches up
  on before drafting (2 after a full accept: the last draft and the bonus token).
Purging is a rewind of each cache's valid length: rejected tokens are never attended to again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from runtime.artifact import Artifact
from runtime.rejection import rejection_sample
from runtime.sampling import SamplingParams, next_token, sample, warp


class RoundStats:
    """Counters for the metrics users expect from SpD (acceptance, calls, step costs)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.rounds = self.drafted = self.accepted = self.tlm_calls = self.dlm_calls = 0  # calls: set at the end
        self.drafted_at = np.zeros(k, np.int64)
        self.accepted_at = np.zeros(k, np.int64)
        self.tlm_s = self.dlm_s = self.round_s = 0.0

    def record(self, k: int, n_acc: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += n_acc
        self.drafted_at[:k] += 1
        self.accepted_at[:n_acc] += 1

    def summary(self) -> dict:
        a = self.accepted / self.drafted if self.drafted else 0.0
        tlm_step = self.tlm_s / max(self.rounds, 1)
        dlm_step = self.dlm_s / max(self.drafted, 1)  # a round makes k DLM calls for k drafts
        c = dlm_step / tlm_step if tlm_step else 0.0
        k = self.k
        predicted = (1 - a ** (k + 1)) / ((1 - a) * (c * k + 1)) if a < 1 else (k + 1) / (c * k + 1)
        host = self.round_s - self.tlm_s - self.dlm_s
        return {
            "k": k,
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


def speculative(
    art: Artifact,
    prompt: np.ndarray,
    params: SamplingParams,
    draft_params: SamplingParams,
    rng: np.random.Generator,
    stats_out: dict,
) -> Iterator[int]:
    tlm, dlm, k_max = art.tlm, art.dlm, art.manifest.k
    stats = RoundStats(k_max)
    tlm.rewind(0)
    dlm.rewind(0)
    tlm_calls0, dlm_calls0 = tlm.calls, dlm.calls
    token = next_token(tlm.prefill(prompt), params, rng)
    dlm.prefill(prompt)
    pending = [token]
    try:
        yield token
        while tlm.length < tlm.context:
            k = min(k_max, tlm.context - 1 - tlm.length)  # scoring uses slots length..length+k
            if k == 0:  # one slot left: a plain decode step ends the sequence
                yield next_token(tlm.forward("decode", np.array(pending[-1:]))[0], params, rng)
                return
            t0 = time.perf_counter()
            # 1. speculate: catch up on pending tokens, then draft k tokens
            graph = "catchup" if len(pending) == 2 else "decode"
            logits = dlm.forward(graph, np.array(pending))[-1]
            drafts, q = np.zeros(k, np.int64), np.zeros((k, logits.shape[-1]))
            for i in range(k):
                q[i] = warp(logits, draft_params)
                drafts[i] = sample(q[i], rng)
                if i < k - 1:
                    logits = dlm.forward("decode", drafts[i : i + 1])[0]
            t1 = time.perf_counter()
            # 2. score x_n, t_1..t_k in one TLM call
            start = tlm.length
            p = warp(tlm.forward("score", np.concatenate([pending[-1:], drafts])), params)
            t2 = time.perf_counter()
            # 3. accept a prefix (MRS) and emit a correction or bonus token
            n_acc, nxt = (int(x[0]) for x in rejection_sample(drafts[None], q[None], p[None], rng))
            # 4. purge: keep x_n, t_1..t_a in the TLM; the DLM keeps what it processed of them
            tlm.rewind(start + 1 + n_acc)
            dlm.rewind(min(dlm.length, start + 1 + n_acc))
            pending = [int(drafts[k - 1]), nxt] if n_acc == k else [nxt]
            stats.record(k, n_acc)
            stats.dlm_s += t1 - t0
            stats.tlm_s += t2 - t1
            stats.round_s += time.perf_counter() - t0
            for t in [*drafts[:n_acc].tolist(), nxt]:
                yield int(t)
    finally:
        stats.tlm_calls, stats.dlm_calls = tlm.calls - tlm_calls0, dlm.calls - dlm_calls0
        stats_out.update(stats.summary())
