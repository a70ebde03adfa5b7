"""What one call of each of an artifact's graphs costs, measured again as the compiler measures them at build
time (compiler/costs.py: interleaved across graphs, each call the runtime's, median):

    python -m benchmarks.graph_costs ARTIFACT [--graphs prefill,prefill_last] [--role tlm] [--repeats 5]

E.g. a prompt's prefill chunk with every row's logits against the last row's alone (graph_io.PREFILL_LAST),
side by side in one run.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from benchmarks.bandwidth import cpu_name
from common.manifest import read_manifest
from common.targets import get_target
from compiler.costs import graph_costs_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--graphs", default="", help="comma-separated graph names (default: all)")
    ap.add_argument("--role", default="tlm")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    manifest = read_manifest(args.artifact)
    entry = manifest.models[args.role]
    names = [g for g in args.graphs.split(",") if g] or list(entry.graphs)
    unknown = sorted(set(names) - set(entry.graphs))
    if unknown:
        ap.error(f"no graph {unknown} in {args.artifact} ({args.role}: {sorted(entry.graphs)})")
    entry = replace(entry, graphs={g: entry.graphs[g] for g in names})
    costs = graph_costs_ms(args.artifact, entry, manifest.capacity, get_target(manifest.target), args.repeats)
    print(json.dumps({"cpu": cpu_name(), "artifact": str(args.artifact), "ms_per_call": costs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
