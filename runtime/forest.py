"""A forest of sequences over one KV cache (MultiDecode): many branches advance in one call.

A branch is the set of cache slots it sees (`view`, bool [C]): its shared prefix and its own
tokens. A new token's KV goes into any free slot; its mask row is its branch's view plus itself,
its position the branch's length, so every branch's logits equal a plain chain forward of its own
tokens (graph_io's conventions; K is stored after RoPE, so a slot's index does not matter).
Forking a branch copies its view (C booleans), never KV; a slot is free when no live branch sees
it, so a released branch's own slots are reused at once while a prefix shared with live branches
stays. With a prefix cache (runtime/prefix_cache.py), a finished branch's slots are kept
(`keep`) and a new branch starts from the longest cached prefix of its prompt (`cached_prefix`);
cached slots are given back, least recently used first, when a new token needs one.
"""

from __future__ import annotations

import itertools

import numpy as np

from common import graph_io
from runtime.model_runner import ModelRunner
from runtime.prefix_cache import PrefixCache


class CapacityError(ValueError):
    """A request whose branches do not fit the cache's slots."""


class Branch:
    def __init__(self, view: np.ndarray, order: list[int]) -> None:
        self.view = view
        self.order = order  # the slot of each token it sees, in position order

    @property
    def length(self) -> int:
        """Tokens it sees: the position of its next token."""
        return len(self.order)


class Forest:
    def __init__(self, runner: ModelRunner, max_rows: int | None = None, prefix_cache: bool = False) -> None:
        """`max_rows` caps the rows per call (default: the largest graph's T); more rows are split
        into several calls per step, each seeing only the cache and its own branch's rows.
        `prefix_cache` keeps finished branches' KV for later prompts (exact on batch-invariant graphs)."""
        largest = max(g.tokens for g in runner.graphs.values())
        if max_rows is not None and not 1 <= max_rows <= largest:
            raise ValueError(f"rows per call must lie in [1, {largest}] (the largest compiled graph), got {max_rows}")
        self.runner = runner
        self.max_rows, self._largest = max_rows or largest, largest
        self.live: list[Branch] = []
        self.cache = PrefixCache(runner.context) if prefix_cache else None
        self._writes = runner.writes  # the runner's cache as this forest last left it
        self._tri = np.tri(largest, dtype=bool)  # a chain's rows see their predecessors
        self._low = 0  # every slot below it is taken: the search for free ones starts there
        self._zero = np.zeros(1, np.int64)

    def _check_writer(self) -> None:
        """Forget the cached prefixes if anything else changed the runner's cache since this forest did
        (beam search, another forest, `ModelRunner.forget()`): their slots hold other KV now."""
        if self.runner.writes != self._writes:
            if self.live:
                raise RuntimeError("the KV cache changed under live branches: one runner, one writer at a time")
            if self.cache is not None:
                self.cache = PrefixCache(self.runner.context)
                self._low = 0
            self._writes = self.runner.writes

    def root(self, prompt: np.ndarray) -> tuple[Branch, np.ndarray]:
        """A new branch holding the prompt, and the prompt's last logits. The prompt goes in the plan's
        calls whatever `max_rows` (which caps a step's branches: beam search's sequential baseline)."""
        branch, cap = self.attach([]), self.max_rows
        self.max_rows = self._largest
        try:
            return branch, self.extend([branch], [list(prompt)])[0]
        except BaseException:
            self.release(branch)  # no half-made branch stays live
            raise
        finally:
            self.max_rows = cap

    def cached_prefix(self, prompt: list[int]) -> list[int]:
        """The slots of the longest cached prefix of `prompt` but its last token (which must be fed to
        give logits): `attach` them, then feed `prompt[branch.length:]`."""
        self._check_writer()
        if self.cache is None or len(prompt) < 2:
            return []
        return self.cache.match(np.asarray(prompt[:-1], dtype=np.int64)).tolist()

    def attach(self, order: list[int]) -> Branch:
        """A new branch that sees these slots (positions 0.. in this order)."""
        self._check_writer()
        view = np.zeros(self.runner.context, dtype=bool)
        view[order] = True
        branch = Branch(view, list(order))
        self.live.append(branch)
        return branch

    def fork(self, branch: Branch) -> Branch:
        child = Branch(branch.view.copy(), list(branch.order))
        self.live.append(child)
        return child

    def release(self, branch: Branch) -> None:
        self.live.remove(branch)
        self._low = 0

    def keep(self, branch: Branch, tokens: list[int] | None) -> None:
        """Release a finished branch into the prefix cache; `tokens` is its sequence (tokens past what
        it holds, like the last sampled one, have no KV and are left out; None: nothing is kept)."""
        self.release(branch)
        if self.cache is not None and tokens is not None:
            n = min(len(tokens), branch.length)
            self.cache.insert(np.asarray(tokens[:n], dtype=np.int64), np.asarray(branch.order[:n], dtype=np.int64))

    def free_slots(self) -> int:
        """Slots no live branch sees (cached ones included: they are given back on demand)."""
        return int((~self.pinned()).sum())

    def fits(self, n: int) -> bool:
        """Whether n new tokens find free slots (counted only when the live branches' lengths, which
        bound the slots they see, leave fewer: a step asks for each request's drafts)."""
        return self.runner.context - sum(b.length for b in self.live) >= n or self.free_slots() >= n

    def pinned(self) -> np.ndarray:
        used = np.zeros(self.runner.context, dtype=bool)
        for b in self.live:
            used |= b.view
        return used

    def extend(self, branches: list[Branch], chains: list[list[int]], check: bool = True) -> np.ndarray:
        """Append each chain of tokens to its (distinct) branch; return each chain's last-row logits [n, V]."""
        kept, _ = self.extend_rows(branches, chains, [1] * len(chains), check)
        return np.concatenate(kept)

    def extend_rows(self, branches: list[Branch], chains: list[list[int]], keep: list[int], check: bool = True,
                    sees: list[np.ndarray | None] | None = None, fetch: bool = True
                    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Append each chain of tokens to its (distinct) branch; return the logits of each chain's last
        keep[i] rows ([keep[i], V] each) and the slots each chain's tokens went into (for `trim`).

        A row sees its branch's view and the rows of its own chain that `sees[i]` (bool [n_i, n_i],
        default causal: a chain; a token tree with auxiliary rows: Proposal.rows) names. All rows go
        in the cheapest calls by the compiler's measured costs (runner.plan); a row that sees rows of
        an earlier call sees their slots; a prefill call that keeps no row's logits but its last runs the
        graph that computes the last row's alone (PREFILL_LAST: the LM head once, not per row).
        check=False: NaN/Inf rows are returned, not raised. fetch=False (greedy decoding): each kept row's
        greedy token instead of its logits ([keep[i]] int64 each, -1 for a NaN/Inf row; on a device target the
        graph's own argmax crosses to the host, not the logits: ModelRunner.run_rows).
        """
        self._check_writer()
        lengths = [len(c) for c in chains]
        if len(branches) != len(chains) or len(keep) != len(chains) or not chains:
            raise ValueError(f"extend needs one chain per branch, got {len(branches)} branches, {len(chains)} chains")
        if len({id(b) for b in branches}) < len(branches) or any(b not in self.live for b in branches):
            raise ValueError("extend needs distinct, live branches (fork a branch to extend it twice)")
        if min(lengths) < 1:
            raise ValueError("every chain needs at least one token")
        if any(not 1 <= k <= n for k, n in zip(keep, lengths, strict=True)):
            raise ValueError("each chain keeps between 1 and all of its rows' logits")
        starts = list(itertools.accumulate(lengths, initial=0))  # chain b's rows: starts[b] .. starts[b + 1] - 1
        tokens = np.fromiter(itertools.chain.from_iterable(chains), np.int64, starts[-1])
        slots = self._allocate(len(tokens))
        if len(self._tri) < len(tokens):
            self._tri = np.tri(len(tokens), dtype=bool)
        plan = self.runner.plan(len(tokens), self.max_rows, last_row=len(chains) == 1 and keep[0] == 1)
        if len(chains) == 1 and len(plan) == 1:  # the common call (a decode step, a round, a chunk): lean
            (graph, n), k = plan[0], keep[0]
            graph = self._chunk_graph(graph, k == 1)
            sees_n = self._tri[:n, :n] if not sees or sees[0] is None else sees[0]
            positions = branches[0].length + (sees_n.sum(axis=1) - 1 if n > 1 else self._zero)
            logits = self._run(graph, tokens, branches[0].view, sees_n, check, fetch, positions)
            self.runner.store(np.arange(n), slots)
            out = [logits[len(logits) - k :]]  # a view (valid until the graph's next run)
        else:
            out = self._calls(plan, branches, tokens, slots, lengths, starts, keep, sees, check, fetch)
        self._writes = self.runner.writes
        mine = [slots[a:z] for a, z in itertools.pairwise(starts)]
        for branch, own in zip(branches, mine, strict=True):
            branch.view[own] = True
            branch.order.extend(own.tolist())
        self._low = int(slots[-1]) + 1  # these were the lowest free slots: none below the last is free now
        return out, mine

    def _chunk_graph(self, graph: str, last_row_only: bool) -> str:
        """A prefill call that keeps only its last row's logits (a prompt chunk) runs PREFILL_LAST."""
        return self.runner.prefill_graph if graph == graph_io.PREFILL and last_row_only else graph

    def _run(self, graph: str, tokens: np.ndarray, cache_sees: np.ndarray, sees: np.ndarray, check: bool,
             fetch: bool, positions: np.ndarray | None = None) -> np.ndarray:
        """One call's logits, or with fetch=False its rows' greedy tokens (-1 where a row's logits are not finite)."""
        logits = self.runner.run_rows(graph, tokens, cache_sees, sees, check, fetch, positions)
        return logits if fetch else np.where(self.runner.finite(), self.runner.argmax(), -1)

    def _calls(self, plan: list[tuple[str, int]], branches: list[Branch], tokens: np.ndarray, slots: np.ndarray,
               lengths: list[int], starts: list[int], keep: list[int], sees: list[np.ndarray | None] | None,
               check: bool, fetch: bool) -> list[np.ndarray]:
        """Several chains, or rows past one call: each call's rows see their branches' views and the rows of
        their own chain, in earlier calls' slots or in this call."""
        owner = np.repeat(np.arange(len(lengths)), lengths)
        every = np.zeros((len(owner), len(owner)), dtype=bool)  # which rows each row sees: chains' blocks
        for b, m in enumerate(sees or [None] * len(lengths)):
            a, z = starts[b], starts[b + 1]
            every[a:z, a:z] = self._tri[: z - a, : z - a] if m is None else m
        first_kept = np.array(starts[1:]) - np.asarray(keep)  # row index of each chain's first kept row
        out = [np.empty((k, self.runner.dims.vocab_size), dtype=np.float32) if fetch else np.empty(k, np.int64)
               for k in keep]
        s = 0
        for graph, n in plan:
            rows, s = np.arange(s, s + n), s + n
            o = owner[rows]
            cache_sees = np.stack([branches[b].view for b in o])
            cache_sees[:, slots[: rows[0]]] |= every[rows, : rows[0]]  # rows of earlier calls, in their slots
            wanted = rows[rows >= first_kept[o]]
            graph = self._chunk_graph(graph, bool((wanted == rows[-1]).all()))
            own = every[rows[0] : s, rows[0] : s]
            if len(wanted):
                logits = self._run(graph, tokens[rows], cache_sees, own, check, fetch)
            else:  # a prompt's earlier chunk: no logits brought to the host
                self.runner.run_rows(graph, tokens[rows], cache_sees, own, check, fetch=False)
            self.runner.store(rows - rows[0], slots[rows])
            for r in wanted:
                out[owner[r]][r - first_kept[owner[r]]] = logits[r - rows[0] if len(logits) == n else 0]
        return out

    def trim(self, branch: Branch, slots: np.ndarray) -> None:
        """Take tokens back out of a branch (rejected drafts): their slots are free again unless another
        branch sees them."""
        if not branch.view[slots].all():
            raise ValueError("trim: the branch does not hold every one of these slots")
        branch.view[slots] = False
        self._low = min(self._low, int(slots.min(initial=self._low)))
        gone, order = set(slots.tolist()), branch.order
        first, left = len(order), len(gone)
        while left:  # the earliest of them, looked for from the end: drafts are the newest tokens
            first -= 1
            left -= order[first] in gone
        order[first:] = [s for s in order[first:] if s not in gone]

    def _allocate(self, n: int) -> np.ndarray:
        """The n lowest free slots, in order. A few tokens of a few branches (a decode step, a round) try the
        slots from `_low` one by one first: a step then reads a few entries, not every branch's whole view."""
        held = self.cache.held if self.cache is not None else None
        if n * len(self.live) <= 16:
            near: list[int] = []
            for s in range(self._low, min(self._low + 2 * n + 8, self.runner.context)):
                if not (held is not None and held[s] or any(b.view[s] for b in self.live)):
                    near.append(s)
                    if len(near) == n:
                        return np.array(near, np.int64)
        pinned = self.pinned()
        free = np.flatnonzero(~(pinned | held) if held is not None else ~pinned)
        if len(free) < n and self.cache is not None:  # give cached prefixes back, least recently used first
            self.cache.evict(n, pinned)
            self._low = 0  # freed slots may lie below it (and this call may still fail)
            free = np.flatnonzero(~(pinned | self.cache.held))
        if len(free) < n:
            raise CapacityError(f"{n} new tokens need free cache slots but only {len(free)} of "
                                f"{self.runner.context} are free")
        return free[:n]
