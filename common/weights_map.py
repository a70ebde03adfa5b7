"""A model's weights file mapped once per process, in 2 MiB pages where the kernel allows.

A decode step reads every weight once: the default recipe's 126 MB is ~31,000 pages of 4 KiB per
token, each a TLB miss, and ONNX Runtime maps each external tensor on its own (one small mapping per
tensor and session, none 2 MiB aligned, so none can use 2 MiB entries). One mapping of the whole file
with MADV_HUGEPAGE is mapped with 2 MiB entries wherever the page cache holds the file in 2 MiB
folios, which reading the file from disk produces (through this mapping, or sequential reads; Linux
6.x on ext4). Decode was 1.03-1.08x faster that way (docs/benchmarks-history.md, session 25).

Pages that a build wrote, or that another mapping faulted in 4 KiB at a time, sit in small folios.
If most of the file is not mapped in 2 MiB entries after a first touch, its page cache is dropped
once (the kernel drops clean pages only, and none that another process maps) and the file is read
again, the first process to load it paying one read of the file. Where that read did not help (a
filesystem without large folios: tmpfs, ext4 before Linux 6.16), the cache remembers it for that
kernel and filesystem, and no later load reads again.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from pathlib import Path

import numpy as np

from common.cache import cache_root

_THP = Path("/sys/kernel/mm/transparent_hugepage")
_REREAD_BELOW = 0.5  # share of the used 2 MiB pages mapped huge under which the file is read again
NO_GAIN_FILE = "no-huge-folios.json"  # in cache_root(): kernels and filesystems where reading again did not help


def _pmd_size() -> int:
    try:
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20  # x86-64's


HUGE = _pmd_size()


def huge_pages_possible() -> bool:
    """The kernel has transparent huge pages and lets a mapping ask for them."""
    try:
        return "[never]" not in (_THP / "enabled").read_text()
    except OSError:
        return False


def _no_gain_key(path: Path) -> str:
    return f"{os.uname().release} dev {os.stat(path).st_dev}"


def _no_gain() -> set[str]:
    try:
        return set(json.loads((cache_root() / NO_GAIN_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def _remember_no_gain(key: str) -> None:
    """Best effort: a read-only home only means the next load tries again."""
    path = cache_root() / NO_GAIN_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{os.getpid()}")
        staged.write_text(json.dumps(sorted(_no_gain() | {key})))
        os.replace(staged, path)
    except OSError:
        pass


def _pmd_mapped_bytes(address: int) -> int | None:
    """Bytes of the mapping that starts at `address` mapped with 2 MiB entries (/proc/self/smaps);
    None where the kernel does not say."""
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    start = f"{address:x}-"
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
        if block.lstrip("\n").startswith(start):
            found = re.search(r"^FilePmdMapped:\s+(\d+) kB", block, re.MULTILINE)
            return int(found.group(1)) << 10 if found else None
    return None


def _huge_spans(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The whole 2 MiB pages of a file of `size` bytes that the byte ranges (offset, length) meet, merged
    into (start, end) spans."""
    spans: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        start, end = offset // HUGE * HUGE, min(-(-(offset + length) // HUGE) * HUGE, size // HUGE * HUGE)
        if start >= end:
            continue
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((start, end))
    return spans


class WeightsMap:
    """The file at `path`, read-only, of which the byte ranges (offset, length) `used` are read (default:
    all of it); `huge_fraction`: the share of their whole 2 MiB pages mapped with 2 MiB entries after
    loading (None where unknown: no transparent huge pages, or no /proc). The used pages are mapped at
    load, and only those: an artifact's weights file also holds weights that ONNX Runtime reads once at
    load (raw copies of its prepacked blobs), which this must not keep in the process."""

    def __init__(self, path: Path, used: list[tuple[int, int]] | None = None) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self.huge_fraction: float | None = None
        self._map = self._open()
        if self._map is None:
            self.array = np.zeros(0, dtype=np.uint8)
            return
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self._spans = _huge_spans([(0, self.size)] if used is None else used, self.size)
        if not huge_pages_possible() or not self._spans:
            return
        self.huge_fraction = self._touch()
        if self.huge_fraction is not None and self.huge_fraction < _REREAD_BELOW:
            key = _no_gain_key(self.path)
            if key not in _no_gain():
                self._reread()
                if self.huge_fraction is not None and self.huge_fraction < _REREAD_BELOW:
                    _remember_no_gain(key)

    def _open(self) -> mmap.mmap | None:
        if self.size == 0:
            return None
        with open(self.path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        return m

    def _touch(self) -> float | None:
        """Fault in one byte of each used 2 MiB page (the kernel maps a whole 2 MiB folio at once, or reads
        one in where the page cache lacks it), then ask how much of them is mapped huge."""
        address = self.array.ctypes.data
        if address % HUGE:
            return None  # the kernel did not align the mapping: 2 MiB entries cannot fit it
        for start, end in self._spans:
            int(self.array[start:end:HUGE].sum())
        pmd = _pmd_mapped_bytes(address)
        return None if pmd is None else pmd / sum(end - start for start, end in self._spans)

    def _reread(self) -> None:
        """Drop the used pages from the page cache (small folios) and map the file again, so that they
        are read in 2 MiB."""
        self.array = np.zeros(0, dtype=np.uint8)
        self._map.close()
        try:
            with open(self.path, "rb") as f:
                for start, end in self._spans:
                    os.posix_fadvise(f.fileno(), start, end - start, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # only speed is lost: map the file as it is cached
        self._map = self._open()
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.huge_fraction = self._touch()

    def view(self, offset: int, length: int) -> np.ndarray:
        """`length` bytes at `offset`, read-only, without a copy; shorter where the file ends first."""
        return self.array[offset:offset + length]
