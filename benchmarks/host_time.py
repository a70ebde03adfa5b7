"""Single-stream decode and the host's time per call, this tree against another checkout, alternated.

    python -m benchmarks.host_time ARTIFACT [--against CHECKOUT] [--rounds 2] [--tokens 96]

Each measurement runs in its own process from its checkout (so each tree's own runtime loads the
same artifact): three greedy generations of `--tokens` tokens, with speculation off and with prompt
lookup, the median of each; host µs per call = (wall time - time inside the runner's calls) / calls,
the Python around ONNX Runtime, and the same per token generated (a method that drafts more makes
fewer calls, each with more to verify, so per call alone misreads it). With a draft model in the
artifact, speculation with it too (the adaptive policy, and a fixed draft length of 3); its host µs
per call counts the calls of both models. Each generation starts cold (every model's cache
forgotten). The checkouts alternate `--rounds` times (the machine drifts), and the table shows every
round and this tree's median over the other's. An older checkout runs this tree's artifact with its own
runtime: copy this tree's kernel library into its kernels/ (the artifact's kernel layouts may be newer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROMPT = "Explain, step by step, how a hash table handles collisions, and give a short Python example."
METHODS = {"autoregressive": {"speculative": False}, "prompt lookup": {"speculative": "prompt_lookup"}}
DRAFT = {"draft model": {"speculative": "draft"}, "draft model, k = 3": {"speculative": "draft", "draft_length": 3}}


def measure(artifact: str, tokens: int) -> dict[str, dict[str, float]]:
    """In this process: tokens/s and host µs per call of each method, medians of three generations."""
    import runtime

    art = runtime.load_artifact(artifact)
    runners, out = list(art.runners.values()), {}
    for name, kw in (METHODS | (DRAFT if "dlm" in art.runners else {})).items():
        runtime.generate(art, PROMPT, max_new_tokens=16, **kw)  # warm
        rates, host, per_token = [], [], []
        for _ in range(3):
            for runner in runners:  # cold: each generation prefills its prompt (older trees: rewind(0))
                runner.forget() if hasattr(runner, "forget") else runner.rewind(0)
            seconds, calls = sum(m.call_s for m in runners), sum(m.calls for m in runners)
            result = runtime.generate(art, PROMPT, max_new_tokens=tokens, do_sample=False, **kw)
            rates.append(result.metrics.decode_tokens_per_s)
            outside = result.metrics.total_s - (sum(m.call_s for m in runners) - seconds)
            host.append(outside / (sum(m.calls for m in runners) - calls) * 1e6)
            per_token.append(outside / max(result.metrics.new_tokens, 1) * 1e6)
        out[name] = {"tok_s": statistics.median(rates), "host_us": statistics.median(host),
                     "host_us_token": statistics.median(per_token)}
    return out


def _run(checkout: Path, artifact: str, tokens: int) -> dict:
    """This file's `measure`, run in a process whose runtime is the checkout's (it need not have this file)."""
    command = [sys.executable, __file__, artifact, "--tokens", str(tokens), "--measure"]
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{checkout}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'failed'}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--against", help="another checkout of mxspd (e.g. a git worktree of an older commit)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one measurement, as JSON
    args = ap.parse_args()
    if args.measure:
        sys.path.insert(0, os.getcwd())  # the checkout's packages, not this file's folder
        print(json.dumps(measure(args.artifact, args.tokens)))
        return
    artifact = str(Path(args.artifact).resolve())
    trees = {"this tree": Path(__file__).resolve().parent.parent}
    if args.against:
        trees["against"] = Path(args.against).resolve()
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(_run(tree, artifact, args.tokens))
    print("| tree | method | tok/s per round | host µs per call per round | host µs per token per round |\n"
          "|---|---|---|---|---|")
    for name in trees:
        for method in runs[name][0]:
            cells = [", ".join(f"{r[method][k]:.{d}f}" for r in runs[name])
                     for k, d in (("tok_s", 1), ("host_us", 0), ("host_us_token", 0))]
            print(f"| {name} | {method} | {' | '.join(cells)} |")
    if args.against:
        for method in runs["this tree"][0]:
            ratio = [statistics.median(r[method][k] for r in runs["this tree"]) /
                     statistics.median(r[method][k] for r in runs["against"])
                     for k in ("tok_s", "host_us", "host_us_token")]
            print(f"{method}: this tree / against: tok/s {ratio[0]:.3f}x, host µs per call {ratio[1]:.3f}x, "
                  f"per token {ratio[2]:.3f}x")


if __name__ == "__main__":
    main()
