"""What one call of each graph costs: the compiler's measurement until this process has timed it.

The draft policy prices every step from these (docs/runtime.md, "The draft policy"). Two estimates
per graph: `warm` (the graph ran in the runner's previous step or earlier in this one) prices a plain
step, as steady plain decoding; `typical` (every call but a graph's first) prices a drafting step, as
drafting has cost: a lookup drafts between plain steps, so its scoring graphs mostly run after sitting
idle, and priced warm they looked cheaper than they are (prompt lookup drafted on 1-in-3 matches and
lost ~10% on the default recipe). A graph's first time in an estimate waits for a second, and the
faster counts (a DLM graph's second run once took 7.6 ms against 1.9); a faster warm one counts at
once (underrating plain decoding loses to drafting that does not pay). Graphs not timed yet are their
seeds scaled by the last warm-timed graph's ratio to its seed: the machine is not the compiler's.
"""

from __future__ import annotations

from collections.abc import Callable


class GraphCosts:
    def __init__(self, seed: Callable[[str], float], smoothing: float = 0.2) -> None:
        """`seed(graph)`: the compiler's ms per call (1 ms where none was measured), read when asked."""
        self.seed = seed
        self.smoothing = smoothing
        self.warm: dict[str, float] = {}
        self.typical: dict[str, float] = {}
        self._first: dict[tuple[bool, str], float] = {}  # an estimate's first time, until a second confirms it
        self.scale = 1.0
        self.seen: set[str] = set()
        self.last_step: set[str] = set()
        self.this_step: set[str] = set()

    def new_step(self) -> None:
        self.last_step, self.this_step = self.this_step, set()

    def record(self, graph: str, ms: float) -> None:
        warm = graph in self.this_step or graph in self.last_step
        self.this_step.add(graph)
        if graph in self.seen:
            self._add(self.typical, graph, ms, at_once=False)
        self.seen.add(graph)
        if warm and self._add(self.warm, graph, ms, at_once=True):
            self.scale = self.warm[graph] / self.seed(graph)

    def _add(self, table: dict[str, float], graph: str, ms: float, at_once: bool) -> bool:
        """Average a time into `table`; True when it is the graph's first estimate there."""
        if graph in table:
            old = table[graph]
            table[graph] = ms if at_once and ms < old else old + self.smoothing * (ms - old)
            return False
        key = (table is self.warm, graph)
        if key not in self._first:
            self._first[key] = ms
            return False
        table[graph] = min(ms, self._first.pop(key))
        return True

    def ms(self, graph: str, adapt: bool = True, warm: bool = True) -> float:
        """A call's cost: timed here (`adapt`; `warm` or typical, falling back to the other), or the
        compiler's alone (a sampled generation's choices must depend on nothing but its random stream)."""
        if not adapt:
            return self.seed(graph)
        first, other = (self.warm, self.typical) if warm else (self.typical, self.warm)
        if graph in first:
            return first[graph]
        return other.get(graph, self.seed(graph) * self.scale)
