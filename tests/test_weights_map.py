"""One mapping of each weights file for all of a model's CPU sessions, in 2 MiB pages where the kernel can.

Decode reads every weight once per token: in 4 KiB pages (ONNX Runtime's own mapping, one per tensor and
session) that is a TLB miss every 4 KiB; docs/benchmarks.md measures what 2 MiB pages are worth.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

import common.weights_map as weights_map
from benchmarks.chain import Chain
from common import graph_io
from common.manifest import read_manifest
from common.shared_weights import SharedWeights
from common.targets import TARGETS
from common.weights_map import HUGE, WeightsMap, huge_pages_possible
from compiler.build import _shared
from kernels import DOMAIN
from runtime.model_runner import ModelRunner
from tests.conftest import artifact

CPU, CUDA = TARGETS["ort-cpu"], TARGETS["ort-cuda"]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """What the runtime learns about this machine (NO_GAIN_FILE) goes to a cache of the test's own."""
    monkeypatch.setenv("MXSPD_CACHE", str(tmp_path / "cache"))


def _write(path: Path, size: int) -> bytes:
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:  # in 64 KiB writes, as a build writes tensor by tensor (and cp copies)
        for i in range(0, size, 1 << 16):
            f.write(data[i:i + (1 << 16)])
        f.flush()
        os.fsync(f.fileno())
    return data


def _pmd_fraction(path: Path, huge: bool) -> float:
    """FilePmdMapped share of a mapping of `path` (asking for huge pages or not) after touching every 2 MiB."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    int(a[::HUGE].sum())
    pmd = weights_map._pmd_mapped_bytes(a.ctypes.data) or 0
    del a
    m.close()
    return pmd / (path.stat().st_size // HUGE * HUGE)


def _page_cache_holds_2mib_folios(tmp: Path) -> bool:
    """This kernel and filesystem cache a file in 2 MiB folios when a huge-page mapping reads it from
    disk (ext4 on Linux 6.x does)."""
    probe = tmp / "probe.bin"
    _write(probe, 8 * HUGE)
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return _pmd_fraction(probe, huge=True) >= 0.9


def test_a_freshly_written_weights_file_is_mapped_in_2mib_pages(tmp_path, monkeypatch):
    """A build writes its weights file, which leaves it cached in small folios: mapped as it is, almost
    none of it is huge (the control); WeightsMap reads it again, and then nearly all of it is."""
    if not huge_pages_possible() or not _page_cache_holds_2mib_folios(tmp_path):
        pytest.skip("this kernel or filesystem does not cache files in 2 MiB folios")
    path = tmp_path / "weights.bin"
    data = _write(path, 16 * HUGE + 12345)
    monkeypatch.setattr(weights_map, "_REREAD_BELOW", 0.0)  # the control: no second read
    kept = WeightsMap(path)
    written_fraction = kept.huge_fraction
    del kept
    if written_fraction is not None and written_fraction >= 0.5:
        pytest.skip(f"this kernel caches written files in 2 MiB folios already ({written_fraction:.2f})")
    monkeypatch.undo()
    mapped = WeightsMap(path)
    assert mapped.huge_fraction is not None and mapped.huge_fraction >= 0.9, (written_fraction, mapped.huge_fraction)
    assert mapped.array.tobytes() == data


def test_views_are_the_files_bytes_without_a_copy_and_read_only(tmp_path):
    path = tmp_path / "w.bin"
    data = _write(path, 3 * HUGE + 100)
    m = WeightsMap(path)
    v = m.view(HUGE - 8, 64)
    assert v.tobytes() == data[HUGE - 8:HUGE + 56]
    assert v.ctypes.data == m.array.ctypes.data + HUGE - 8 and not v.flags.writeable
    assert m.view(len(data) - 10, 64).size == 10  # past the end: short, for the caller to refuse
    small = tmp_path / "small.bin"
    _write(small, 5000)
    assert WeightsMap(small).huge_fraction is None and WeightsMap(small).view(0, 5000).tobytes() == small.read_bytes()


def test_a_missing_or_short_weights_file_is_an_artifact_error_naming_it(tmp_path):
    from common.manifest import ArtifactError

    (tmp_path / graph_io.INITIALIZERS_FILE).write_text(json.dumps({"decode": [["w", "float32", [4, 4], 0, 64]]}))
    with pytest.raises(ArtifactError, match="missing.bin"):
        SharedWeights(tmp_path, tmp_path / "missing.bin", "cpu")
    short = tmp_path / "short.bin"
    short.write_bytes(bytes(32))
    import onnxruntime as ort

    with pytest.raises(ArtifactError, match="has 32 bytes, not 64"):
        SharedWeights(tmp_path, short, "cpu").add_to("decode", ort.SessionOptions())


def test_the_cpu_index_shares_only_what_mxspds_kernels_read_whole():
    """mxspd's ops read the mapping as it is, every weight whole per call; ORT's MatMul would repack a handed
    tensor privately, and a Gather's table is left to ORT's own mapping, which maps only the rows met."""
    assert _shared({(DOMAIN, "MXMatMul")}, 10, CPU) and _shared({(DOMAIN, "RowMatMul")}, 10, CPU)
    assert not _shared({("", "MatMul")}, 10 << 20, CPU) and not _shared({("", "Gather")}, 10 << 20, CPU)
    assert not _shared({(DOMAIN, "RowMatMul"), ("", "Gather")}, 10 << 20, CPU)  # a tied table and head
    assert not _shared({("com.microsoft", "MatMulNBits")}, 10 << 20, CPU) and not _shared(set(), 10, CPU)
    assert _shared({("", "MatMul")}, 2 << 20, CUDA) and not _shared({("", "MatMul")}, 1000, CUDA)


def _weights_mappings(weights: Path) -> int:
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(weights)))


@pytest.mark.parametrize("fmt", ["mx-native", "float32"])
def test_cpu_sessions_share_one_mapping_and_compute_what_their_own_weights_give(flat, checkpoints, tmp_path_factory,
                                                                              monkeypatch, fmt):
    """Every graph's session runs its kernels' weights from views of one mapping of the weights file (ONNX
    Runtime maps only the rest), with the logits of sessions that load their own weights (artifacts built
    before the index)."""
    art = artifact(flat, checkpoints, tmp_path_factory, fmt)
    manifest = read_manifest(art.path)
    entry = manifest.models["tlm"]
    weights = (art.path / entry.weights).resolve()
    index = json.loads((weights.parent / graph_io.INITIALIZERS_FILE).read_text())
    graph = onnx.load(str(art.path / entry.graphs[graph_io.DECODE].file), load_external_data=False)
    external = {t.name for t in graph.graph.initializer if t.external_data}
    kernel_weights = {n.input[i] for n in graph.graph.node if n.domain == DOMAIN for i in (1, 2) if i < len(n.input)}
    listed = {row[0] for row in index[graph_io.DECODE]}
    assert kernel_weights & external and kernel_weights & external <= listed <= external

    def decode() -> tuple[np.ndarray, int]:
        before = _weights_mappings(weights)
        runner = ModelRunner(art.path, entry, manifest.capacity, target=CPU)
        mapped = _weights_mappings(weights) - before
        chain = Chain(runner)
        chain.start(np.arange(5, 17))
        return chain.forward(graph_io.DECODE, np.array([11])), mapped

    shared, shared_maps = decode()
    monkeypatch.setattr(SharedWeights, "available", classmethod(lambda cls, *a: None))
    own, own_maps = decode()
    np.testing.assert_array_equal(shared, own)
    # one mapping for the kernels' weights; ONNX Runtime's own, per session, only for the rest (the embedding table)
    assert shared_maps <= 1 + len(external - listed) * len(entry.graphs) < own_maps, (shared_maps, own_maps)


def test_the_smaps_reader_finds_the_mapping_it_is_asked_about(tmp_path):
    path = tmp_path / "w.bin"
    _write(path, 4 * HUGE)
    m = WeightsMap(path)
    address = m.array.ctypes.data
    assert re.search(f"^{address:x}-", Path("/proc/self/smaps").read_text(), re.MULTILINE)
    assert weights_map._pmd_mapped_bytes(address) is not None and weights_map._pmd_mapped_bytes(address + 4096) is None


def test_only_the_used_pages_are_mapped_at_load(tmp_path):
    """The used ranges' whole 2 MiB pages, merged; the rest of the file (raw copies of prepacked blobs,
    which ONNX Runtime reads once at load) stays out of the process."""
    assert weights_map._huge_spans([(HUGE + 10, 100), (10, 5), (3 * HUGE - 1, 2)], 10 * HUGE) == [(0, 4 * HUGE)]
    assert weights_map._huge_spans([(10, 5), (6 * HUGE, HUGE)], 10 * HUGE) == [(0, HUGE), (6 * HUGE, 7 * HUGE)]
    assert weights_map._huge_spans([(9 * HUGE + 5, 10)], 9 * HUGE + 100) == []  # no whole page there
    path = tmp_path / "w.bin"
    _write(path, 16 * HUGE)
    m = WeightsMap(path, used=[(5 * HUGE + 7, 1000)])
    block = next(b for b in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text())
                 if b.startswith(f"{m.array.ctypes.data:x}-"))
    rss_kib = int(re.search(r"^Rss:\s+(\d+) kB", block, re.MULTILINE).group(1))
    assert rss_kib <= 2 * HUGE >> 10, rss_kib


def test_a_second_read_that_did_not_help_is_not_tried_again(tmp_path, monkeypatch):
    """Where the filesystem has no large folios, reading again gains nothing: the first load says so in the
    cache, and later loads (other processes too) map the file as it is cached."""
    if not huge_pages_possible():
        pytest.skip("no transparent huge pages")
    path = tmp_path / "w.bin"
    _write(path, 4 * HUGE)
    monkeypatch.setattr(weights_map, "_REREAD_BELOW", 1.01)  # no fraction is enough: every read "fails"
    rereads = []
    real = WeightsMap._reread
    monkeypatch.setattr(WeightsMap, "_reread", lambda self: rereads.append(1) or real(self))
    WeightsMap(path)
    assert rereads == [1] and (tmp_path / "cache" / weights_map.NO_GAIN_FILE).is_file()
    WeightsMap(path)
    assert rereads == [1]


@pytest.mark.parametrize("index", ['{"decode": [["w", "float32", [4], -8, 16]]}', '[1, 2]', '{"decode": [["w"]]}'])
def test_a_malformed_initializer_index_is_an_artifact_error(tmp_path, index):
    from common.manifest import ArtifactError

    (tmp_path / graph_io.INITIALIZERS_FILE).write_text(index)
    _write(tmp_path / "w.bin", 64)
    with pytest.raises(ArtifactError, match="initializer index"):
        SharedWeights(tmp_path, tmp_path / "w.bin", "cpu")
