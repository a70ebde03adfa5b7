"""Drafting with a draft model (DLM): catch up on committed tokens, then sample a chain of k.

A request's drafter is a branch of a forest over the DLM's cache (the engine's, runtime/engine.py).
`propose_batch` drafts for every drafting request of a step together: each one's i-th draft comes from
one DLM call, and the first call also catches each branch up on the committed tokens it has not seen
(the whole prompt at a request's first draft: while its policy decodes plainly the DLM never runs, and
does not evict the TLM's weights from the caches). Rejected drafts' KV is trimmed from the branch; a
finished request's DLM prefix is kept for reuse as the TLM's is, so a chat's next turn catches up on
its new tokens only. Each round's length is the engine's draft policy's.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from runtime.forest import Branch, Forest
from runtime.proposal import Drafter, Proposal
from runtime.sampling import SamplingParams, sample, warp


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, forest: Forest, params: SamplingParams, rng: np.random.Generator,
                 counters: dict | None = None) -> None:
        """`counters`: the engine's stats, whose "draft_cached_tokens" counts the DLM prefixes reused."""
        self.forest, self.params, self.rng, self.counters = forest, params, rng, counters
        self.branch: Branch | None = None  # its view of the DLM's cache, from its first draft on
        self.fed: np.ndarray | None = None  # this round's slots of fed drafts: trimmed past the accepted ones
        self.k_used: dict[int, int] = {}
        self.calls0 = forest.runner.calls

    @property
    def used(self) -> int:
        """DLM cache slots it holds (the engine's capacity rule reserves the rest)."""
        return 0 if self.branch is None else self.branch.length

    def offer(self, committed: list[int], room: int) -> tuple[int, int]:
        return 0, room  # one kind of draft, as long as the context allows

    def propose(self, committed: list[int], k: int) -> Proposal | None:
        return self.propose_batch([self], [committed], [k])[0]

    @staticmethod
    def propose_batch(drafters: list[DraftModelDrafter], texts: list[list[int]], ks: list[int]
                      ) -> list[Proposal | None]:
        """Each drafter's chain of its length (None: the DLM gave NaN/Inf logits for it), the i-th drafts of
        all of them in one call."""
        out: list[Proposal | None] = [Proposal()] * len(drafters)  # length 0: a plain step
        going = [i for i, k in enumerate(ks) if k]
        if not going:
            return out
        forest = drafters[going[0]].forest
        assert all(drafters[i].forest is forest for i in going), "one call: drafters over one DLM forest"
        runner, vocab = forest.runner, forest.runner.dims.vocab_size
        for i in going:
            d = drafters[i]
            d.k_used[ks[i]] = d.k_used.get(ks[i], 0) + 1
            if d.branch is None:  # the KV of a cached prefix is reused
                hit = forest.cached_prefix(texts[i])
                d.branch = forest.attach(hit)
                if d.counters is not None:
                    d.counters["draft_cached_tokens"] += len(hit)
            d.fed = None
        # greedy on a device: each row's token crosses to the host, not its logits
        fetch = not runner.greedy_outputs or any(drafters[i].params.do_sample for i in going)
        drafts = {i: ([], np.zeros((ks[i], vocab))) for i in going}  # tokens, q (a row per draft)
        chains = [texts[i][drafters[i].branch.length :] for i in going]  # catch up first
        for step in range(max(ks)):
            rows, slots = forest.extend_rows([drafters[i].branch for i in going], chains, [1] * len(chains),
                                             check=False, fetch=fetch)
            still, chains = [], []
            for i, row, s in zip(going, rows, slots, strict=True):
                d = drafters[i]
                if step:
                    d.fed = s if d.fed is None else np.concatenate([d.fed, s])
                if not (np.isfinite(row).all() if fetch else row[0] >= 0):
                    out[i] = None
                    drafts.pop(i)
                    continue
                tokens, q = drafts[i]
                if d.params.do_sample:
                    q[step] = warp(row[0], d.params)
                    tokens.append(int(sample(q[step], d.rng)))
                else:  # a greedy draft is the argmax, q its one-hot (what warp gives), no random draw
                    tokens.append(int(np.argmax(row[0]) if fetch else row[0]))
                    q[step, tokens[-1]] = 1.0
                if step + 1 < ks[i]:
                    still.append(i)
                    chains.append(tokens[-1:])
            going = still
            if not going:
                break
        for i, (tokens, q) in drafts.items():
            out[i] = Proposal.chain(np.array(tokens), q)
        return out

    def observe(self, proposal: Proposal, accepted: int, emitted: list[int], best: Callable[[int | slice], np.ndarray]
                ) -> None:
        if self.fed is not None:  # the rejected drafts' KV (the last draft was never fed)
            self.forest.trim(self.branch, self.fed[accepted:])
            self.fed = None

    def end(self, text: list[int] | None) -> None:
        """Keep its DLM prefix of `text` for reuse (None: an error, nothing kept)."""
        if self.branch is not None:
            self.forest.keep(self.branch, text)
            self.branch = None

    def summary(self) -> dict:
        return {"draft_lengths_used": dict(sorted(self.k_used.items())),
                "dlm_calls": self.forest.runner.calls - self.calls0}
