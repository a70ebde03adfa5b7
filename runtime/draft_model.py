"""Drafting with a draft model (DLM): catch up on committed tokens, then sample a chain of k.

`DraftModelDrafter` drafts for one generation on the DLM's own cache. Invariant between rounds: the
DLM has processed the committed tokens except `pending` (1 token, 2 after a full accept (the last draft
and the bonus token), more after plain decode steps, all of them before the first draft of a
generation), which it catches up on before drafting. Rejected drafts are purged by rewinding its cache.

`BatchDraftModel` drafts for many requests at once (the server's batch): each is a branch of a forest
over the DLM's cache, and every drafting request's i-th draft comes from one DLM call
(`propose_batch`); a branch catches up on what it has not seen in the call of its first draft, and
its rejected drafts are trimmed from it. A finished request's DLM prefix is kept for reuse, as the TLM's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from common import graph_io
from runtime.draft_policy import DraftPolicy
from runtime.forest import Branch, Forest
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

    def end(self, text: list[int] | None) -> None:
        pass  # the next generation's `start` rewinds the DLM

    def summary(self) -> dict:
        return {"k": self.policy.k_max, "draft_lengths_used": dict(sorted(self.k_used.items())),
                "dlm_calls": self.dlm.calls - self.calls0}


class BatchDraftModel:
    name = "draft"

    def __init__(self, forest: Forest, params: SamplingParams, rng: np.random.Generator, counters: dict) -> None:
        """`counters`: the engine's stats, whose "draft_cached_tokens" counts the DLM prefixes reused."""
        self.forest, self.params, self.rng, self.counters = forest, params, rng, counters
        self.branch: Branch | None = None  # its DLM view; a cached prefix of its text is reused
        self.fed: np.ndarray | None = None  # this round's slots of fed drafts: trimmed past the accepted ones

    def start(self, committed: list[int]) -> None:
        pass  # the DLM is fed at the first draft (a catch-up): while nothing drafts it never runs

    @property
    def used(self) -> int:
        """DLM cache slots it holds."""
        return 0 if self.branch is None else self.branch.length

    def propose(self, committed: list[int], room: int) -> Proposal | None:
        return self.propose_batch([self], [committed], [room])[0]

    @staticmethod
    def propose_batch(drafters: list[BatchDraftModel], texts: list[list[int]], rooms: list[int]
                      ) -> list[Proposal | None]:
        """Each drafter's chain of up to `room` drafts (None: the DLM gave NaN/Inf logits for it), the i-th
        drafts of all of them in one call."""
        out: list[Proposal | None] = [Proposal()] * len(drafters)
        going = [i for i, room in enumerate(rooms) if room]
        if not going:
            return out
        forest = drafters[going[0]].forest
        for i in going:
            d = drafters[i]
            if d.branch is None:  # the draft model's KV of a cached prefix is reused too
                hit = forest.cached_prefix(texts[i])
                d.branch = forest.attach(hit)
                d.counters["draft_cached_tokens"] += len(hit)
            d.fed = None
        drafts = {i: ([], []) for i in going}  # tokens, q
        chains = [texts[i][drafters[i].branch.length :] for i in going]  # catch up first
        for step in range(max(rooms)):
            rows, slots = forest.extend_rows([drafters[i].branch for i in going], chains, [1] * len(chains),
                                             check=False)
            still, chains = [], []
            for i, row, s in zip(going, rows, slots, strict=True):
                d = drafters[i]
                if step:
                    d.fed = s if d.fed is None else np.concatenate([d.fed, s])
                if not np.isfinite(row).all():
                    out[i] = None
                    drafts.pop(i)
                    continue
                tokens, q = drafts[i]
                q.append(warp(row[0], d.params))
                tokens.append(int(sample(q[-1], d.rng)))
                if step + 1 < rooms[i]:
                    still.append(i)
                    chains.append(tokens[-1:])
            going = still
            if not going:
                break
        for i, (tokens, q) in drafts.items():
            out[i] = Proposal.chain(np.array(tokens), np.stack(q))
        return out

    def observe(self, proposal: Proposal, accepted: int, emitted: list[int], best: Callable[[int | slice], np.ndarray],
                round_ms: float) -> None:
        if self.fed is not None:  # the rejected drafts' KV (the last draft was never fed)
            self.forest.trim(self.branch, self.fed[accepted:])
            self.fed = None

    def end(self, text: list[int] | None) -> None:
        """The request ended: keep its DLM prefix of `text` for reuse (None: an error, nothing kept)."""
        if self.branch is not None:
            if text is None:
                self.forest.release(self.branch)
            else:
                self.forest.keep(self.branch, text)
            self.branch = None

    def summary(self) -> dict:
        return {}
