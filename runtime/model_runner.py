"""Drives one compiled model: its sessions, a preallocated KV cache, and bound I/O buffers.

Every graph's session memory-maps the model's one weights file, where the compiler stored the
weights and their prepacked (kernel-layout) forms once: prepacked speed, one copy for all graphs.
The cache is host-owned: slot s holds the token at position s of the committed sequence, and
`length` says how many slots are valid. A call writes only the KV of the tokens it processed into
their slots, so a rewind (purging rejected speculative tokens) is just a smaller `length`.
All input and output buffers are allocated once per graph and bound to ONNX Runtime; a step
fills a few small arrays in place instead of building feeds and copying outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common import graph_io
from common.manifest import ModelEntry
from compiler.targets import PROVIDERS, compiled_session_options


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
    new_kv: list[np.ndarray]  # new_key.0, new_value.0, new_key.1, ...


def _bind(binding: ort.IOBinding, name: str, array: np.ndarray, output: bool = False) -> None:
    args = (name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
    (binding.bind_output if output else binding.bind_input)(*args)


class ModelRunner:
    def __init__(
        self,
        artifact_dir: Path,
        entry: ModelEntry,
        context_length: int,
        target: str = "ort-cpu",
        threads: int | None = None,
    ) -> None:
        self.dims = entry.dims
        self.context = context_length
        d = self.dims
        kv_shape = (1, d.n_kv_heads, context_length, d.head_dim)
        self.cache = [np.zeros(kv_shape, dtype=np.float32) for _ in range(2 * d.n_layers)]
        self.length = 0
        self.calls = 0  # graph runs, for metrics
        self.graphs = {
            name: self._load(Path(artifact_dir) / g.file, g.tokens, target, threads)
            for name, g in entry.graphs.items()
        }

    def _load(self, path: Path, tokens: int, target: str, threads: int | None) -> _BoundGraph:
        so = compiled_session_options(target, threads)
        session = ort.InferenceSession(str(path), so, providers=PROVIDERS[target])
        d, c = self.dims, self.context
        g = _BoundGraph(
            tokens=tokens,
            session=session,
            binding=session.io_binding(),
            input_ids=np.zeros((1, tokens), dtype=np.int64),
            position_ids=np.zeros((1, tokens), dtype=np.int64),
            mask=np.zeros((1, tokens, c + tokens), dtype=bool),
            logits=np.zeros((1, tokens, d.vocab_size), dtype=np.float32),
            new_kv=[np.zeros((1, d.n_kv_heads, tokens, d.head_dim), np.float32) for _ in self.cache],
        )
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

    def forward(self, graph: str, tokens: np.ndarray, tree: np.ndarray | None = None) -> np.ndarray:
        """Process `tokens` after the `length` valid slots; return their logits [n, V].

        The new tokens go into slots length..length+n-1 and `length` advances by n. `tree`
        (bool [n, n]) says which of the new tokens each may see (default: causal); positions are
        length + depth in the tree. Unused rows of a fixed-shape graph are padding that only
        attends to itself and whose KV is discarded.
        """
        g = self.graphs[graph]
        n, start = len(tokens), self.length
        if n > g.tokens:
            raise ValueError(f"{n} tokens do not fit graph {graph!r} (T = {g.tokens})")
        if start + n > self.context:
            raise ValueError(f"{start + n} tokens exceed the context length {self.context}")
        tree = np.tri(n, dtype=bool) if tree is None else tree
        c = self.context
        g.input_ids[0, :n] = tokens
        g.input_ids[0, n:] = 0
        g.position_ids[0, :n] = start + tree.sum(axis=1) - 1
        g.position_ids[0, n:] = start
        g.mask[...] = False
        g.mask[0, :n, :start] = True
        g.mask[0, :n, c : c + n] = tree
        pad = np.arange(n, g.tokens)
        g.mask[0, pad, c + pad] = True
        g.session.run_with_iobinding(g.binding)
        self.calls += 1
        if not np.isfinite(g.logits[0, :n]).all():
            raise NonFiniteLogitsError(
                f"graph {graph!r} produced NaN/Inf logits at position {start}..{start + n - 1}: no token "
                "can be chosen from them (damaged weights, or values overflowing the weight format)"
            )
        for cache, new in zip(self.cache, g.new_kv, strict=True):
            cache[:, :, start : start + n] = new[:, :, :n]
        self.length = start + n
        return g.logits[0, :n]

    def rewind(self, length: int) -> None:
        """Forget every slot from `length` on (rejected speculative tokens are never seen again)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length} (valid length {self.length})")
        self.length = length

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """Process a prompt in chunks of the prefill graph's T; return the last token's logits."""
        chunk = self.graphs[graph_io.PREFILL].tokens
        logits = None
        for s in range(0, len(tokens), chunk):
            logits = self.forward(graph_io.PREFILL, tokens[s : s + chunk])
        assert logits is not None, "empty prompt"
        return logits[-1]
