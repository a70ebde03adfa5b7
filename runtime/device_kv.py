"""The KV cache where a GPU target keeps it: one device tensor for all layers, moved on the device.

A compiled graph reads each layer's cache and writes its new rows' KV to separate outputs
(common/graph_io.py); on the CPU the runner copies rows into slots with numpy. On a GPU that copy
must not cross the bus, so here the cache is one device tensor [2L, 1, H, C, D] whose layer slices
are bound to the graphs' past inputs, each graph's new KV is one device tensor [2L, 1, H, T, D]
bound likewise to its outputs, and `store` runs a small ONNX graph on the same provider: Gather the
chosen rows, ScatterElements them into their slots, written in place (the output is bound to the
cache itself; the compiler writes that graph beside the model's weights, common/graph_io.py's
KV_STORE_FILE). Per step only token ids, positions and the mask go in and logits come out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from common import graph_io as io
from common.graph_io import ModelDims
from common.manifest import ArtifactError
from common.targets import DEVICE, check_session


def zeros(shape: tuple[int, ...], dtype: np.dtype, device: str) -> ort.OrtValue:
    """A device tensor of zeros (unused cache slots are masked out, but 0 * NaN would still be NaN)."""
    return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype), device, 0)


class DeviceKV:
    """The cache [2L, 1, H, C, D] on `device`, its per-layer slices, and the in-place store call."""

    def __init__(self, store_graph: Path, dims: ModelDims, slots: int, target: str, providers: list,
                 options: ort.SessionOptions) -> None:
        """Opens the store graph's session first: where the GPU cannot start, that refuses by name
        (check_session) before anything is allocated on it."""
        self.dims, self.device = dims, DEVICE[target]
        self.dtype = np.dtype(dims.kv_dtype)
        if not store_graph.is_file():
            raise ArtifactError(f"{store_graph} is missing: this artifact was built before the device cache "
                                "existed; re-run `python -m export` to keep its cache on the device")
        self._session = ort.InferenceSession(str(store_graph), options, providers=providers)
        check_session(self._session, target)
        self.cache = zeros((2 * dims.n_layers, 1, dims.n_kv_heads, slots, dims.head_dim), self.dtype, self.device)
        self._binding = self._session.io_binding()
        self._bind(self._binding, io.KV_CACHE, self.cache, 0, slots)
        self._bind(self._binding, io.KV_CACHE_OUT, self.cache, 0, slots, output=True)

    def new_buffer(self, tokens: int) -> ort.OrtValue:
        """A graph's new KV outputs for all layers: [2L, 1, H, T, D]."""
        return zeros((2 * self.dims.n_layers, 1, self.dims.n_kv_heads, tokens, self.dims.head_dim), self.dtype,
                     self.device)

    def bind_layers(self, binding: ort.IOBinding, names: list[str], buffer: ort.OrtValue, rows: int,
                    output: bool = False) -> None:
        """Bind each of `names` (past or new KV, layer by layer: key.0, value.0, key.1, ...) to its slice."""
        for i, name in enumerate(names):
            self._bind(binding, name, buffer, i, rows, output=output)

    def _bind(self, binding: ort.IOBinding, name: str, buffer: ort.OrtValue, index: int, rows: int,
              output: bool = False) -> None:
        d = self.dims
        shape = [1, d.n_kv_heads, rows, d.head_dim]
        if name in (io.KV_CACHE, io.KV_CACHE_OUT):  # the store graph sees the whole stack
            shape = [2 * d.n_layers, *shape]
        offset = index * d.n_kv_heads * rows * d.head_dim * self.dtype.itemsize
        args = (name, self.device, 0, self.dtype, shape, buffer.data_ptr() + offset)
        (binding.bind_output if output else binding.bind_input)(*args)

    def store(self, new: ort.OrtValue, rows: np.ndarray, slots: np.ndarray) -> None:
        """Write rows `rows` of a call's new KV (`new`, [2L, 1, H, T, D]) into cache slots `slots`."""
        self._binding.bind_ortvalue_input(io.KV_NEW, new)
        self._binding.bind_cpu_input(io.KV_ROWS, np.ascontiguousarray(rows, dtype=np.int64))
        self._binding.bind_cpu_input(io.KV_SLOTS, np.ascontiguousarray(slots, dtype=np.int64))
        self._session.run_with_iobinding(self._binding)
