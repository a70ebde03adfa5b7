"""PSS as the benchmarks read it: one process, and a server's whole process tree (vLLM runs its engine in
a child, so its own PSS alone would undercount it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.memory import pss_bytes
from benchmarks.serve_peers import tree_pss_mib


def test_a_process_tree_counts_its_children_and_a_gone_process_counts_nothing():
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = b'x' * (96 << 20); sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while pss_bytes(child.pid) < 96 << 20:  # until it has written its 96 MiB
            assert child.poll() is None and time.monotonic() < deadline
        alone = pss_bytes(os.getpid()) / 2**20
        assert tree_pss_mib(os.getpid()) >= alone + 96
    finally:
        child.communicate(b"")
    assert pss_bytes(child.pid) == 0  # reaped: gone
    assert tree_pss_mib(os.getpid()) < alone + 48
