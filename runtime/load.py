"""`load_artifact`: open an artifact and warm it up for the generation its recipe describes."""

from __future__ import annotations

import time
from pathlib import Path

from runtime.artifact import Artifact, open_artifact
from runtime.request import method_settings, speculation_method
from runtime.speculative import warm_up


def load_artifact(path: str | Path, verify: bool = True, threads: int | None = None, device_cache: bool | None = None,
                  cuda_graph: bool | None = None) -> Artifact:
    """Check and load an artifact (runtime.artifact.open_artifact says what is refused), then run once
    the graphs a generation as the recipe says (its speculation method, if on) calls, so that the first
    generation's first token and first probe do not pay the sessions' first runs."""
    start = time.perf_counter()
    art = open_artifact(path, verify, threads, device_cache, cuda_graph)
    method = speculation_method(art, None)
    warm_up(art, method, method_settings(art, method, None, None))
    art.load_seconds = time.perf_counter() - start  # opening and warming up
    return art


def artifact_of(artifact: str | Path | Artifact) -> Artifact:
    """An entry point's artifact: the one given, or the one at that path, loaded."""
    return artifact if isinstance(artifact, Artifact) else load_artifact(artifact)
