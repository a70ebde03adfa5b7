"""An artifact opened once (checked against its manifest) for repeated generation calls: its runners,
tokenizer and n-gram table (runtime/load.py warms it up for the recipe's generation)."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common import ngram_table
from common.manifest import ArtifactError, Manifest, read_manifest
from common.ngram_table import NgramTable, NgramTableError
from common.resources import check_memory
from common.targets import check_prepacked, check_target, get_target
from kernels import GPU_LOWERING, NATIVE_LOWERINGS, require_cuda_library, require_library
from runtime.model_runner import ModelRunner
from runtime.tokenizer import Tokenizer


class ArtifactBusyError(RuntimeError):
    """A second generation started on an artifact whose runners a live generation holds."""


@dataclass
class Artifact:
    path: Path
    manifest: Manifest
    tokenizer: Tokenizer
    runners: dict[str, ModelRunner]
    load_seconds: float
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    ngram_table: NgramTable | None = None  # prompt lookup's n-gram draft, where the recipe ships one
    engine: Any = field(default=None, repr=False)  # generations' engine (engine.engine_of), made at first use
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _owner: int | None = field(default=None, repr=False)
    _holder: str | None = field(default=None, repr=False)

    @contextmanager
    def exclusive(self, holder: str = "generation") -> Iterator[None]:
        """Hold the artifact's runners for one generation: their caches are the generation's state.

        Another thread waits its turn; a second live generation in the same thread (e.g. two
        interleaved stream() iterators) would corrupt the first, so it is refused instead. While a
        scheduler (holder "scheduler") serves the artifact, it holds the runners for good: other
        generations are refused at once rather than waiting forever.
        """
        me = threading.get_ident()
        if self._holder == "scheduler" and self._owner != me:
            raise ArtifactBusyError(f"artifact {self.path} is served by a scheduler (serve.app): send "
                                    "requests to it, or load the artifact a second time for direct use")
        if self._owner == me:
            raise ArtifactBusyError(
                f"artifact {self.path} is in use by another generation in this thread (an unfinished "
                "stream() iterator?): finish or close() it first, or load the artifact once per stream"
            )
        with self._lock:
            self._owner, self._holder = me, holder
            try:
                yield
            finally:
                self._owner, self._holder = None, None

    @property
    def tlm(self) -> ModelRunner:
        return self.runners["tlm"]

    @property
    def dlm(self) -> ModelRunner:
        if "dlm" not in self.runners:
            raise ArtifactError(f"artifact {self.path} has no draft model; speculative decoding needs one")
        return self.runners["dlm"]


def memory_needed(path: Path, manifest: Manifest) -> int:
    """Bytes a loaded artifact keeps in use: the prepacked half of each weights file (a file holds
    the raw weights, read once at load, and their prepacked form, read every step; estimated as
    half), the KV cache and each graph's input and output buffers."""
    total = 0
    for entry in manifest.models.values():
        weights = path / entry.weights
        total += weights.stat().st_size // 2 if weights.is_file() else 0  # a missing file: refused when loaded
        d, c = entry.dims, manifest.capacity
        kv = 2 * d.n_layers * d.n_kv_heads * d.head_dim * np.dtype(d.kv_dtype).itemsize
        total += kv * c * manifest.batch_size
        total += sum(g.tokens * (kv + 4 * (d.vocab_size + c + g.tokens)) for g in entry.graphs.values())
    return total


def open_artifact(path: str | Path, verify: bool = True, threads: int | None = None, device_cache: bool | None = None,
                  cuda_graph: bool | None = None) -> Artifact:
    """Check and open an artifact, its graphs not run yet; refuses a missing, corrupted or incompatible one
    (ArtifactError, TargetUnavailableError for prepacked weights built for another CPU or ONNX Runtime
    version, or a GPU target without a usable GPU). `device_cache`, `cuda_graph`: see ModelRunner."""
    start = time.perf_counter()
    path = Path(path)
    manifest = read_manifest(path, verify=verify)
    target = get_target(manifest.target)  # resolved once: every runner and session takes the record
    check_target(target)
    check_prepacked(manifest.prepacked_for)
    if any(e.quant.get("lowering") in NATIVE_LOWERINGS or e.batch_invariant for e in manifest.models.values()):
        require_library()  # a clear error now, rather than ONNX Runtime's unknown op at the first graph
    if any(e.quant.get("lowering") == GPU_LOWERING for e in manifest.models.values()):
        require_cuda_library()
    check_memory(memory_needed(path, manifest), f"artifact {path}",
                 "half of each weights file, the form a decode step reads, plus the KV caches and buffers")
    try:
        tokenizer = Tokenizer(path / manifest.tokenizer_dir)
    except Exception as exc:  # noqa: BLE001 - a missing or damaged tokenizer file, whatever the parser raises
        raise ArtifactError(f"artifact {path}: tokenizer cannot be loaded: {exc}") from None
    runners = {
        role: ModelRunner(path, entry, manifest.capacity, manifest.context_length, target, threads,
                          device_cache, cuda_graph)
        for role, entry in manifest.models.items()
    }
    # ONNX Runtime prepacks each weight once more at load to match it with its mapped blob, then frees that
    # copy; glibc keeps freed heap unless asked, which would look like a second copy (not glibc: nothing to ask)
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    table = None
    if ngram_table.FILE in manifest.files:
        try:
            table = NgramTable.load(path / ngram_table.FILE)
        except NgramTableError as exc:
            raise ArtifactError(f"artifact {path}: {exc}") from None
        if table.vocab_size != manifest.models["tlm"].dims.vocab_size:
            raise ArtifactError(f"artifact {path}: its n-gram table is for a vocabulary of {table.vocab_size} tokens, "
                                f"the TLM has {manifest.models['tlm'].dims.vocab_size}")
    eos = frozenset({*manifest.models["tlm"].eos_token_ids, tokenizer.eos_token_id} - {None})
    return Artifact(path=path, manifest=manifest, tokenizer=tokenizer, runners=runners,
                    load_seconds=time.perf_counter() - start, eos_token_ids=eos, ngram_table=table)
