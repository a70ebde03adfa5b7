"""Drives one compiled model: its sessions, a preallocated KV cache, and bound I/O buffers.

Every graph's session memory-maps the model's one weights file, where the compiler stored the
weights and their prepacked (kernel-layout) forms once: prepacked speed, one copy for all graphs.
The cache is host-owned: slot s holds the token at position s of the committed sequence, and
`length` says how many slots are valid. A call (`run`) sees the committed slots and its own rows
as the mask says; `commit` then appends the chosen rows' KV (any subset: the accepted path of a
token tree), so rows left out are never attended to again, and a rewind (purging committed
speculative tokens) is just a smaller `length`. The runner remembers which token each committed
slot holds, so a prompt that starts with the committed tokens prefills only the rest (`start`;
exact because batch-invariant graphs give a row the same KV whatever call computed it). Forests
of sequences over one cache (runtime/forest.py) use the general pair underneath: `run_rows` (each
row sees the slots its mask row names) and `store` (rows' KV into chosen slots).
All input and output buffers are allocated once per graph and bound to ONNX Runtime; a step
fills a few small arrays in place instead of building feeds and copying outputs. On a GPU target
the cache and every graph's buffers live on the device (runtime/device_kv.py): per call the token
ids, positions and mask go in, the call's logits rows come out, and committing moves KV on the
device; with `cuda_graph` each fixed-shape graph replays as one CUDA graph.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common import graph_io
from common.manifest import ModelEntry
from common.shared_weights import SharedWeights
from common.targets import DEVICE, check_session, compiled_session_options, parked_pools, providers
from runtime.device_kv import DeviceKV, zeros


class NonFiniteLogitsError(RuntimeError):
    """A model call whose logits hold NaN/Inf: emitting a token from them would be silent garbage."""


@dataclass
class _BoundGraph:
    tokens: int
    session: ort.InferenceSession
    binding: ort.IOBinding
    input_ids: np.ndarray
    position_ids: np.ndarray
    mask: np.ndarray
    logits: np.ndarray
    new_kv: np.ndarray  # host cache only: new KV of all layers [2L, 1, H, T, D] (new_key.0, new_value.0, ...)
    on_device: dict[str, ort.OrtValue] | None = None  # device cache: the bound buffers, by input/output name
    new_stack: ort.OrtValue | None = None  # device cache: new KV of all layers [2L, 1, H, T, D]
    shared: SharedWeights | None = None  # the weights the session was handed: they must outlive it

    def upload(self) -> None:
        """Copy the filled host inputs into their device buffers (same addresses: CUDA graphs replay)."""
        if self.on_device is not None:
            for name in (graph_io.INPUT_IDS, graph_io.POSITION_IDS, graph_io.ATTENTION_MASK):
                self.on_device[name].update_inplace(getattr(self, _FIELDS[name]))

    def download(self) -> np.ndarray:
        if self.on_device is None:
            return self.logits
        out = self.on_device[graph_io.LOGITS].numpy()  # a device's: a host copy; the CPU's: the bound buffer
        return out if out.flags.owndata else out.copy()  # which the next call overwrites, or which goes with it


_FIELDS = {graph_io.INPUT_IDS: "input_ids", graph_io.POSITION_IDS: "position_ids",
           graph_io.ATTENTION_MASK: "mask", graph_io.LOGITS: "logits"}


def _bind(binding: ort.IOBinding, name: str, array: np.ndarray, output: bool = False) -> None:
    args = (name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    (binding.bind_output if output else binding.bind_input)(*args)


class ModelRunner:
    def __init__(
        self,
        artifact_dir: Path,
        entry: ModelEntry,
        slots: int,
        max_length: int | None = None,
        target: str = "ort-cpu",
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
        self.target = target
        d = self.dims
        on_device = DEVICE[target] != "cpu" if device_cache is None else device_cache
        if cuda_graph and not on_device:
            raise ValueError("cuda_graph needs the device cache: a CUDA graph replays fixed device addresses")
        if cuda_graph and DEVICE[target] != "cuda":
            raise ValueError(f"cuda_graph applies to the GPU target (ort-cuda), not {target!r}")
        self.cuda_graph = on_device and DEVICE[target] == "cuda" if cuda_graph is None else cuda_graph
        self._providers = providers(target, self.cuda_graph)
        self.kv: DeviceKV | None = None
        if on_device:
            store = Path(artifact_dir) / Path(entry.weights).parent / graph_io.KV_STORE_FILE
            self.kv = DeviceKV(store, d, slots, target, providers(target), compiled_session_options(target, threads))
        # Host cache: every layer's K and V in one array, so a step's new rows are stored in one copy.
        layers = 0 if self.kv is not None else 2 * d.n_layers
        self.cache_stack = np.zeros((layers, 1, d.n_kv_heads, slots, d.head_dim), d.kv_dtype)
        self.cache = list(self.cache_stack)  # past_key.0, past_value.0, ...: views, bound to every graph
        self.length = 0
        self.history = np.zeros(slots, dtype=np.int64)  # the token in each committed slot
        self.reuse = entry.batch_invariant  # prefix reuse is exact only on batch-invariant graphs
        self.reused = 0  # prompt tokens the last `start` found in the cache
        self.calls = 0  # graph runs, for metrics
        self.call_s = 0.0  # seconds inside graph runs, inputs and logits transfers included (host overhead = rest)
        self._last: _BoundGraph | None = None  # the graph of the last run, whose new KV commit reads
        model_dir = Path(artifact_dir) / Path(entry.weights).parent
        # one copy of the weights for all the graphs: on a device with the device cache, or on the CPU one
        # mapping of the file in 2 MiB pages (artifacts built before the index: each session its own)
        device = DEVICE[target]
        self.shared = SharedWeights.available(model_dir, Path(artifact_dir) / entry.weights, device
                                              ) if device == "cpu" or self.kv is not None else None
        with parked_pools():
            self.graphs = {
                name: self._load(name, Path(artifact_dir) / g.file, g.tokens, target, threads)
                for name, g in entry.graphs.items()
            }
        self.entries = entry.graphs  # the compiler's measured cost of each graph's call, for plan()
        self.captured: set[int] = set()  # threads that hold this runner's CUDA graphs (capture_graphs)
        self.warm: set[str] = set()  # graphs run at least once (a first run allocates: warm_up)

    def _load(self, name: str, path: Path, tokens: int, target: str, threads: int | None) -> _BoundGraph:
        so = compiled_session_options(target, threads)
        if self.shared is not None:
            self.shared.add_to(name, so)
        session = ort.InferenceSession(str(path), so, providers=self._providers)
        check_session(session, target)
        d, c = self.dims, self.context
        g = _BoundGraph(
            tokens=tokens,
            session=session,
            binding=session.io_binding(),
            input_ids=np.zeros((1, tokens), dtype=np.int64),
            position_ids=np.zeros((1, tokens), dtype=np.int64),
            mask=np.zeros((1, tokens, c + tokens), dtype=bool),
            logits=np.zeros((1, tokens, d.vocab_size), dtype=np.float32),
            new_kv=np.zeros((len(self.cache), 1, d.n_kv_heads, tokens, d.head_dim), d.kv_dtype),
            shared=self.shared,
        )
        if self.kv is not None:
            self._bind_device(g)
            return g
        _bind(g.binding, graph_io.INPUT_IDS, g.input_ids)
        _bind(g.binding, graph_io.POSITION_IDS, g.position_ids)
        _bind(g.binding, graph_io.ATTENTION_MASK, g.mask)
        _bind(g.binding, graph_io.LOGITS, g.logits, output=True)
        for i in range(d.n_layers):
            _bind(g.binding, graph_io.past_key(i), self.cache[2 * i])
            _bind(g.binding, graph_io.past_value(i), self.cache[2 * i + 1])
            _bind(g.binding, graph_io.new_key(i), g.new_kv[2 * i], output=True)
            _bind(g.binding, graph_io.new_value(i), g.new_kv[2 * i + 1], output=True)
        return g

    def _bind_device(self, g: _BoundGraph) -> None:
        """Every buffer on the device, bound once at a fixed address; the cache's layer slices as past KV."""
        kv, device = self.kv, DEVICE[self.target]
        g.on_device = {name: zeros(getattr(g, field).shape, getattr(g, field).dtype, device)
                       for name, field in _FIELDS.items()}
        for name, value in g.on_device.items():
            (g.binding.bind_ortvalue_output if name == graph_io.LOGITS else g.binding.bind_ortvalue_input)(name, value)
        n = self.dims.n_layers
        kv.bind_layers(g.binding, [f(i) for i in range(n) for f in (graph_io.past_key, graph_io.past_value)],
                       kv.cache, self.context)
        g.new_stack = kv.new_buffer(g.tokens)
        kv.bind_layers(g.binding, [f(i) for i in range(n) for f in (graph_io.new_key, graph_io.new_value)],
                       g.new_stack, g.tokens, output=True)

    def capture_graphs(self) -> None:
        """Run each graph until ONNX Runtime holds it as a CUDA graph, for the calling thread: its CUDA
        provider captures on a session's third run on a thread (two runs allocate first), and captures
        belong to that thread. A capture costs tens of ms, which the draft policy took for what a call
        costs when it fell inside a generation (a scoring call measured 36 ms that costs 3:
        docs/benchmarks.md, "GPU target"), so a thread's first call captures every graph at once, before
        anything is timed. Rows are padding that sees only itself; nothing is committed."""
        self._run_padding(list(self.graphs), runs=3)
        self.captured.add(threading.get_ident())

    def warm_up(self, graphs: Iterable[str]) -> None:
        """Run each of these graphs that has not run yet once. A session's first run allocates its
        buffers: lookahead's 13-row graph took 16.8 ms the first time in a process, 4.6 plain steps
        (docs/benchmarks-history.md), so a drafter warms the graphs it may call before its first round. (CUDA
        graphs: their capture at a thread's first call runs every graph.)"""
        if not self.cuda_graph:
            self._run_padding(sorted(set(graphs) - self.warm), runs=1)

    def _run_padding(self, graphs: list[str], runs: int) -> None:
        """Run these graphs `runs` times on padding rows that see only themselves; nothing is committed."""
        for name in graphs:
            g = self.graphs[name]
            self.warm.add(name)
            rows = np.arange(g.tokens)
            g.input_ids[...] = 0
            g.position_ids[...] = 0
            g.mask[...] = False
            g.mask[0, rows, self.context + rows] = True
            g.upload()
            for _ in range(runs):
                g.session.run_with_iobinding(g.binding)
            self._last = None  # its new KV is padding's: nothing to commit

    def graph_for(self, rows: int) -> str:
        """The cheapest graph that holds `rows` new tokens (see graph_io.fitting_graph)."""
        return graph_io.fitting_graph({name: g.tokens for name, g in self.graphs.items()}, rows)

    def plan(self, rows: int, max_rows: int | None = None) -> list[tuple[str, int]]:
        """The cheapest calls for `rows` new rows by the compiler's measured costs (graph_io.plan_calls)."""
        return graph_io.plan_calls({name: (g.tokens, g.cost_ms) for name, g in self.entries.items()}, rows, max_rows)

    def run(self, graph: str, tokens: np.ndarray, sees: np.ndarray | None = None) -> np.ndarray:
        """Process `tokens` as new rows after the `length` committed slots; return their logits [n, V].

        `sees` (bool [n, n]) says which new rows each row sees (default: causal); positions follow
        from it (graph_io.row_positions). Nothing is committed: `commit` chooses which rows' KV
        enter the cache.
        """
        sees = np.tri(len(tokens), dtype=bool) if sees is None else sees
        return self.run_rows(graph, tokens, np.arange(self.context) < self.length, sees)

    def run_rows(self, graph: str, tokens: np.ndarray, cache_sees: np.ndarray, sees: np.ndarray,
                 check: bool = True) -> np.ndarray:
        """The general call: row i sees the cache slots `cache_sees[i]` (bool [n, C], or [C] for all
        rows) and the new rows `sees[i]`; its position is the number of tokens it sees, minus one.
        Return the rows' logits [n, V]. Unused rows of a fixed-shape graph are padding that only
        sees itself. check=False leaves NaN/Inf rows to the caller (a batch of independent requests
        fails only the request whose row it is).
        """
        if self.cuda_graph and threading.get_ident() not in self.captured:
            self.capture_graphs()
        g = self.graphs[graph]
        n, c = len(tokens), self.context
        if n > g.tokens:
            raise ValueError(f"{n} tokens do not fit graph {graph!r} (T = {g.tokens})")
        positions = np.sum(cache_sees, axis=-1) + sees.sum(axis=1) - 1
        if positions.max() >= self.max_length:
            raise ValueError(f"position {positions.max()} is past the context length {self.max_length}")
        g.input_ids[0, :n] = tokens
        g.input_ids[0, n:] = 0
        g.position_ids[0, :n] = positions
        g.position_ids[0, n:] = 0
        g.mask[...] = False
        g.mask[0, :n, :c] = cache_sees
        g.mask[0, :n, c : c + n] = sees
        pad = np.arange(n, g.tokens)
        g.mask[0, pad, c + pad] = True
        t0 = time.perf_counter()
        g.upload()
        g.session.run_with_iobinding(g.binding)
        logits = g.download()
        self.call_s += time.perf_counter() - t0
        self.calls += 1
        self.warm.add(graph)
        self._last = g
        if check and not np.isfinite(logits[0, :n]).all():
            raise NonFiniteLogitsError(
                f"graph {graph!r} produced NaN/Inf logits at positions {positions.min()}..{positions.max()}: no "
                "token can be chosen from them (damaged weights, or values overflowing the weight format)"
            )
        return logits[0, :n]

    def commit(self, rows: list[int] | np.ndarray) -> None:
        """Append the KV of these rows of the last `run` (in order: the root and an accepted path,
        say) to the cache; the rows left out are never attended to again."""
        rows = np.asarray(rows, dtype=np.int64)
        start, m = self.length, len(rows)
        if start + m > self.context:
            raise ValueError(f"{start + m} tokens exceed the cache's {self.context} slots")
        self.store(rows, np.arange(start, start + m))
        self.history[start : start + m] = self._last.input_ids[0, rows]
        self.length = start + m

    def store(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Write the KV of these rows of the last call into these cache slots (one slot per row).
        Committed slots from the first one written on are no longer the committed sequence."""
        m = len(rows)
        if m:
            self.length = min(self.length, int(slots.min()))
        if self.kv is not None:
            if m:
                self.kv.store(self._last.new_stack, rows, slots)
            return
        chain = m > 0 and rows[0] == 0 and (np.diff(rows) == 1).all() and (np.diff(slots) == 1).all()
        new = self._last.new_kv
        if chain:  # contiguous on both sides: one slice copy
            self.cache_stack[..., slots[0] : slots[0] + m, :] = new[..., :m, :]
        else:
            self.cache_stack[..., slots, :] = new[..., rows, :]

    def forward(self, graph: str, tokens: np.ndarray) -> np.ndarray:
        """Process a chain of tokens and commit all of them; return their logits [n, V]."""
        if self.length + len(tokens) > self.context:
            raise ValueError(f"{self.length + len(tokens)} tokens exceed the cache's {self.context} slots")
        logits = self.run(graph, tokens)
        self.commit(np.arange(len(tokens)))
        return logits

    def rewind(self, length: int) -> None:
        """Forget every slot from `length` on (rejected speculative tokens are never seen again)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length} (valid length {self.length})")
        self.length = length

    def start(self, prompt: np.ndarray) -> np.ndarray:
        """Begin a sequence: keep the committed slots that already hold a prefix of `prompt` (all but its
        last token at most), prefill the rest, return the last token's logits."""
        keep = 0
        if self.reuse:
            n = min(self.length, len(prompt) - 1)
            differ = np.flatnonzero(self.history[:n] != prompt[:n])
            keep = int(differ[0]) if len(differ) else max(n, 0)
        self.rewind(keep)
        self.reused = keep
        return self.prefill(prompt[keep:])

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Process a prompt in the cheapest chunks (`plan`); return the last token's logits."""
        s, logits = 0, None
        for graph, n in self.plan(len(tokens)):
            logits = self.forward(graph, tokens[s : s + n])
            s += n
        return logits[-1]
