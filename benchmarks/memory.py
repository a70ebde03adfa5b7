"""Resident memory of a loaded artifact against the size of its weights files.

    python -m benchmarks.memory ARTIFACT [--no-share-weights]

Checks that the graphs of one model (prefill, decode, score) do not each hold their own copy of
the weights: RSS after load and after generating should stay near one copy of the weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    art_dir = Path(sys.argv[1])
    share = "--no-share-weights" not in sys.argv
    import runtime

    base = rss_mib()
    art = runtime.load_artifact(art_dir, share_weights=share)
    loaded = rss_mib()
    runtime.generate(art, [0, 5, 6, 7], max_new_tokens=16, speculative=False)
    after = rss_mib()
    weights = {p.parent.name: p.stat().st_size / 2**20 for p in art_dir.rglob("weights.bin")}
    graphs = {role: len(m.graphs) for role, m in art.manifest.models.items()}
    print(json.dumps({
        "rss_mib_after_imports": round(base, 1), "rss_mib_after_load": round(loaded, 1),
        "rss_mib_after_generate": round(after, 1), "weights_mib": {k: round(v, 1) for k, v in weights.items()},
        "graphs_per_model": graphs, "share_weights": share, "load_s": round(art.load_seconds, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
