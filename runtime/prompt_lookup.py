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


class TextIndex:
    """A text and where its n-grams ended before its last token, updated as tokens are committed: a round
    reads the latest end of the text's last 3, 2 and 1 tokens (the old match compared the last token with
    every position: ~15 µs a round at 250 tokens, growing with the text). Above ngram = 3, each triple's ends
    are kept too, and a round reads the earlier ends of the last triple for longer matches. Three or four
    entries a token whatever ngram (one per n-gram length held 64 a token at ngram 64)."""

    def __init__(self, ngram: int, text: Sequence[int] = ()) -> None:
        self.ngram, self.text = ngram, []
        self.latest: list[dict] = [{}, {}, {}]  # n = 1, 2, 3: each n-gram's latest end (keys: token, tuples)
        self.triple_ends: dict[tuple[int, int, int], list[int]] = {}  # ngram > 3 only, in text order
        self.extend(text)

    def extend(self, tokens: Sequence[int]) -> None:
        text = self.text
        for token in tokens:
            p = len(text) - 1  # the last token becomes an earlier one: a match can end there now
            if p >= 0:
                self.latest[0][text[p]] = p
            if p >= 1:
                self.latest[1][(text[p - 1], text[p])] = p
            if p >= 2:
                triple = (text[p - 2], text[p - 1], text[p])
                self.latest[2][triple] = p
                if self.ngram > 3:
                    self.triple_ends.setdefault(triple, []).append(p)
            text.append(int(token))

    def match(self, max_draft: int) -> tuple[int, list[int]]:
        """Up to max_draft tokens that followed the latest earlier match of the text's last n tokens, for
        the longest n <= ngram that matches (empty when none does), and that n (0: none)."""
        text, last = self.text, len(self.text) - 1
        most, n_best, end = min(self.ngram, last), 0, -1
        if most > 3:  # the last triple's earlier ends, latest first: each one's match length
            for j in reversed(self.triple_ends.get(tuple(text[last - 2 :]), ())):
                n = 3
                while n < most and n <= j and text[j - n] == text[last - n]:
                    n += 1
                if n > n_best:
                    n_best, end = n, j
                    if n == most:
                        break
        for n in range(min(most, 3), 0, -1):
            if n_best:
                break
            found = self.latest[n - 1].get(text[last] if n == 1 else tuple(text[last - n + 1 :]))
            if found is not None:
                n_best, end = n, found
        return n_best, text[end + 1 : end + 1 + max_draft] if n_best else []


TABLE_KIND = 100  # kinds of draft: a match of n tokens is n (n <= 64); a table guess 100 + its confidence in tenths


def draft(text: Sequence[int] | TextIndex, settings: PromptLookupSettings, table: NgramTable | None
          ) -> tuple[int, np.ndarray]:
    """This round's draft and its kind (0: none). A match of one token was right 18% of the time on the
    default recipe's answers, the table's guesses at 0.4-0.5 confidence about a third, at 0.9 and
    above about 80% (docs/benchmarks-history.md): the table takes over where the text offers only a 1-token
    match."""
    index = text if isinstance(text, TextIndex) else TextIndex(settings.ngram, text)
    n, found = index.match(settings.max_draft)
    if n < 2 and table is not None and settings.table:
        confidence, guessed = table.chain(index.text, settings.max_draft, settings.min_confidence)
        kind = TABLE_KIND + int(confidence * 10)
        if guessed:
            return kind, np.asarray(guessed, np.int64)
    return n, np.asarray(found, np.int64)


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
        self.index = TextIndex(settings.ngram)  # the committed text, indexed as it grows
        self.matched_rounds = self.table_rounds = 0

    def start(self, committed: list[int]) -> None:
        self.index = TextIndex(self.settings.ngram, committed)

    def offer(self, committed: list[int], room: int) -> tuple[int, int]:
        # The policy weighs each kind apart: on the default recipe's answers, a 1-token match was right
        # 18% of the time, a 3-token one 63% (docs/benchmarks-history.md).
        self.index.extend(committed[len(self.index.text):])  # what followed
        kind, found = draft(self.index, self.settings, self.table)
        self.found = found[:room]
        self.matched_rounds += 0 < kind < TABLE_KIND
        self.table_rounds += kind >= TABLE_KIND
        return kind, len(self.found)

    def propose(self, committed: list[int], k: int) -> Proposal:
        return Proposal.chain(self.found[:k])

    def summary(self) -> dict:
        return {"rounds_with_a_match": self.matched_rounds, "rounds_with_a_table_guess": self.table_rounds}
