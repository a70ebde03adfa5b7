"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the text's tail.

Input-grounded generation (editing code, summarising, answering from a document) repeats spans
of its input; matching the last n tokens (n = ngram, falling back to shorter) against the prompt
and what was generated proposes those spans for free. Where that finds no match of two tokens or
more and the artifact ships an n-gram table of its TLM's own answers (common/ngram_table.py), the
table's guesses are the draft. The draft is a deterministic chain, verified exactly
(runtime/rejection.py). How much of it to score is the draft policy's choice (runtime/draft_policy.py:
free drafts, acceptance per kind of draft), and no draft means a plain decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.ngram_table import NgramTable
from common.recipe import PromptLookupSettings
from runtime.proposal import Drafter, Proposal


def lookup_match(text: np.ndarray, ngram: int, max_draft: int) -> tuple[int, np.ndarray]:
    """Up to max_draft tokens that followed the latest earlier match of text's last n tokens, for the
    longest n <= ngram that matches (empty when none does), and that n (0: none). Runs every round,
    so it only compares the last token everywhere, then its few earlier occurrences' predecessors."""
    last = len(text) - 1
    ends = np.flatnonzero(text[:-1] == text[-1]) if last > 0 else text[:0]  # where a match can end
    for n in range(min(ngram, last), 0, -1):
        hits = ends[ends >= n - 1]
        for j in range(1, n):
            hits = hits[text[hits - j] == text[last - j]]
        if len(hits):
            return n, text[hits[-1] + 1 : hits[-1] + 1 + max_draft]
    return 0, text[:0]


TABLE_KIND = 100  # kinds of draft: a match of n tokens is n (n <= 64); a table guess 100 + its confidence in tenths


def draft(text: Sequence[int], settings: PromptLookupSettings, table: NgramTable | None) -> tuple[int, np.ndarray]:
    """This round's draft and its kind (0: none). A match of one token was right 18% of the time on the
    default recipe's answers, the table's guesses at 0.4-0.5 confidence about a third, at 0.9 and
    above about 80% (docs/benchmarks-history.md): the table takes over where the text offers only a 1-token
    match."""
    n, found = lookup_match(np.asarray(text, np.int64), settings.ngram, settings.max_draft)
    if n < 2 and table is not None and settings.table:
        confidence, guessed = table.chain(text, settings.max_draft, settings.min_confidence)
        kind = TABLE_KIND + int(confidence * 10)
        if guessed:
            return kind, np.asarray(guessed, np.int64)
    return n, found


def table_priors(table: NgramTable | None) -> dict[int, float]:
    """The policy's prior acceptance of each kind of draft, from the table's record of the answers it
    did not count (recipes/ngram_draft.py): how often a table guess that sure was right (else the
    confidence itself), and a text match of that length. A fresh policy drafted 3 tokens at a time on
    0.3-sure guesses with the default prior of 0.5, and lost its first answers."""
    if table is None:
        return {}
    held_out = table.record.get("held_out", {})
    rates = {TABLE_KIND + round(float(c) * 10): r["right"] for c, r in held_out.get("by_confidence", {}).items()}
    matches = {int(n): r["right"] for n, r in held_out.get("by_match_length", {}).items()}
    return matches | {TABLE_KIND + tenth: rates.get(TABLE_KIND + tenth, tenth / 10) for tenth in range(11)}


class PromptLookup(Drafter):
    name = "prompt_lookup"

    def __init__(self, settings: PromptLookupSettings, table: NgramTable | None) -> None:
        self.settings, self.table = settings, table
        self.found = np.zeros(0, np.int64)  # this step's draft, offered and then proposed
        self.text = np.zeros(0, np.int64)  # the committed text, converted as it grows (3,000 tokens at once: ~35 µs)
        self.matched_rounds = self.table_rounds = 0

    def start(self, committed: list[int]) -> None:
        self.text = np.asarray(committed, np.int64)

    def offer(self, committed: list[int], room: int) -> tuple[int, int]:
        # The policy weighs each kind apart: on the default recipe's answers, a 1-token match was right
        # 18% of the time, a 3-token one 63% (docs/benchmarks-history.md).
        self.text = np.concatenate([self.text, np.asarray(committed[len(self.text):], np.int64)])  # what followed
        kind, found = draft(self.text, self.settings, self.table)
        self.found = found[:room]
        self.matched_rounds += 0 < kind < TABLE_KIND
        self.table_rounds += kind >= TABLE_KIND
        return kind, len(self.found)

    def propose(self, committed: list[int], k: int) -> Proposal:
        return Proposal.chain(self.found[:k])

    def summary(self) -> dict:
        return {"rounds_with_a_match": self.matched_rounds, "rounds_with_a_table_guess": self.table_rounds}
