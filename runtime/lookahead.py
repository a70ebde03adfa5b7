"""Lookahead decoding (Fu et al. 2024): draft-free speculation from a Jacobi n-gram pool.

Each step scores, in one TLM call, the root, a Jacobi window of N-1 levels x W tokens, and up
to G pool n-grams that follow the root (as a trie). Window row (level l, column i) sits at
position p+1+l+i and sees level-0 columns <= i and column i of levels 1..l, so column i read
down the levels is a chain; the last level's argmax guesses the next token of each column. Each
column plus its guess is an N-gram, added to the pool (keyed by its first token, most recent G
per key) once all levels are filled; then the levels shift up and the guesses become the last
level. N-grams of the committed text (prompt included) go into the pool too. Candidates are
deterministic, verified exactly (runtime/rejection.py); the window's KV is never committed.

Whether a lookahead step pays (it costs several decode steps on a CPU) is the draft policy's choice
(runtime/draft_policy.py): it compares the tokens a step accepts and its cost with a plain decode step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from common.recipe import LookaheadSettings
from runtime.proposal import Drafter, Proposal


def window_sees(levels: int, width: int) -> np.ndarray:
    """bool [levels*W, levels*W]: row (l, i) sees level-0 columns <= i and column i of levels 1..l."""
    n = levels * width
    sees = np.zeros((n, n), bool)
    for lv in range(levels):
        for i in range(width):
            row = lv * width + i
            sees[row, : i + 1] = True
            sees[row, [m * width + i for m in range(1, lv + 1)]] = True
    return sees


class Lookahead(Drafter):
    name = "lookahead"

    def __init__(self, settings: LookaheadSettings) -> None:
        self.n, self.w, self.g = settings.ngram, settings.window, settings.guesses
        self.grams: dict[tuple[int, ...], None] = {}  # this step's candidates, offered and then proposed
        self.room, self.fits = 0, False
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.levels: list[np.ndarray] = []
        self.seen = 0  # committed tokens already cut into pool n-grams
        self.windows = 0

    def _add(self, gram: tuple[int, ...]) -> None:
        grams = self.pool.setdefault(gram[0], OrderedDict())
        grams[gram[1:]] = None
        grams.move_to_end(gram[1:])
        if len(grams) > self.g:
            grams.popitem(last=False)

    def _add_text(self, committed: list[int]) -> None:
        for j in range(max(self.seen - self.n + 1, 0), len(committed) - self.n + 1):
            self._add(tuple(committed[j : j + self.n]))
        self.seen = len(committed)

    def start(self, committed: list[int]) -> None:
        self.pool.clear()
        self.seen = 0
        self._add_text(committed)
        # Level 0 starts as tokens of the prompt (deterministic: the generation's random stream is
        # the sampler's alone); later levels fill in from the first steps' guesses.
        text = np.asarray(committed, np.int64)
        self.levels = [np.resize(text[-self.w - 1 : -1] if len(text) > 1 else text, self.w)]

    def offer(self, committed: list[int], room: int) -> tuple[int, int]:
        """A step to offer (1) when there are candidates or the window fits the context (0: neither)."""
        self._add_text(committed)
        self.grams = self.pool.get(committed[-1], {})
        self.room = room
        self.fits = len(self.levels) + self.w - 1 <= room  # else the window's positions would leave the context
        return 0, int(bool(self.grams) or self.fits)

    def propose(self, committed: list[int], k: int) -> Proposal:
        """A whole step (as far as the context allows) when k is not 0; else a plain one."""
        grams, room, fits = self.grams, self.room, self.fits
        if not k or not (grams or fits):
            return Proposal()
        tokens, parents = [], []
        trie: dict[tuple[int, ...], int] = {}
        for gram in reversed(grams):  # most recent first
            gram = gram[:room]
            for d in range(len(gram)):
                if gram[: d + 1] not in trie:
                    tokens.append(gram[d])
                    parents.append(trie[gram[:d]] if d else 0)
                    trie[gram[: d + 1]] = len(tokens)  # its call row
        window = len(self.levels) * self.w if fits else 0
        aux = np.concatenate(self.levels)[:window]
        return Proposal(np.array(tokens, np.int64), np.array(parents, np.int64), None, aux,
                        window_sees(len(self.levels), self.w)[:window, :window])

    def observe(self, proposal: Proposal, accepted: int, emitted: list[int], best: Callable[[int | slice], np.ndarray]
                ) -> None:
        if len(proposal.aux_tokens):  # a window step
            self.windows += 1
            guesses = best(slice(-self.w, None))
            if len(self.levels) == self.n - 1:
                for i in range(self.w):
                    self._add(tuple(int(lv[i]) for lv in self.levels) + (int(guesses[i]),))
                self.levels = self.levels[1:]
            self.levels.append(guesses)

    def summary(self) -> dict:
        return {"lookahead_steps": self.windows, "pool_keys": len(self.pool),
                "pool_ngrams": sum(len(v) for v in self.pool.values())}
