"""Drafting with a draft model (DLM): catch up on committed tokens, then sample a chain of k.

Invariant between rounds: the DLM has processed the committed tokens except `pending` (1 token,
2 after a full accept (the last draft and the bonus token), more after plain decode steps, all of
them before the first draft of a generation), which it catches up on before drafting. Rejected
drafts are purged by rewinding its cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from common import graph_io
from runtime.draft_policy import DraftPolicy
from runtime.model_runner import ModelRunner
from runtime.proposal import Proposal
from runtime.sampling import SamplingParams, sample, warp


class DraftModelDrafter:
    name = "draft"

    def __init__(self, dlm: ModelRunner, params: SamplingParams, policy: DraftPolicy,
                 rng: np.random.Generator) -> None:
        self.dlm, self.params, self.policy, self.rng = dlm, params, policy, rng
        self.pending: list[int] = []
        self.kept = 0  # DLM cache length after catching up: the root's slot + 1
        self.behind_s = 0.0
        self.ran: set[str] = set()  # DLM graphs run so far (a graph's first runs are cold)
        self.cold = False  # this round ran a DLM graph for the first time
        self.k_used: dict[int, int] = {}
        self.calls0 = dlm.calls

    def start(self, committed: list[int]) -> None:
        # The prompt is fed at the first draft (a catch-up), not now: while the policy decodes
        # plainly the DLM never runs, and does not evict the TLM's weights from the caches.
        self.dlm.rewind(0)
        self.pending = list(committed)

    def _catch_up_graph(self) -> str:
        """The DLM graph that feeds it the pending tokens: prefill after plain decode rounds."""
        n = len(self.pending)
        return graph_io.DECODE if n == 1 else graph_io.CATCHUP if n == 2 else graph_io.PREFILL

    def _catch_up(self, fetch: bool) -> np.ndarray | None:
        """Feed the DLM the committed tokens it has not seen; returns the last one's logits (`fetch`)."""
        pending, graph = np.array(self.pending), self._catch_up_graph()
        if graph == graph_io.PREFILL:
            return self.dlm.prefill(pending, fetch)
        logits = self.dlm.forward(graph, pending, fetch)
        return None if logits is None else logits[-1]

    def _graphs(self, k: int) -> set[str]:
        """The DLM graphs a round of k drafts runs: its catch-up's, and decode for drafts after the first."""
        return {self._catch_up_graph()} | ({graph_io.DECODE} if k > 1 else set())

    def propose(self, committed: list[int], room: int) -> Proposal:
        k = self.policy.choose(room)
        if k == 0:  # drafting does not pay now (or no room): a plain decode step
            return Proposal()
        self.k_used[k] = self.k_used.get(k, 0) + 1
        graphs = self._graphs(k)
        self.cold, self.ran = not graphs <= self.ran, self.ran | graphs
        t0 = time.perf_counter()
        fetch = self.params.do_sample or not self.dlm.greedy_outputs  # greedy on a device: tokens, not logits
        logits = self._catch_up(fetch)
        # A catch-up on more than a round's 1-2 tokens pays for earlier plain steps: not this k's cost.
        self.behind_s = time.perf_counter() - t0 if len(self.pending) > 2 else 0.0
        self.kept, self.pending = self.dlm.length, []
        drafts, q = np.zeros(k, np.int64), np.zeros((k, self.dlm.dims.vocab_size))
        for i in range(k):
            if self.params.do_sample:
                q[i] = warp(logits, self.params)
                drafts[i] = sample(q[i], self.rng)
            else:  # a greedy draft is the argmax, q its one-hot (what warp gives), no random draw
                drafts[i] = np.argmax(logits) if fetch else self.dlm.argmax()[-1]
                q[i, drafts[i]] = 1.0
            if i < k - 1:
                logits = self.dlm.forward(graph_io.DECODE, drafts[i : i + 1], fetch)
                logits = None if logits is None else logits[0]
        return Proposal.chain(drafts, q)

    def observe(self, proposal: Proposal, accepted: int, emitted: list[int], best: Callable[[int | slice], np.ndarray],
                round_ms: float) -> None:
        k = len(proposal.tokens)
        if k:  # keep what the DLM processed of the root and the accepted drafts
            self.dlm.rewind(min(self.dlm.length, self.kept + accepted))
            self.pending = [int(proposal.tokens[-1]), emitted[-1]] if accepted == k else emitted[-1:]
        else:
            self.pending.append(emitted[-1])
        self.policy.observe(k, accepted, round_ms - self.behind_s * 1e3, self.behind_s * 1e3, self.cold)
        self.behind_s, self.cold = 0.0, False

    def summary(self) -> dict:
        return {"k": self.policy.k_max, "draft_lengths_used": dict(sorted(self.k_used.items())),
                "dlm_calls": self.dlm.calls - self.calls0}
