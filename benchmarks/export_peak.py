"""Peak memory, peak disk and wall time of one `python -m export` run, measured from outside.

    python -m benchmarks.export_peak -- --recipe llama2-7b-spd --tlm DIR --dlm DIR2 --out ART

Runs the export in a child process and samples, every second, the child's proportional set size
(PSS, /proc/PID/smaps_rollup: shared mappings counted once) and the bytes under the output's
parent that belong to this export (the artifact and its hidden staging folders). The child's peak
RSS (ru_maxrss) is printed too; it counts a file mapped by several sessions once per mapping.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.memory import pss_bytes

GIB = 2**30


def _disk(out: Path) -> int:
    total = 0
    for top in out.parent.glob(f"*{out.name}*"):
        for p in [top, *top.rglob("*")] if top.is_dir() else [top]:
            try:
                total += p.stat().st_size if p.is_file() else 0
            except OSError:  # removed while we counted
                pass
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export_args", nargs=argparse.REMAINDER, help="arguments of python -m export (after --)")
    args = ap.parse_args(argv)
    export_args = [a for a in args.export_args if a != "--"]
    if "--out" not in export_args:
        ap.error("pass --out ART among the export's arguments: the disk it uses is measured there")
    out = Path(export_args[export_args.index("--out") + 1]).resolve()
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "export", "--quiet", *export_args])
    peaks = {"pss": 0, "disk": 0}

    def sample() -> None:
        while child.poll() is None:
            peaks["pss"] = max(peaks["pss"], pss_bytes(child.pid))
            peaks["disk"] = max(peaks["disk"], _disk(out))
            time.sleep(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = child.wait()
    sampler.join()
    result = {
        "exit_code": code,
        "wall_s": round(time.perf_counter() - start, 1),
        "peak_pss_gib": round(peaks["pss"] / GIB, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB, 2),
        "peak_disk_gib": round(peaks["disk"] / GIB, 2),
        "artifact_gib": round(_disk(out) / GIB, 2) if out.exists() else None,
    }
    print(json.dumps(result, indent=2))
    sys.exit(code)


if __name__ == "__main__":
    main()
