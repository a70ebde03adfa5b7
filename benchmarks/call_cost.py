"""What one TLM call costs as a function of T (the number of new tokens it processes).

    python -m benchmarks.call_cost ARTIFACT [ARTIFACT ...] [--repeats 30]

Tree and lookahead steps only pay when scoring T tokens costs far less than T decode steps; this
measures every compiled graph of each artifact's TLM (decode, score{k}, lookahead, prefill), runs
interleaved across graphs so machine drift affects all alike, and prints ms per call and the cost
in decode steps. Used to choose the compiled draft lengths and the lookahead (N, W, G).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.manifest import read_manifest
from common.targets import get_target
from compiler.costs import graph_costs_ms


def call_costs(artifact: Path, repeats: int) -> dict[int, float]:
    """{T: median ms per call} for each compiled TLM graph."""
    manifest = read_manifest(artifact, verify=False)
    entry = manifest.models["tlm"]
    ms = graph_costs_ms(artifact, entry, manifest.capacity, get_target(manifest.target), repeats)
    return dict(sorted((entry.graphs[name].tokens, v) for name, v in ms.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    for artifact in args.artifacts:
        costs = call_costs(artifact, args.repeats)
        decode = costs[1]
        rows = {t: {"ms": round(ms, 2), "decode_steps": round(ms / decode, 2)} for t, ms in costs.items()}
        print(json.dumps({"artifact": str(artifact), "by_T": rows}))


if __name__ == "__main__":
    main()
