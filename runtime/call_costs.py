"""What one call of each graph costs: the compiler's measurement until this process has timed it warm.

The draft policy (runtime/draft_policy.py) prices every step from these, offline and in the server.
A call is warm when its graph ran in the runner's previous step or earlier in this one: a graph that
sat idle (a plain step right after drafting, a catch-up's prefill) runs slower than its steady cost,
and a session's first run allocates. A graph's first warm time waits for a second, and the faster
counts (one run can be a spike: a DLM graph's second run once took 7.6 ms against 1.9); later ones
are averaged in, a faster one at once (rating a graph slow is the costlier error: plain decoding
underrated lost to drafting that did not pay). Graphs not timed yet are their seeds scaled by the
last timed graph's ratio to its seed, since the machine and its load are not the compiler's.
"""

from __future__ import annotations

from collections.abc import Callable


class GraphCosts:
    def __init__(self, seed: Callable[[str], float], smoothing: float = 0.2) -> None:
        """`seed(graph)`: the compiler's ms per call (1 ms where none was measured), read when asked."""
        self.seed = seed
        self.smoothing = smoothing
        self.timed: dict[str, float] = {}
        self.first: dict[str, float] = {}  # a graph's first warm time, until a second confirms it
        self.scale = 1.0
        self.last_step: set[str] = set()
        self.this_step: set[str] = set()

    def new_step(self) -> None:
        self.last_step, self.this_step = self.this_step, set()

    def record(self, graph: str, ms: float) -> None:
        warm = graph in self.this_step or graph in self.last_step
        self.this_step.add(graph)
        if not warm:
            return
        if graph in self.timed:
            old = self.timed[graph]
            self.timed[graph] = ms if ms < old else old + self.smoothing * (ms - old)
        elif graph not in self.first:
            self.first[graph] = ms
        else:
            self.timed[graph] = min(ms, self.first.pop(graph))
            self.scale = self.timed[graph] / self.seed(graph)

    def ms(self, graph: str, adapt: bool = True) -> float:
        """A call's cost: timed here (`adapt`), or the compiler's alone (a sampled generation's choices
        must depend on nothing but its seeded random stream)."""
        if not adapt:
            return self.seed(graph)
        return self.timed.get(graph, self.seed(graph) * self.scale)
