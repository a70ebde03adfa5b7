"""The CPU target's placement: the KV cache in one numpy array, bound to every graph's past inputs.

Every layer's K and V live in one host array [2L, 1, H, C, D] whose layer views are bound to every
graph once; a call writes its logits and its rows' new KV into host arrays bound likewise, and
`store` copies chosen rows into slots with numpy (one slice copy for a chain). On the CPU the sessions
share one mapping of the weights file, in 2 MiB pages (common/shared_weights.py); a GPU target's
sessions kept on the host (`device_cache=False`, for comparisons) each hold their own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common import graph_io
from common.manifest import ModelEntry
from common.targets import Target
from runtime.placement import BoundGraph, Placement


def _bind(binding: ort.IOBinding, name: str, array: np.ndarray, output: bool = False) -> None:
    args = (name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    (binding.bind_output if output else binding.bind_input)(*args)


@dataclass
class HostGraph(BoundGraph):
    logits_out: np.ndarray | None = None  # [1, T, V], bound
    new_kv: np.ndarray | None = None  # new KV of all layers [2L, 1, H, T, D] (new_key.0, new_value.0, ...), bound
    small: dict[str, np.ndarray] | None = None  # the greedy outputs [1, T] where the graph has them, bound

    def logits(self) -> np.ndarray:
        return self.logits_out

    def output(self, name: str) -> np.ndarray:
        return self.small[name]


class HostPlacement(Placement):
    def __init__(self, artifact_dir: Path, entry: ModelEntry, slots: int, target: Target, threads: int | None) -> None:
        on_cpu = target.device == "cpu"
        super().__init__(artifact_dir, entry, slots, target, threads, device="cpu" if on_cpu else None)
        d = self.dims
        self.cache_stack = np.zeros((2 * d.n_layers, 1, d.n_kv_heads, slots, d.head_dim), d.kv_dtype)
        self.cache = list(self.cache_stack)  # past_key.0, past_value.0, ...: views, bound to every graph

    def open(self, graph: str, path: Path, tokens: int) -> HostGraph:
        d = self.dims
        session = self.session(graph, path)
        rows = graph_io.logit_rows(graph, tokens)
        g = HostGraph(tokens=tokens, session=session, binding=session.io_binding(), shared=self.shared,
                      greedy_outputs=self.has_greedy_outputs(session), logit_rows=rows,
                      logits_out=np.zeros((1, rows, d.vocab_size), np.float32),
                      new_kv=np.zeros((len(self.cache), 1, d.n_kv_heads, tokens, d.head_dim), d.kv_dtype),
                      small={}, **self.inputs(tokens))
        if g.greedy_outputs:
            g.small = {name: np.zeros((1, rows), dtype) for name, dtype in graph_io.GREEDY_OUTPUTS.items()}
        for name, array in {**g.small, graph_io.LOGITS: g.logits_out}.items():
            _bind(g.binding, name, array, output=True)
        _bind(g.binding, graph_io.INPUT_IDS, g.input_ids)
        _bind(g.binding, graph_io.POSITION_IDS, g.position_ids)
        _bind(g.binding, graph_io.ATTENTION_MASK, g.mask)
        for i in range(d.n_layers):
            _bind(g.binding, graph_io.past_key(i), self.cache[2 * i])
            _bind(g.binding, graph_io.past_value(i), self.cache[2 * i + 1])
            _bind(g.binding, graph_io.new_key(i), g.new_kv[2 * i], output=True)
            _bind(g.binding, graph_io.new_value(i), g.new_kv[2 * i + 1], output=True)
        return g

    def store(self, g: HostGraph, rows: np.ndarray, slots: np.ndarray) -> None:
        m = len(rows)
        if m == 1:
            self.cache_stack[..., slots[0], :] = g.new_kv[..., rows[0], :]
        elif m and (np.diff(rows) == 1).all() and (np.diff(slots) == 1).all():  # contiguous: one slice copy
            self.cache_stack[..., slots[0] : slots[0] + m, :] = g.new_kv[..., rows[0] : rows[0] + m, :]
        else:
            self.cache_stack[..., slots, :] = g.new_kv[..., rows, :]
