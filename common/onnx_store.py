"""Writes several ONNX graphs of one model so that they share one weights file.

Graphs of a model (prefill, decode, score) are traced separately, so each arrives with its own
copy of every weight. Here identical tensors (same bytes, dtype and shape) are stored once in a
single external-data file, page-aligned so ONNX Runtime can memory-map it, and every graph points
at the same offsets. Small tensors stay inline.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import onnx
from onnx import numpy_helper

INLINE_LIMIT = 1024  # bytes; smaller initializers stay inside the graph
ALIGN = 4096


def _tensor_bytes(t: onnx.TensorProto) -> bytes:
    if t.raw_data:
        return t.raw_data
    return numpy_helper.to_array(t).tobytes()


def _content_key(t: onnx.TensorProto, data: bytes) -> str:
    return f"{t.data_type}:{tuple(t.dims)}:{hashlib.sha256(data).hexdigest()}"


def _point_at(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        t.ClearField(f)
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v
    t.data_location = onnx.TensorProto.EXTERNAL


def save_shared(models: dict[str, onnx.ModelProto], out_dir: Path, weights_name: str) -> dict[str, Path]:
    """Save each model as out_dir/<key>.onnx; large initializers go once into out_dir/weights_name."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    offsets: dict[str, tuple[int, int]] = {}
    written: dict[str, Path] = {}
    with open(out_dir / weights_name, "wb") as wf:
        for key, model in models.items():
            for t in model.graph.initializer:
                data = _tensor_bytes(t)
                if len(data) < INLINE_LIMIT:
                    continue
                ck = _content_key(t, data)
                if ck not in offsets:
                    pad = (-wf.tell()) % ALIGN
                    wf.write(b"\0" * pad)
                    offsets[ck] = (wf.tell(), len(data))
                    wf.write(data)
                offset, length = offsets[ck]
                _point_at(t, weights_name, offset, length)
            path = out_dir / f"{key}.onnx"
            with open(path, "wb") as f:
                f.write(model.SerializeToString())
            written[key] = path
        wf.flush()
        os.fsync(wf.fileno())
    return written


def rewrite_graph(graph: onnx.GraphProto, initializers: list[onnx.TensorProto], first: list[onnx.NodeProto]) -> None:
    """Replace the graph's initializers and put `first` (nodes feeding on them) ahead of its nodes."""
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(first + rest)


def load_with_weights(path: Path) -> onnx.ModelProto:
    """Load a graph and pull its external weights into memory (for passes that rewrite them)."""
    return onnx.load(str(path), load_external_data=True)
