"""Drives one compiled model: its sessions, a preallocated KV cache, and bound I/O buffers.

Every graph's session memory-maps the model's one weights file, where the compiler stored the
weights and their prepacked (kernel-layout) forms once: prepacked speed, one copy for all graphs.
A call (`run_rows`) sees the cache slots each of its rows' mask row names, and `store` puts chosen
rows' KV into chosen slots (any subset: the accepted path of a token tree); which slots hold what is
the engine's forest of sequences over the cache (runtime/forest.py), the one writer at a time.
All input and output buffers are allocated once per graph and bound to ONNX Runtime; a step
fills a few small arrays in place instead of building feeds and copying outputs. Where the tensors
live and how the sessions open is the placement's (runtime/placement.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from common import graph_io
from common.manifest import GraphEntry, ModelEntry
from common.targets import TARGETS, Target, parked_pools
from runtime.call_costs import GraphCosts
from runtime.device_placement import DevicePlacement
from runtime.host_placement import HostPlacement
from runtime.placement import BoundGraph, Placement


class NonFiniteLogitsError(RuntimeError):
    """A model call whose logits hold NaN/Inf: emitting a token from them would be silent garbage."""


def _placement(artifact_dir: Path, entry: ModelEntry, slots: int, target: Target, threads: int | None,
               device_cache: bool | None, cuda_graph: bool | None) -> Placement:
    """The target's placement: on the device (`device_cache`, default on a GPU target) or on the host."""
    if target.device != "cpu" if device_cache is None else device_cache:
        return DevicePlacement(artifact_dir, entry, slots, target, threads, cuda_graph)
    if cuda_graph:
        raise ValueError("cuda_graph needs the device cache: a CUDA graph replays fixed device addresses")
    return HostPlacement(artifact_dir, entry, slots, target, threads)


class ModelRunner:
    def __init__(
        self,
        artifact_dir: Path,
        entry: ModelEntry,
        slots: int,
        max_length: int | None = None,
        target: Target = TARGETS["ort-cpu"],
        threads: int | None = None,
        device_cache: bool | None = None,
        cuda_graph: bool | None = None,
    ) -> None:
        """`slots`: the KV cache's slots (the graphs' cache dimension); `max_length`: the longest
        sequence in positions (default: `slots`), less when a server's requests share the slots.
        `device_cache`: keep the cache in ONNX Runtime tensors on the target's device (default: on a
        GPU target; tests force it on the CPU); `cuda_graph`: replay each graph as a CUDA graph (default: on a
        GPU target, where it decodes 2.4-3.8x faster: docs/benchmarks.md, "GPU target")."""
        self.dims = entry.dims
        self.context = slots
        self.max_length = max_length or slots
        self.place = _placement(artifact_dir, entry, slots, target, threads, device_cache, cuda_graph)
        self.calls = 0  # graph runs, for metrics
        self.writes = 0  # changes to the cache's contents (a forest's prefix cache checks it is the writer)
        self.call_s = 0.0  # seconds inside graph runs, inputs and logits transfers included (host overhead = rest)
        self._last: BoundGraph | None = None  # the graph of the last run, whose new KV `store` reads
        self._first = self._rows = 0  # the last run's first row in its graph, and its rows of logits
        with parked_pools():
            self.graphs = {name: self.place.open(name, Path(artifact_dir) / g.file, g.tokens)
                           for name, g in entry.graphs.items()}
        self.entries = entry.graphs  # the compiler's measured cost of each graph's call, for plan()
        self.costs = GraphCosts(lambda graph: self.entries[graph].cost_ms or 1.0)  # as this process times them
        self._planned_for: dict[str, GraphEntry] = {}
        self._plans: dict[tuple[int, int | None, bool], list[tuple[str, int]]] = {}
        # every graph returns its rows' greedy tokens (a device target's: compiler/greedy_outputs.py), so greedy
        # decoding runs with fetch=False and reads `argmax()`, never the logits
        self.greedy_outputs = all(g.greedy_outputs for g in self.graphs.values())
        self.prefill_graph = graph_io.PREFILL_LAST if graph_io.PREFILL_LAST in self.graphs else graph_io.PREFILL
        self.warm: set[str] = set()  # graphs run at least once (a first run allocates: warm_up)

    def capture_graphs(self) -> None:
        """Capture every graph as a CUDA graph for the calling thread (DevicePlacement.capture)."""
        self.place.capture(self.graphs.values())
        self.warm |= set(self.graphs)
        self._last = None  # the captures' new KV is padding's: nothing to commit

    def warm_up(self, graphs: Iterable[str]) -> None:
        """Run each of these graphs that has not run yet once. A session's first run allocates its
        buffers: lookahead's 13-row graph took 16.8 ms the first time in a process, 4.6 plain steps
        (docs/benchmarks-history.md), so a drafter warms the graphs it may call before its first round. (CUDA
        graphs: their capture at a thread's first call runs every graph.)"""
        if not self.place.cuda_graph:
            for name in sorted(set(graphs) - self.warm):
                self.graphs[name].run_padding(runs=1)
                self.warm.add(name)
                self._last = None  # its new KV is padding's: nothing to commit

    def graph_for(self, rows: int) -> str:
        """The cheapest graph that holds `rows` new tokens (see graph_io.fitting_graph)."""
        return graph_io.fitting_graph({name: g.tokens for name, g in self._every_row()}, rows)

    def plan(self, rows: int, max_rows: int | None = None, last_row: bool = False) -> list[tuple[str, int]]:
        """The cheapest calls for `rows` new rows by the compiler's measured costs (graph_io.plan_calls).
        `last_row`: only the last row's logits are wanted (a prompt), so PREFILL's calls run and are priced as
        `prefill_graph` (its LM head on one row: a 128-row MXFP4 chunk at 1B widths costs 0.84x its every-row
        twin, which the plan needs to know, or 8-row calls that compute 8 rows' logits each look cheaper).
        Remembered per row count while `entries` stays the same dict (a step asks every time)."""
        if self.entries is not self._planned_for:
            self._planned_for, self._plans = self.entries, {}
        key = (rows, max_rows, last_row)
        if key not in self._plans:
            costs = {name: (g.tokens, g.cost_ms) for name, g in self._every_row()}
            if last_row and graph_io.PREFILL in costs:
                costs[graph_io.PREFILL] = (costs[graph_io.PREFILL][0], self.entries[self.prefill_graph].cost_ms)
            self._plans[key] = graph_io.plan_calls(costs, rows, max_rows)
        return self._plans[key]

    def _every_row(self) -> list[tuple[str, GraphEntry]]:
        """The graphs that return every row's logits, which any call may run (PREFILL_LAST returns the last
        row's alone: a forest's prompt chunks run it in PREFILL's place, as `prefill_graph`)."""
        return [(name, g) for name, g in self.entries.items() if graph_io.logit_rows(name, g.tokens) == g.tokens]

    def run_rows(self, graph: str, tokens: np.ndarray, cache_sees: np.ndarray, sees: np.ndarray,
                 check: bool = True, fetch: bool = True, positions: np.ndarray | None = None) -> np.ndarray | None:
        """The general call: row i sees the cache slots `cache_sees[i]` (bool [n, C], or [C] for all
        rows) and the new rows `sees[i]`; its position is the number of tokens it sees, minus one.
        Return the rows' logits [n, V]. Unused rows of a fixed-shape graph are padding that only
        sees itself; a graph that returns its last row's logits alone (PREFILL_LAST) holds the rows at
        its end and returns [1, V], the last row's. check=False leaves NaN/Inf rows to the caller (a
        batch of independent requests fails only the request whose row it is). fetch=False, for greedy
        decoding: the logits stay where the graph wrote them (None is returned) and `argmax()` gives each
        row's token (on a device target, T integers cross to the host instead of T vocabularies of floats).
        `positions`: the rows' positions where the caller knows them (else counted from the masks).
        """
        if self.place.needs_capture():
            self.capture_graphs()
        g = self.graphs[graph]
        n, c = len(tokens), self.context
        if n > g.tokens:
            raise ValueError(f"{n} tokens do not fit graph {graph!r} (T = {g.tokens})")
        if positions is None:
            positions = np.sum(cache_sees, axis=-1) + sees.sum(axis=1) - 1
        if positions.max() >= self.max_length:
            raise ValueError(f"position {positions.max()} is past the context length {self.max_length}")
        last_row = g.logit_rows < g.tokens
        first = g.tokens - n if last_row else 0  # the call's rows: first .. first + n - 1
        rows = slice(first, first + n)
        g.mask[...] = False
        if n < g.tokens:  # padding rows: token 0 at position 0, each seeing itself
            g.input_ids[...] = 0
            g.position_ids[...] = 0
            pad = np.arange(first) if first else np.arange(n, g.tokens)
            g.mask[0, pad, c + pad] = True
        g.input_ids[0, rows] = tokens
        g.position_ids[0, rows] = positions
        g.mask[0, rows, :c] = cache_sees
        g.mask[0, rows, c + first : c + first + n] = sees
        out = 1 if last_row else n  # rows of logits
        t0 = time.perf_counter()
        g.run()
        logits = g.logits()[0, :out] if fetch else None
        took = time.perf_counter() - t0
        self.call_s += took
        self.costs.record(graph, took * 1e3)
        self.calls += 1
        self.warm.add(graph)
        self._last, self._first, self._rows = g, first, out
        if check and not (np.isfinite(logits).all() if fetch else g.finite(out).all()):
            raise NonFiniteLogitsError(
                f"graph {graph!r} produced NaN/Inf logits at positions {positions.min()}..{positions.max()}: no "
                "token can be chosen from them (damaged weights, or values overflowing the weight format)"
            )
        return logits

    def argmax(self) -> np.ndarray:
        """The last call's rows' greedy tokens [n] (np.argmax of each row's logits, the first on ties)."""
        return self._last.greedy_tokens(self._rows)

    def finite(self) -> np.ndarray:
        """Whether each of the last call's rows' logits are all finite [n] (the graph's own check on a device)."""
        return self._last.finite(self._rows)

    def store(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Write the KV of these rows of the last call into these cache slots (one slot per row)."""
        self.writes += 1
        self.place.store(self._last, rows + self._first if self._first else rows, slots)

    def forget(self) -> None:
        """Count the cache's contents as another writer's: a forest forgets its cached prefixes (a cold run)."""
        self.writes += 1
