"""Streams a model's weights, one tensor at a time, from its checkpoint into an artifact's weights file.

The traced graphs name every weight they read (`WeightRef`); here each named tensor is read from
the checkpoint's safetensors (plain reads, in the dtype it is stored in), converted to float32,
transposed if the graph reads it as [in, out], checked, passed through the weight passes (MX
quantisation, float16 storage) and appended to the shared weights file before the next one is
read. Peak memory is a few copies of the largest tensor, not the model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from tqdm import tqdm

from common.onnx_store import SharedFile
from export.loader import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}

TensorSource = Callable[[str], torch.Tensor]  # a state-dict key -> the tensor as stored


class WeightPasses(Protocol):
    """What the exporter needs of the quant stage's passes (quant.onnx_pass.PassChain)."""

    def store(self, t: onnx.TensorProto, matmul: bool, embedding: bool = False) -> list[onnx.TensorProto]: ...

    def nodes(self, model: onnx.ModelProto, names: list[str]) -> list[onnx.NodeProto]: ...

    def info(self) -> dict: ...


class KeepWeights:
    """No passes: every weight stored as read (float32)."""

    def store(self, t: onnx.TensorProto, matmul: bool, embedding: bool = False) -> list[onnx.TensorProto]:
        return [t]

    def nodes(self, model: onnx.ModelProto, names: list[str]) -> list[onnx.NodeProto]:
        return []

    def info(self) -> dict:
        return {}


KEEP_WEIGHTS = KeepWeights()


@dataclass(frozen=True)
class WeightRef:
    """A weight a traced graph reads: its initializer name, where it comes from, and how."""

    name: str  # initializer name, e.g. "layers.0.mlp.up_proj.weight.T"
    keys: tuple[str, ...]  # state-dict names of the tensor (tied weights have several)
    transpose: bool  # the graph reads the [out, in] Linear weight as [in, out]
    shape: tuple[int, ...]  # as the graph reads it


class CheckpointTensors:
    """A checkpoint's tensors by state-dict key, read one at a time from its safetensors files.

    Each tensor is read with a plain seek and read, not through a memory map: pages of a mapped file
    stay in the process's resident set once touched, so mapping a 13 GB checkpoint would make the
    exporter's peak the checkpoint's size. The format is a little-endian u64 header length, a JSON
    header (dtype, shape, data_offsets per tensor) and the data.
    """

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        index = model_dir / SAFETENSORS_INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            found = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            raise CheckpointError(
                f"{model_dir} has no safetensors weights{f' (found {found})' if found else ''}: the exporter "
                "streams safetensors only (pickled .bin checkpoints are never unpickled); convert it with "
                "`model.save_pretrained(dir, safe_serialization=True)` on a trusted machine"
            )
        self.entries: dict[str, tuple[Path, int, dict]] = {}  # key -> (file, data start, header entry)
        for name in files:
            path = model_dir / name
            if not path.is_file():
                raise CheckpointError(f"{model_dir}: weights file {name} named by {SAFETENSORS_INDEX} is missing")
            try:
                with open(path, "rb") as f:
                    (size,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(size))
            except (struct.error, ValueError) as exc:
                raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
            header.pop("__metadata__", None)
            self.entries |= {key: (path, 8 + size, entry) for key, entry in header.items()}

    def __call__(self, key: str) -> torch.Tensor:
        path, start, entry = self.entries[key]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {entry['dtype']}, not a float type")
        begin, end = entry["data_offsets"]
        data = bytearray(end - begin)
        with open(path, "rb") as f:
            f.seek(start + begin)
            if f.readinto(data) != len(data):
                raise CheckpointError(f"{path} is truncated: tensor {key!r} runs past the end of the file")
        if not data:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"])


def checkpoint_tensors(model_dir: Path) -> TensorSource:
    """The tensor source of a resolved checkpoint folder: safetensors, or the GGUF file it stands for."""
    from export.gguf_checkpoint import GGUFTensors, is_gguf_folder

    return GGUFTensors(model_dir) if is_gguf_folder(model_dir) else CheckpointTensors(model_dir)


def model_tensors(model: torch.nn.Module) -> TensorSource:
    """A source over an in-memory model's parameters and buffers (tests, benchmarks)."""
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    return lambda key: state[key]


def check_finite(array: np.ndarray, key: str, role: str) -> None:
    """Refuse NaN/Inf weights, naming the tensor: they would export fine and generate garbage."""
    if not np.isfinite(array).all():
        kinds = [k for k, bad in (("NaN", np.isnan(array)), ("Inf", np.isinf(array))) if bad.any()]
        raise CheckpointError(
            f"{role} weight {key!r} contains {' and '.join(kinds)} "
            f"({int((~np.isfinite(array)).sum())} of {array.size} values); the checkpoint is damaged"
        )


def read_weight(ref: WeightRef, source: TensorSource, role: str) -> onnx.TensorProto:
    """One weight as the graph reads it: float32, transposed if needed, checked finite."""
    for key in ref.keys:
        try:
            tensor = source(key)
        except KeyError:
            continue
        break
    else:
        raise CheckpointError(f"{role} checkpoint has no tensor {' or '.join(map(repr, ref.keys))} "
                              f"(needed for {ref.name}): it does not match its config")
    expected = ref.shape[::-1] if ref.transpose else ref.shape
    if tuple(tensor.shape) != expected:
        raise CheckpointError(f"{role} weight {key!r} has shape {list(tensor.shape)} in the checkpoint; its config "
                              f"implies {list(expected)}")
    tensor = tensor.detach().to(torch.float32)
    tensor = tensor.t() if ref.transpose else tensor
    array = np.ascontiguousarray(tensor.numpy())
    check_finite(array, key, role)
    return numpy_helper.from_array(array, ref.name)


def write_weights(
    refs: Sequence[WeightRef],
    source: TensorSource,
    shared: SharedFile,
    passes: WeightPasses,
    matmul: set[str],
    tables: set[str],
    role: str,
    progress: bool = True,
) -> dict[str, list[onnx.TensorProto]]:
    """Stream each weight through the passes into `shared`; returns weight name -> its stored
    initializers (pointing into the file, or inline if small). `matmul`: the MatMul weights;
    `tables`: the embedding tables (common.onnx_store)."""
    stored: dict[str, list[onnx.TensorProto]] = {}
    total = sum(4 * int(np.prod(r.shape)) for r in refs)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"weights {role}",
              disable=not progress) as bar:
        for i, ref in enumerate(refs):
            tensors = passes.store(read_weight(ref, source, role), ref.name in matmul, ref.name in tables)
            stored[ref.name] = [shared.external(t) for t in tensors]
            bar.update(4 * int(np.prod(ref.shape)))
            bar.set_postfix_str(f"{i + 1}/{len(refs)} tensors", refresh=False)
    return stored


def unique_refs(ref_lists: Iterable[Sequence[WeightRef]]) -> list[WeightRef]:
    """Every weight the graphs read, once, in first-use order."""
    seen: dict[str, WeightRef] = {}
    for refs in ref_lists:
        for ref in refs:
            if seen.setdefault(ref.name, ref) != ref:
                raise ValueError(f"graphs disagree about weight {ref.name}: {seen[ref.name]} vs {ref}")
    return list(seen.values())

