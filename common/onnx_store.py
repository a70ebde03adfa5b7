"""Writes several ONNX graphs of one model so that they share one weights file.

Graphs of a model (prefill, decode, score) are traced separately, so each arrives with its own
copy of every weight. Here identical tensors (same bytes, dtype and shape) are stored once in a
single external-data file, page-aligned so ONNX Runtime can memory-map it, and every graph points
at the same offsets. Small tensors stay inline.

Optimised graphs may also carry ONNX Runtime's prepacked weights: an `external_data` entry
`prepacked_N` = `KEY|offset;length;alignment` beside the raw tensor's own location. Those blobs are
deduplicated into the same file the same way, so every session of the model maps one copy.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import numpy_helper

from common.graph_io import INPUT_IDS

INLINE_LIMIT = 1024  # bytes; smaller initializers stay inside the graph
ALIGN = 4096


def _tensor_bytes(t: onnx.TensorProto) -> bytes:
    data = t.raw_data  # each read of the field copies it out of the message: read it once
    return data if data else numpy_helper.to_array(t).tobytes()


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


class SharedFile:
    """An external-data file in which each distinct byte string is written once, page-aligned."""

    def __init__(self, f: BinaryIO, name: str) -> None:
        self.f, self.name = f, name
        self.offsets: dict[str, tuple[int, int]] = {}

    def put(self, key: str, data: bytes) -> tuple[int, int]:
        if key not in self.offsets:
            self.f.write(b"\0" * ((-self.f.tell()) % ALIGN))  # ORT maps prepacked blobs only if aligned
            self.offsets[key] = (self.f.tell(), len(data))
            self.f.write(data)
        return self.offsets[key]

    def external(self, t: onnx.TensorProto) -> onnx.TensorProto:
        """A new initializer pointing at t's data, written into the file once per distinct content
        (t itself if small). A new message, so that t's memory goes with t: protobuf keeps a cleared
        field's bytes until the whole message is freed."""
        data = _tensor_bytes(t)
        if len(data) < INLINE_LIMIT:
            return t
        pointer = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)
        _point_at(pointer, self.name, *self.put(_content_key(t, data), data))
        return pointer

    def span(self, members: list[onnx.TensorProto], name: str) -> onnx.TensorProto | None:
        """`members` concatenated along their first axis as a tensor named `name` that points at their
        bytes where they lie back to back in this file (nothing is written); None where they do not."""
        first, places = members[0], []
        for t in members:
            info = {e.key: e.value for e in t.external_data}
            if (t.data_location != onnx.TensorProto.EXTERNAL or info.get("location") != self.name
                    or t.data_type != first.data_type or t.dims[1:] != first.dims[1:]):
                return None
            places.append((int(info.get("offset", 0)), int(info["length"])))
        ends = [offset + length for offset, length in places]
        if [offset for offset, _ in places[1:]] != ends[:-1]:
            return None
        pointer = onnx.TensorProto(name=name, data_type=first.data_type,
                                   dims=[sum(t.dims[0] for t in members), *first.dims[1:]])
        _point_at(pointer, self.name, places[0][0], sum(length for _, length in places))
        return pointer

    def store(self, t: onnx.TensorProto) -> None:
        """Move a large initializer's data into the file, in place (see `external`)."""
        pointer = self.external(t)
        if pointer is not t:
            t.CopyFrom(pointer)


Models = dict[str, onnx.ModelProto] | Iterable[tuple[str, onnx.ModelProto]]


def _save_all(models: Models, out_dir: Path, weights_name: str, place) -> dict[str, Path]:
    """Write out_dir/weights_name through `place(shared_file, key, model)`, then each model's .onnx.

    `models` may be a generator of (key, model): each model is then written and dropped before the
    next is made, so only one graph's weights are in memory at a time."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    with shared_file(out_dir / weights_name) as shared:
        for key, model in models.items() if isinstance(models, dict) else models:
            place(shared, key, model)
            written[key] = save_graph(model, out_dir / f"{key}.onnx")
            del model  # before the generator makes the next one
    return written


@contextmanager
def shared_file(path: Path) -> Iterator[SharedFile]:
    """A SharedFile written at `path`, synced to disk when the block ends."""
    with open(path, "wb") as f:
        yield SharedFile(f, Path(path).name)
        f.flush()
        os.fsync(f.fileno())


def save_graph(model: onnx.ModelProto, path: Path) -> Path:
    """Write a graph whose weights are already external (or small)."""
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return Path(path)


def save_shared(models: Models, out_dir: Path, weights_name: str) -> dict[str, Path]:
    """Save each model as out_dir/<key>.onnx; large initializers go once into out_dir/weights_name."""

    def place(shared: SharedFile, key: str, model: onnx.ModelProto) -> None:
        for t in model.graph.initializer:
            shared.store(t)

    return _save_all(models, out_dir, weights_name, place)


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise ValueError(f"{path}: external data at {offset} is {len(data)} bytes, not {length}")
    return data


def merge_external(graphs: Iterable[tuple[str, Path]], out_dir: Path, weights_name: str) -> dict[str, Path]:
    """Copy graphs saved with their own external data (and prepacked blobs) into out_dir, sharing
    one deduplicated weights file; each prepacked entry keeps its key and points at its new offset.

    `graphs` may be a generator of (key, path): each graph is then merged before the next is asked
    for, so its maker may delete the previous graph's files and disk holds one transient copy."""
    sources: dict[str, Path] = {}

    def loaded() -> Iterator[tuple[str, onnx.ModelProto]]:
        for key, path in graphs:
            sources[key] = Path(path).parent
            yield key, onnx.load(str(path), load_external_data=False)

    def place(shared: SharedFile, key: str, model: onnx.ModelProto) -> None:
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            src = sources[key] / info["location"]
            data = _read(src, int(info.get("offset", 0)), int(info["length"]))
            _point_at(t, weights_name, *shared.put(_content_key(t, data), data))
            for name, value in info.items():
                if name.startswith("prepacked"):
                    entry = t.external_data.add()
                    entry.key, entry.value = name, _move_prepacked(value, src, shared)

    return _save_all(loaded(), out_dir, weights_name, place)


def _move_prepacked(value: str, src: Path, shared: SharedFile) -> str:
    """`KEY|offset;length;alignment` read from src, stored in the shared file, pointed at anew."""
    try:
        key, where = value.split("|")
        offset, length, alignment = (int(x) for x in where.split(";"))
    except ValueError:
        raise ValueError(f"unexpected prepacked weights entry {value!r} (one KEY|offset;length;alignment "
                         "segment expected): an ONNX Runtime version this compiler does not know") from None
    data = _read(src, offset, length)
    new_offset, _ = shared.put("prepacked:" + hashlib.sha256(data).hexdigest(), data)
    return f"{key}|{new_offset};{length};{alignment}"


def matmul_weights(graph: onnx.GraphProto) -> set[str]:
    """Names read as the weight (second input) of a MatMul: the weights MX passes may quantize."""
    return {n.input[1] for n in graph.node if n.op_type == "MatMul"}


def embedding_tables(graph: onnx.GraphProto) -> set[str]:
    """Tensors whose rows a Gather picks by the graph's input ids: the token embedding tables."""
    return {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[1] == INPUT_IDS
            and all(a.i == 0 for a in n.attribute if a.name == "axis")}


def rewrite_graph(graph: onnx.GraphProto, initializers: list[onnx.TensorProto], first: list[onnx.NodeProto]) -> None:
    """Replace the graph's initializers and put `first` (nodes feeding on them) ahead of its nodes."""
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(first + rest)


def default_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def set_default_opset(model: onnx.ModelProto, version: int) -> None:
    """The standard-ops opset of the model and of its local functions (which must import the same)."""
    for imports in [model.opset_import, *(f.opset_import for f in model.functions)]:
        for o in imports:
            if o.domain in ("", "ai.onnx"):
                o.version = version


def read_tensor(t: onnx.TensorProto, base_dir: Path) -> bytes:
    """An initializer's bytes, inline or from its external-data file (relative to base_dir)."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return _tensor_bytes(t)
    info = {e.key: e.value for e in t.external_data}
    return _read(Path(base_dir) / info["location"], int(info.get("offset", 0)), int(info["length"]))
