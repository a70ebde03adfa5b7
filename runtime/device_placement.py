"""A GPU target's placement (ort-cuda): the KV cache, every graph's buffers and one copy of the weights on
the device, calls replayed as CUDA graphs. All of the runtime's CUDA code is here.

A compiled graph reads each layer's cache and writes its new rows' KV to separate outputs
(common/graph_io.py); on the CPU the host placement copies rows into slots with numpy. On a GPU that
copy must not cross the bus, so here the cache is one device tensor [2L, 1, H, C, D] whose layer
slices are bound to the graphs' past inputs, each graph's new KV is one device tensor [2L, 1, H, T, D]
bound likewise to its outputs, and `store` runs a small ONNX graph on the same provider: Gather the
chosen rows, ScatterElements them into their slots, written in place (the output is bound to the
cache itself; the compiler writes that graph beside the model's weights, common/graph_io.py's
KV_STORE_FILE). Per call only token ids, positions and the mask go in and logits come out (for
greedy decoding only each row's greedy token and finite check: compiler/greedy_outputs.py), each at
a fixed device address, so that with `cuda_graph` each fixed-shape graph replays as one CUDA graph.
The tests run this placement on the CPU provider (`device_cache=True`): it must give exactly what
the host placement gives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common import graph_io as io
from common.manifest import ArtifactError, ModelEntry
from common.targets import Target, check_session
from runtime.placement import BoundGraph, Placement

_INPUTS = {io.INPUT_IDS: "input_ids", io.POSITION_IDS: "position_ids", io.ATTENTION_MASK: "mask"}


def zeros(shape: tuple[int, ...], dtype: np.dtype, device: str) -> ort.OrtValue:
    """A device tensor of zeros (unused cache slots are masked out, but 0 * NaN would still be NaN)."""
    return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype), device, 0)


@dataclass
class DeviceGraph(BoundGraph):
    on_device: dict[str, ort.OrtValue] | None = None  # the bound buffers, by input/output name
    new_stack: ort.OrtValue | None = None  # new KV of all layers [2L, 1, H, T, D]

    def run(self) -> None:
        """Copy the filled host inputs into their device buffers (same addresses: CUDA graphs replay), run."""
        for name, field in _INPUTS.items():
            self.on_device[name].update_inplace(getattr(self, field))
        super().run()

    def logits(self) -> np.ndarray:
        return self.output(io.LOGITS)

    def output(self, name: str) -> np.ndarray:
        out = self.on_device[name].numpy()  # a device's: a host copy; the CPU's: the bound buffer
        return out if out.flags.owndata else out.copy()  # which the next call overwrites, or which goes with it


class DevicePlacement(Placement):
    """The cache [2L, 1, H, C, D] on the target's device, its per-layer slices, and the in-place store call."""

    def __init__(self, artifact_dir: Path, entry: ModelEntry, slots: int, target: Target, threads: int | None,
                 cuda_graph: bool | None = None) -> None:
        """Opens the store graph's session first: where the GPU cannot start, that refuses by name
        (check_session) before anything is allocated on it. `cuda_graph`: the graphs' sessions replay
        CUDA graphs (default: on a GPU; the store graph's session does not, its rows and slots change)."""
        device = target.device
        if cuda_graph and device != "cuda":
            raise ValueError(f"cuda_graph applies to the GPU target (ort-cuda), not {target.name!r}")
        super().__init__(artifact_dir, entry, slots, target, threads, device=device)
        self.cuda_graph = device == "cuda" if cuda_graph is None else cuda_graph
        self.dtype = np.dtype(self.dims.kv_dtype)
        store = Path(artifact_dir) / Path(entry.weights).parent / io.KV_STORE_FILE
        if not store.is_file():
            raise ArtifactError(f"{store} is missing: this artifact was built before the device cache "
                                "existed; re-run `python -m export` to keep its cache on the device")
        self._store = ort.InferenceSession(str(store), self.options(), providers=self.target.providers())
        check_session(self._store, self.target)
        d = self.dims
        self.cache = zeros((2 * d.n_layers, 1, d.n_kv_heads, slots, d.head_dim), self.dtype, self.target.device)
        self._binding = self._store.io_binding()
        self._bind(self._binding, io.KV_CACHE, self.cache, 0, slots)
        self._bind(self._binding, io.KV_CACHE_OUT, self.cache, 0, slots, output=True)
        self.captured: set[int] = set()  # threads that hold this model's CUDA graphs (`capture`)

    def open(self, graph: str, path: Path, tokens: int) -> DeviceGraph:
        """Every buffer on the device, bound once at a fixed address; the cache's layer slices as past KV."""
        d = self.dims
        session = self.session(graph, path)
        rows = io.logit_rows(graph, tokens)
        g = DeviceGraph(tokens=tokens, session=session, binding=session.io_binding(), shared=self.shared,
                        greedy_outputs=self.has_greedy_outputs(session), logit_rows=rows, **self.inputs(tokens))
        g.on_device = {name: zeros(getattr(g, field).shape, getattr(g, field).dtype, self.target.device)
                       for name, field in _INPUTS.items()}
        outputs = {io.LOGITS: zeros((1, rows, d.vocab_size), np.float32, self.target.device)}
        if g.greedy_outputs:  # each row's greedy token and finite check, so greedy decoding reads T numbers
            outputs |= {name: zeros((1, rows), dtype, self.target.device) for name, dtype in io.GREEDY_OUTPUTS.items()}
        for name, value in g.on_device.items():
            g.binding.bind_ortvalue_input(name, value)
        for name, value in outputs.items():
            g.binding.bind_ortvalue_output(name, value)
        g.on_device |= outputs
        g.new_stack = zeros((2 * d.n_layers, 1, d.n_kv_heads, tokens, d.head_dim), self.dtype, self.target.device)
        for i in range(2 * d.n_layers):  # layer by layer (key.0, value.0, key.1, ...): each its slice of the stack
            past, new = (io.past_key, io.new_key) if i % 2 == 0 else (io.past_value, io.new_value)
            self._bind(g.binding, past(i // 2), self.cache, i, self.slots)
            self._bind(g.binding, new(i // 2), g.new_stack, i, tokens, output=True)
        return g

    def _bind(self, binding: ort.IOBinding, name: str, buffer: ort.OrtValue, index: int, rows: int,
              output: bool = False) -> None:
        d = self.dims
        shape = [1, d.n_kv_heads, rows, d.head_dim]
        if name in (io.KV_CACHE, io.KV_CACHE_OUT):  # the store graph sees the whole stack
            shape = [2 * d.n_layers, *shape]
        offset = index * d.n_kv_heads * rows * d.head_dim * self.dtype.itemsize
        args = (name, self.target.device, 0, self.dtype, shape, buffer.data_ptr() + offset)
        (binding.bind_output if output else binding.bind_input)(*args)

    def store(self, g: DeviceGraph, rows: np.ndarray, slots: np.ndarray) -> None:
        """Rows `rows` of the call's new KV (`g.new_stack`) into cache slots `slots`, on the device."""
        if not len(rows):
            return
        self._binding.bind_ortvalue_input(io.KV_NEW, g.new_stack)
        self._binding.bind_cpu_input(io.KV_ROWS, np.ascontiguousarray(rows, dtype=np.int64))
        self._binding.bind_cpu_input(io.KV_SLOTS, np.ascontiguousarray(slots, dtype=np.int64))
        self._store.run_with_iobinding(self._binding)

    def needs_capture(self) -> bool:
        return self.cuda_graph and threading.get_ident() not in self.captured

    def capture(self, graphs: Iterable[BoundGraph]) -> None:
        """Run each graph until ONNX Runtime holds it as a CUDA graph, for the calling thread: its CUDA
        provider captures on a session's third run on a thread (two runs allocate first), and captures
        belong to that thread. A capture costs tens of ms, which the draft policy took for what a call
        costs when it fell inside a generation (a scoring call measured 36 ms that costs 3:
        docs/benchmarks.md, "GPU target"), so a thread's first call captures every graph at once, before
        anything is timed. Rows are padding that sees only itself; nothing is committed."""
        for g in graphs:
            g.run_padding(runs=3)
        self.captured.add(threading.get_ident())
