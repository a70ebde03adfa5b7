"""What this machine can hold: memory and disk checks made before work that would not fit.

An out-of-memory kill loses the work and says nothing; a refusal up front names the estimate and
what the machine has, so the user can pick a smaller configuration or a bigger machine.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from common.manifest import ArtifactError

GIB = 1 << 30


class DoesNotFitError(ArtifactError):
    """A configuration that needs more memory or disk than this machine has."""


def available_memory() -> int:
    """Bytes the kernel estimates can be allocated without swapping (MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_disk(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def check_memory(needed: int, what: str, how: str) -> None:
    """Refuse `what` when it needs more than the available memory; `how` says where the estimate comes from."""
    have = available_memory()
    if needed > have:
        raise DoesNotFitError(f"{what} does not fit in memory: needs about {needed / GIB:.1f} GiB ({how}), "
                              f"this machine has {have / GIB:.1f} GiB available")


def check_disk(needed: int, path: Path, what: str, how: str) -> None:
    have = free_disk(path)
    if needed > have:
        raise DoesNotFitError(f"{what} does not fit on disk at {path}: needs about {needed / GIB:.1f} GiB ({how}), "
                              f"{have / GIB:.1f} GiB are free")
