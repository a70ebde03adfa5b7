"""What a drafter hands the round loop: a token tree to verify, plus any auxiliary rows it needs.

A drafter is a small object with a narrow interface (`Drafter`): `start` once per request, each round
`offer` what it could draft (its kind and most tokens) and `propose` a tree of the length the engine's
draft policy chose (runtime/draft_policy.py), `observe` what the TLM accepted, `end`. A drafter class
may also offer `propose_batch(drafters, texts, lengths)`, which the engine calls once for all its
requests of that class in a step (a draft model: every request's i-th draft in one call). The engine
(runtime/engine.py) scores every proposal the same way: one TLM call over the root, the tree and
the auxiliary rows (row layout and mask conventions: common/graph_io.py), exact verification
(runtime/rejection.py), a commit of the accepted path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from common import graph_io

_NONE = np.zeros(0, np.int64)


@dataclass
class Proposal:
    """A tree of m drafted tokens under the root, and w auxiliary rows whose logits only the drafter reads.

    tokens/parents [m]: node i is call row i + 1; its parent is a call row (0 = the root).
    q [m, V]: the distributions a draft model sampled the (chain) tokens from; None for
    deterministic candidates. aux_tokens [w] and aux_sees bool [w, w]: rows that see the root,
    the committed cache and the auxiliary rows aux_sees says (lookahead's Jacobi window).
    """

    tokens: np.ndarray = field(default_factory=lambda: _NONE)
    parents: np.ndarray = field(default_factory=lambda: _NONE)
    q: np.ndarray | None = None
    aux_tokens: np.ndarray = field(default_factory=lambda: _NONE)
    aux_sees: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), bool))
    _rows: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def chain(cls, tokens: np.ndarray, q: np.ndarray | None = None) -> Proposal:
        return cls(np.asarray(tokens, np.int64), np.arange(len(tokens)), q)

    @property
    def empty(self) -> bool:
        """No tree and no auxiliary rows: the round is a plain decode step."""
        return not len(self.tokens) and not len(self.aux_tokens)

    @property
    def depth(self) -> int:
        """Length of the longest root-to-leaf path (how many cache slots an accepted path can take)."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return max(depth)

    def rows(self, root: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The call: tokens [n] (root, tree, aux), the tree's parents [1 + m] and sees bool [n, n]
        (made once: the engine asks when it builds the call and again when it verifies)."""
        if self._rows is None or self._rows[0] != root:
            parents = np.concatenate([[-1], self.parents]).astype(np.int64)
            tree, n = len(parents), len(parents) + len(self.aux_tokens)
            sees = np.zeros((n, n), bool)
            sees[:tree, :tree] = graph_io.tree_sees(parents)
            sees[tree:, 0] = True
            sees[tree:, tree:] = self.aux_sees
            self._rows = root, (np.concatenate([[root], self.tokens, self.aux_tokens]).astype(np.int64), parents, sees)
        return self._rows[1]


class Drafter(Protocol):
    name: str

    def start(self, committed: list[int]) -> None:
        """A new generation: `committed` is the prompt and the first generated token."""

    def offer(self, committed: list[int], room: int) -> tuple[int, int]:
        """What this round could draft: its kind (the policy's acceptance is estimated per kind) and the
        most tokens (at most `room`, the context's; 0: nothing to draft)."""

    def propose(self, committed: list[int], k: int) -> Proposal | None:
        """This round's tree of length k, as offered (k = 0, or an empty tree: a plain decode step; None:
        the drafter's model gave NaN/Inf logits, and the request ends with an error)."""

    def observe(self, proposal: Proposal, accepted: int, emitted: list[int], best: Callable[[int | slice], np.ndarray]
                ) -> None:
        """The TLM accepted `accepted` tree tokens and emitted `emitted` (those plus one); `best(rows)`
        gives call rows' greedy tokens (sampling.argmax_rows)."""

    def end(self, text: list[int] | None) -> None:
        """The request ended with this text (None: an error); a drafter with a cache of its own keeps or frees it."""

    def summary(self) -> dict:
        """Method-specific metrics."""
