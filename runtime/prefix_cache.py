"""Prefix cache: finished sequences' KV stays in the forest's slots, found again by token prefix.

A radix tree over token ids: each edge holds a run of tokens and the cache slot of each one, so a
new prompt's longest cached prefix is a walk from the root, and its slots become the new
branch's view (forest.py: a branch is the set of slots it sees; K is stored after RoPE, so only
a token's position matters, never its slot). Reusing KV computed in another call is exact only
because the artifact is batch invariant (compiler/invariance.py): a row's KV is bitwise the same
whatever call computed it. Slots are given back least recently used leaf first, when live
requests need them (vLLM's automatic prefix caching and SGLang's RadixAttention work the same way).
"""

from __future__ import annotations

import numpy as np


class _Node:
    def __init__(self, tokens: np.ndarray, slots: np.ndarray, parent: _Node | None, used: int) -> None:
        self.tokens, self.slots, self.parent, self.used = tokens, slots, parent, used
        self.children: dict[int, _Node] = {}

    def split(self, at: int) -> None:
        """Keep the edge's first `at` tokens here; the rest become the only child."""
        tail = _Node(self.tokens[at:], self.slots[at:], self, self.used)
        tail.children = self.children
        for child in tail.children.values():
            child.parent = tail
        self.tokens, self.slots, self.children = self.tokens[:at], self.slots[:at], {int(tail.tokens[0]): tail}


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    def __init__(self, capacity: int) -> None:
        self.root = _Node(np.zeros(0, np.int64), np.zeros(0, np.int64), None, 0)
        self.held = np.zeros(capacity, dtype=bool)  # slots whose KV the tree keeps
        self.evicted = 0  # tokens given back so far
        self.tokens = 0  # slots held now (counted as they change: a step reads it)
        self._clock = 0

    def _walk(self, tokens: np.ndarray):
        """Yield (node, tokens of its edge that match) down the longest cached prefix of `tokens`."""
        node, i = self.root, 0
        while i < len(tokens) and (child := node.children.get(int(tokens[i]))) is not None:
            n = _common(child.tokens, tokens[i:])
            yield child, n
            if n < len(child.tokens):
                return
            node, i = child, i + n

    def match(self, tokens: np.ndarray) -> np.ndarray:
        """The slots holding the longest cached prefix of `tokens`, in position order (marked used now)."""
        self._clock += 1
        found = []
        for node, n in self._walk(tokens):
            node.used = self._clock
            found.append(node.slots[:n])
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    def insert(self, tokens: np.ndarray, slots: np.ndarray) -> None:
        """Keep a sequence's KV (`slots[i]` holds token i). Where the tree already holds a prefix, its
        slots stay and the sequence's own copies of it are left to be freed."""
        self._clock += 1
        node, i = self.root, 0
        for child, n in self._walk(tokens):
            if n < len(child.tokens):
                child.split(n)
            child.used = self._clock
            node, i = child, i + n
        if i < len(tokens):
            leaf = _Node(np.array(tokens[i:], np.int64), np.array(slots[i:], np.int64), node, self._clock)
            node.children[int(leaf.tokens[0])] = leaf
            self.tokens += int(np.count_nonzero(~self.held[leaf.slots]))
            self.held[leaf.slots] = True

    def evict(self, wanted: int, pinned: np.ndarray) -> None:
        """Drop least recently used leaves until `wanted` slots are neither held nor `pinned` (seen by a
        live branch), or nothing droppable is left. A leaf whose slots are all pinned frees nothing
        and stays."""
        while int((~(self.held | pinned)).sum()) < wanted:
            leaves = [n for n in self._nodes() if not n.children and not pinned[n.slots].all()]
            if not leaves:
                return
            leaf = min(leaves, key=lambda n: n.used)
            self.tokens -= int(np.count_nonzero(self.held[leaf.slots]))
            self.held[leaf.slots] = False
            self.evicted += len(leaf.slots)
            del leaf.parent.children[int(leaf.tokens[0])]

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
