"""Memory of a loaded artifact as proportional set size (PSS), against one copy of its weights.

    python -m benchmarks.memory ARTIFACT [--heap-prepacked] [--answers]

PSS, not RSS: RSS counts a page of a shared file mapping once per mapping, PSS once. Checks that
the graphs of one model (prefill, decode, score) do not each hold their own copy of the weights:
PSS after load and after generating should stay near one prepacked copy plus the runtime's
baseline. `--heap-prepacked` loads a copy of the artifact without its stored prepacked weights,
so every session prepacks a private copy (the layout before build-time prepacking), for comparison.
`--answers`: then also answer the artifact's recipe prompts (64 new tokens each) and report PSS after
them, with the part that is the weights file's mapping: what a server's process grows to as it meets
new tokens (each gathers its embedding row, and the kernel maps the pages around it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def pss_bytes(pid: int) -> int:
    """PSS of process `pid` (/proc/PID/smaps_rollup), bytes; 0 for a process that is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def smaps_mib() -> dict[str, float]:
    """Pss and Anonymous of this process, MiB (/proc/self/smaps_rollup)."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Pss", "Anonymous", "Rss"):
            out[key.lower()] = int(value.split()[0]) / 1024
    return out


def weights_mapping_pss_mib() -> float:
    """PSS of this process's mappings of weights files, MiB (/proc/self/smaps)."""
    total, mapped = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if not head[0].endswith(":"):  # a mapping's first line: address range, ..., path
            mapped = head[-1].endswith("weights.bin")
        elif mapped and head[0] == "Pss:":
            total += int(head[1])
    return total / 1024


def weights_file_mib(art_dir: Path) -> dict[str, float]:
    """Each model's weights file, MiB."""
    return {p.parent.name: round(p.stat().st_size / 2**20, 1) for p in Path(art_dir).rglob("weights.bin")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--heap-prepacked", action="store_true", help="load a copy without its prepacked weights")
    ap.add_argument("--answers", action="store_true", help="then answer the recipe's prompts (64 new tokens each)")
    args = ap.parse_args()
    art_dir, heap = args.artifact, args.heap_prepacked
    import runtime
    from benchmarks.variants import heap_prepacked_copy, prepacked_bytes

    with tempfile.TemporaryDirectory() as tmp:
        load_dir = heap_prepacked_copy(art_dir, Path(tmp) / "heap") if heap else art_dir
        base = smaps_mib()
        art = runtime.load_artifact(load_dir, verify=not heap)
        loaded = smaps_mib()
        runtime.generate(art, [0, 5, 6, 7], max_new_tokens=16, speculative=False)
        after = smaps_mib()
        answered = {}
        if args.answers:
            for prompt in art.manifest.recipe.get("prompts", []):
                runtime.generate(art, prompt, max_new_tokens=64, speculative=False)
            answered = {"after_answers_mib": {k: round(v, 1) for k, v in smaps_mib().items()},
                        "after_answers_weights_mapping_pss_mib": round(weights_mapping_pss_mib(), 1)}
    mib = {role: round(prepacked_bytes(art_dir, role) / 2**20, 1) for role in art.manifest.models}
    one_copy = sum(mib.values())
    print(json.dumps({
        "heap_prepacked": heap,
        "after_imports_mib": {k: round(v, 1) for k, v in base.items()},
        "after_load_mib": {k: round(v, 1) for k, v in loaded.items()},
        "after_generate_mib": {k: round(v, 1) for k, v in after.items()},
        **answered,
        "prepacked_copy_mib": mib,
        "weights_file_mib": weights_file_mib(art_dir),
        "pss_growth_over_one_prepacked_copy": round((after["pss"] - base["pss"]) / one_copy, 3) if one_copy else None,
        "graphs_per_model": {role: len(m.graphs) for role, m in art.manifest.models.items()},
        "load_s": round(art.load_seconds, 3),
    }, indent=2))


if __name__ == "__main__":
    main()
