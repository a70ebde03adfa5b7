"""The compiled artifact's manifest: what was built, from what, for which shapes, and checksums.

The runtime trusts nothing it has not checked against this file: a missing file, a checksum
mismatch or a format version it does not know are refused with an error that says which.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from common.graph_io import ModelDims

FORMAT_VERSION = 5  # 2: prepacked weights in the shared weights file; 3: score{k} graphs with measured costs;
# 4: MXMatMul weights in groups of 16 columns (kernels/layout.py); 5: norms and gates folded into MXMatMul
# (its `prologue`, compiler/matmul_prologue.py) and ai.mxspd::RotaryAttention, which an older kernel
# library cannot run
MANIFEST_NAME = "manifest.json"


class ArtifactError(RuntimeError):
    """A compiled artifact that is missing, corrupted or does not fit the request."""


@dataclass(frozen=True)
class GraphEntry:
    file: str
    tokens: int  # T: new tokens per call
    cost_ms: float = 0.0  # one call, measured by the compiler on the build machine


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
    batch_invariant: bool = False  # graphs run by mxspd's row-invariant kernels (compiler/invariance.py)


@dataclass(frozen=True)
class Manifest:
    name: str
    target: str
    context_length: int  # the longest sequence, in positions
    prefill_chunk: int
    k: int
    batch_size: int
    models: dict[str, ModelEntry]  # "tlm" and optionally "dlm"
    tokenizer_dir: str
    files: dict[str, str]  # relative path -> sha256
    recipe: dict[str, Any]
    tools: dict[str, str]
    prepacked_for: dict[str, str] = field(default_factory=dict)  # platform the prepacked weights fit
    build_seconds: float = 0.0
    kv_slots: int = 0  # KV cache slots, shared by a server's requests (0: context_length)
    format_version: int = FORMAT_VERSION

    @property
    def capacity(self) -> int:
        """The KV cache's slots (the graphs' cache dimension)."""
        return self.kv_slots or self.context_length

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse and schema-check a manifest: every field typed, every needed file listed."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ArtifactError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(
                f"artifact format version {version!r} is not supported (expected {FORMAT_VERSION}); "
                "re-run `python -m export` with this version of the toolkit"
            )
        manifest = _typed(cls, data, "manifest")
        manifest._check_files()
        return manifest

    def needed_files(self) -> list[str]:
        """The files loading needs: every graph and weights file (the tokenizer is checked as a folder)."""
        return [f for m in self.models.values() for f in (*(g.file for g in m.graphs.values()), m.weights)]

    def _check_files(self) -> None:
        if "tlm" not in self.models:
            raise ArtifactError("models: no 'tlm' entry")
        for rel, digest in self.files.items():
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise ArtifactError(f"files: {rel!r} is not a path inside the artifact")
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ArtifactError(f"files[{rel!r}]: {digest!r} is not a sha256 hex digest")
        unlisted = [f for f in self.needed_files() if f not in self.files]
        if not any(Path(f).parts[0] == self.tokenizer_dir for f in self.files):
            unlisted.append(f"{self.tokenizer_dir}/*")
        if unlisted:
            raise ArtifactError(f"files: no checksum for {unlisted}; every file the artifact needs must be listed")


def _typed(kind: Any, value: Any, where: str) -> Any:
    """Check `value` (parsed JSON) against a type annotation and build it; errors name the key."""
    origin, args = get_origin(kind), get_args(kind)
    if is_dataclass(kind):
        if not isinstance(value, dict):
            raise ArtifactError(f"{where}: expected an object, got {type(value).__name__}")
        hints = get_type_hints(kind)
        required = {f.name for f in fields(kind) if f.default is MISSING and f.default_factory is MISSING}
        missing, unknown = sorted(required - set(value)), sorted(set(value) - set(hints))
        if missing or unknown:
            raise ArtifactError(f"{where}: missing keys {missing}, unknown keys {unknown}")
        return kind(**{k: _typed(hints[k], v, f"{where}.{k}") for k, v in value.items()})
    if kind is Any:
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ArtifactError(f"{where}: expected an object, got {type(value).__name__}")
        return {k: _typed(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list):
            raise ArtifactError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_typed(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    ok = isinstance(value, (int, float) if kind is float else kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        raise ArtifactError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


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
    if artifact_dir.exists() and not artifact_dir.is_dir():
        raise ArtifactError(f"{artifact_dir} is a file, not an artifact folder (pass the folder `python -m export` "
                            "wrote, e.g. artifacts/<recipe>)")
    if not artifact_dir.is_dir():
        raise ArtifactError(f"no artifact at {artifact_dir}: the folder does not exist")
    if not path.is_file():
        raise ArtifactError(
            f"{artifact_dir} is not a compiled artifact: {MANIFEST_NAME} is missing "
            "(an interrupted export leaves no manifest; re-run `python -m export`)"
        )
    try:
        manifest = Manifest.from_json(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is corrupted: {exc}") from None
    except ArtifactError as exc:
        raise ArtifactError(f"{path}: {exc}") from None
    if verify:
        for rel, digest in manifest.files.items():
            f = artifact_dir / rel
            if not f.is_file():
                raise ArtifactError(f"artifact {artifact_dir} is missing {rel}")
            if sha256_file(f) != digest:
                raise ArtifactError(f"artifact {artifact_dir}: {rel} is corrupted (sha256 mismatch)")
    return manifest
