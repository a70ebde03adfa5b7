"""One artifact's autoregressive decode against its bandwidth floor, in a fresh process.

    python -m benchmarks.floor ARTIFACT [--prompt "def fibonacci(n):"] [--new-tokens 32] [--gib 4]

Loads the artifact, generates greedily without speculation, and prints load time, TTFT, decode
tokens/s, PSS after loading and after generating (/proc/self/smaps_rollup), the weight bytes one
decode call reads (benchmarks.bandwidth), this machine's read bandwidth, the floor they imply and
the fraction of it reached. For artifacts too large to time side by side with anything else (the
7B-shaped recipes); run it twice.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import runtime
from benchmarks.bandwidth import cpu_name, read_bandwidth_gbs, weight_bytes_per_call
from benchmarks.memory import smaps_mib


def measure(artifact: Path, prompt: str, new_tokens: int, gib: float) -> dict:
    start = time.perf_counter()
    art = runtime.load_artifact(artifact)
    load_s, loaded = time.perf_counter() - start, smaps_mib()
    m = runtime.generate(art, prompt, max_new_tokens=new_tokens, speculative=False).metrics
    weights = weight_bytes_per_call(artifact, "tlm")
    bandwidth = read_bandwidth_gbs(gib, repeats=3)
    floor = bandwidth * 1e9 / weights
    return {"artifact": str(artifact), "cpu": cpu_name(), "load_s": round(load_s, 2), "ttft_s": round(m.ttft_s, 3),
            "new_tokens": m.new_tokens, "decode_tokens_per_s": round(m.decode_tokens_per_s, 2),
            "pss_mib_after_load": round(loaded["pss"]), "pss_mib_after_generation": round(smaps_mib()["pss"]),
            "weights_read_per_token_MB": round(weights / 1e6, 3), "read_bandwidth_GB_per_s": round(bandwidth, 1),
            "floor_tokens_per_s": round(floor, 2), "fraction_of_floor": round(m.decode_tokens_per_s / floor, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--gib", type=float, default=4.0, help="size of the bandwidth probe's tensor")
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.artifact, args.prompt, args.new_tokens, args.gib), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
