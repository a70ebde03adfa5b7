"""One copy of a model's weights for all of its graphs' sessions.

ONNX Runtime gives each session its own copy of every initializer on the session's device. On a GPU
nine graphs held nine copies (a 7B-wide model with 2 layers took 22.7 GB of GPU memory for 1.6 GB of
weights: docs/benchmarks.md, "GPU target"), and a 7B model would not fit an 80 GB GPU at all. On the
CPU its sessions map the weights file, but one small mapping per tensor, in 4 KiB pages; one mapping
of the whole file in 2 MiB pages decodes 1.13-1.16x faster (common/weights_map.py).
`SessionOptions.add_initializer` hands a session a tensor to use instead of its own, in place when
the tensor already lives on the device the session plans it on. The compiler lists each graph's
initializers to share (common/graph_io.py's INITIALIZERS_FILE); this puts each distinct one (same
bytes of the weights file, same type and shape) on the device once, or on the CPU hands out a view of
the one mapping."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from common.graph_io import INITIALIZERS_FILE
from common.manifest import ArtifactError
from common.weights_map import WeightsMap


def _row_ok(row: object) -> bool:
    return (isinstance(row, list) and len(row) == 5 and all(isinstance(x, str) for x in row[:2])
            and isinstance(row[2], list) and all(isinstance(d, int) and d >= 0 for d in row[2])
            and all(isinstance(x, int) and x >= 0 for x in row[3:]))


class SharedWeights:
    def __init__(self, model_dir: Path, weights: Path, device: str) -> None:
        """`model_dir`: the model's folder in the artifact (its INITIALIZERS_FILE); `weights`: the
        weights file the offsets point into; `device`: where the tensors go ("cuda", or "cpu": views of
        one mapping of the file, no copy)."""
        index = Path(model_dir) / INITIALIZERS_FILE
        try:
            self.index: dict[str, list] = json.loads(index.read_text())
            if not all(_row_ok(row) for rows in self.index.values() for row in rows):
                raise ValueError("a row is not [name, dtype, dims, offset, length]")
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            raise ArtifactError(f"{index}: cannot read the initializer index ({exc}); "
                                "re-run `python -m export`") from exc
        self.device, self.weights = device, Path(weights)
        self.values: dict[tuple, ort.OrtValue] = {}  # held as long as any session that uses them
        try:  # on the CPU, the values' memory
            used = [(row[3], row[4]) for rows in self.index.values() for row in rows]
            self.map = WeightsMap(self.weights, used) if device == "cpu" else None
        except OSError as exc:
            raise ArtifactError(f"{self.weights}: cannot map the weights file ({exc}); re-run `python -m export`"
                                ) from exc

    @classmethod
    def available(cls, model_dir: Path, weights: Path, device: str) -> SharedWeights | None:
        """The model's shared weights if the compiler wrote its index (artifacts built before it: None)."""
        return cls(model_dir, weights, device) if (Path(model_dir) / INITIALIZERS_FILE).is_file() else None

    def add_to(self, graph: str, so: ort.SessionOptions) -> ort.SessionOptions:
        """Give the session that `so` opens for `graph` the shared copy of each of its large weights."""
        for name, dtype, dims, offset, length in self.index.get(graph, []):
            key = (offset, length, dtype, tuple(dims))
            if key not in self.values:
                array = (self.map.view(offset, length) if self.map is not None
                         else np.fromfile(self.weights, dtype=np.uint8, count=length, offset=offset))
                if array.size != length:
                    raise ArtifactError(f"{self.weights}: {name} at {offset} has {array.size} bytes, not {length}")
                self.values[key] = ort.OrtValue.ortvalue_from_numpy(
                    array.view(np.dtype(dtype)).reshape(dims), self.device, 0)
            so.add_initializer(name, self.values[key])
        return so

    @property
    def nbytes(self) -> int:
        """Bytes held (once) for all the sessions."""
        return sum(int(k[1]) for k in self.values)
