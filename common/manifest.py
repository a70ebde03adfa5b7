"""The compiled artifact's manifest: what was built, from what, for which shapes, and checksums.

The runtime trusts nothing it has not checked against this file: a missing file, a checksum
mismatch or a format version it does not know are refused with an error that says which.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.graph_io import ModelDims

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


class ArtifactError(RuntimeError):
    """A compiled artifact that is missing, corrupted or does not fit the request."""


@dataclass(frozen=True)
class GraphEntry:
    file: str
    tokens: int  # T: new tokens per call


@dataclass(frozen=True)
class ModelEntry:
    source: str
    model_type: str
    dims: ModelDims
    graphs: dict[str, GraphEntry]
    weights: str
    dtype: str = "float32"
    quant: dict[str, Any] = field(default_factory=dict)  # MX format and lowering, empty if none
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Manifest:
    name: str
    target: str
    context_length: int
    prefill_chunk: int
    k: int
    batch_size: int
    models: dict[str, ModelEntry]  # "tlm" and optionally "dlm"
    tokenizer_dir: str
    files: dict[str, str]  # relative path -> sha256
    recipe: dict[str, Any]
    tools: dict[str, str]
    build_seconds: float = 0.0
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"artifact format version {version!r} is not supported (expected {FORMAT_VERSION}); "
                "re-run `python -m export` with this version of the toolkit"
            )
        models = {}
        for role, m in data["models"].items():
            graphs = {g: GraphEntry(**e) for g, e in m.pop("graphs").items()}
            dims = ModelDims(**m.pop("dims"))
            m["eos_token_ids"] = tuple(m.get("eos_token_ids", ()))
            models[role] = ModelEntry(dims=dims, graphs=graphs, **m)
        data["models"] = models
        return cls(**data)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(artifact_dir: Path, verify: bool = True) -> Manifest:
    """Load and (optionally) checksum an artifact; raise ArtifactError naming what is wrong."""
    artifact_dir = Path(artifact_dir)
    path = artifact_dir / MANIFEST_NAME
    if not artifact_dir.is_dir():
        raise ArtifactError(f"no artifact at {artifact_dir}: the folder does not exist")
    if not path.is_file():
        raise ArtifactError(
            f"{artifact_dir} is not a compiled artifact: {MANIFEST_NAME} is missing "
            "(an interrupted export leaves no manifest; re-run `python -m export`)"
        )
    try:
        manifest = Manifest.from_json(path.read_text())
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{path} is corrupted: {exc}") from None
    if verify:
        for rel, digest in manifest.files.items():
            f = artifact_dir / rel
            if not f.is_file():
                raise ArtifactError(f"artifact {artifact_dir} is missing {rel}")
            if sha256_file(f) != digest:
                raise ArtifactError(f"artifact {artifact_dir}: {rel} is corrupted (sha256 mismatch)")
    return manifest
