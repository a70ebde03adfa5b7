"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the text's tail.

Input-grounded generation (editing code, summarising, answering from a document) repeats spans
of its input; matching the last n tokens (n = ngram, falling back to shorter) against the prompt
and what was generated proposes those spans for free. The draft is a deterministic chain, verified
exactly (runtime/rejection.py). How much of it to score is the draft policy's choice (its cost
model with free drafts), and no match means a plain decode step.
"""

from __future__ import annotations

import numpy as np

from common.recipe import PromptLookupSettings
from runtime.draft_policy import DraftPolicy
from runtime.proposal import Proposal


def lookup(text: np.ndarray, ngram: int, max_draft: int) -> np.ndarray:
    """Up to max_draft tokens that followed the latest earlier match of text's last n tokens,
    for the longest n <= ngram that matches (empty when none does)."""
    return lookup_match(text, ngram, max_draft)[1]


def lookup_match(text: np.ndarray, ngram: int, max_draft: int) -> tuple[int, np.ndarray]:
    """lookup's tokens, and the n that matched (0: none). Runs every round, so it only compares the
    last token everywhere, then its few earlier occurrences' predecessors."""
    last = len(text) - 1
    ends = np.flatnonzero(text[:-1] == text[-1]) if last > 0 else text[:0]  # where a match can end
    for n in range(min(ngram, last), 0, -1):
        hits = ends[ends >= n - 1]
        for j in range(1, n):
            hits = hits[text[hits - j] == text[last - j]]
        if len(hits):
            return n, text[hits[-1] + 1 : hits[-1] + 1 + max_draft]
    return 0, text[:0]


class PromptLookup:
    name = "prompt_lookup"

    def __init__(self, settings: PromptLookupSettings, policy: DraftPolicy) -> None:
        self.settings, self.policy = settings, policy
        self.matched_rounds = 0

    def start(self, committed: list[int]) -> None:
        pass  # a kept policy was told of the new generation when it was handed out

    def propose(self, committed: list[int], room: int) -> Proposal:
        s = self.settings
        n, found = lookup_match(np.asarray(committed, np.int64), s.ngram, s.max_draft)
        # The policy weighs each match length apart: on the default recipe's answers, a 1-token match
        # was right 18% of the time, a 3-token one 63% (docs/benchmarks.md).
        k = self.policy.choose(min(room, len(found)), kind=n) if len(found) else 0
        self.matched_rounds += bool(len(found))
        return Proposal.chain(found[:k])

    def observe(self, proposal: Proposal, accepted: int, emitted: list[int], logits: np.ndarray,
                round_ms: float) -> None:
        self.policy.observe(len(proposal.tokens), accepted, round_ms)

    def summary(self) -> dict:
        return {"rounds_with_a_match": self.matched_rounds}
