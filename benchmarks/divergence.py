"""How far each weight format's next-token distribution is from float32's: mean KL divergence per token.

    python -m benchmarks.divergence [--recipe smollm2-135m-chat] [--text FILE] [--tokens 1024]
                                    [--configs NAME,...] [--mx-int8 FRAGMENTS ...] [--out reports]

Perplexity and top-1 agreement (benchmarks.accuracy) can disagree on which format is closer to
float32; KL(p_fp32 || p_format) over the whole vocabulary is the direct measure. The same held-out
tokens, windows and chunks as benchmarks.accuracy, and its cached builds; float32 and each format
run window by window side by side, so memory holds one window's logits of two models, not all.
Prints, per config: mean and 99th-percentile KL (nats per token), perplexity, top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import runtime
from benchmarks.accuracy import CONFIGS, config_artifact, held_out_tokens, scoring_recipe, with_int8
from recipes import DEFAULT_RECIPE, get_recipe


def log_probs(art, seq: np.ndarray) -> np.ndarray:
    """Teacher-forced log-probabilities [len(seq) - 1, V] of one window, through the prefill graph."""
    runner, chunk, out = art.tlm, art.manifest.prefill_chunk, []
    runner.rewind(0)
    for c in range(0, len(seq) - 1, chunk):
        logits = runner.forward("prefill", seq[c : min(c + chunk, len(seq) - 1)]).astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        out.append(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    return np.concatenate(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=DEFAULT_RECIPE)
    ap.add_argument("--text", type=Path, help="held-out text file (default: held-out stdlib modules)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--configs", help=f"comma-separated subset of {list(CONFIGS)[1:]}")
    ap.add_argument("--mx-int8", action="append", default=[], metavar="FRAGMENTS",
                    help="also MXFP6 native with these weights in MXINT8 (as benchmarks.accuracy)")
    ap.add_argument("--out", type=Path, default=Path("reports"))
    args = ap.parse_args(argv)
    configs = with_int8(args.mx_int8)
    chosen = [c for c in (args.configs or ",".join(list(CONFIGS)[1:])).split(",") if c != "fp32"]
    chosen += [c for c in configs if c not in CONFIGS]
    if unknown := sorted(set(chosen) - set(configs)):
        ap.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    recipe = scoring_recipe(get_recipe(args.recipe))
    out_dir = args.out / recipe.name
    base = runtime.load_artifact(config_artifact(recipe, "fp32", CONFIGS["fp32"], out_dir))
    arts = {name: runtime.load_artifact(config_artifact(recipe, name, configs[name], out_dir)) for name in chosen}
    tokens = held_out_tokens(base, args.text, args.tokens)
    kl: dict[str, list[np.ndarray]] = {n: [] for n in arts}
    nll: dict[str, list[np.ndarray]] = {n: [] for n in ["fp32", *arts]}
    same: dict[str, list[np.ndarray]] = {n: [] for n in arts}
    window = recipe.context_length
    for start in range(0, len(tokens) - 1, window):
        seq = tokens[start : start + window + 1]
        p = log_probs(base, seq)
        rows, targets = np.arange(len(p)), seq[1 : len(p) + 1]
        nll["fp32"].append(-p[rows, targets])
        for name, art in arts.items():
            q = log_probs(art, seq)
            kl[name].append((np.exp(p) * (p - q)).sum(-1))
            nll[name].append(-q[rows, targets])
            same[name].append(q.argmax(-1) == p.argmax(-1))
    base_ppl = float(np.exp(np.concatenate(nll["fp32"]).mean()))
    report = {"recipe": recipe.name, "tokens": int(len(tokens)), "text": str(args.text or "held-out stdlib"),
              "fp32_perplexity": base_ppl, "configs": {}}
    for name in arts:
        d, ppl = np.concatenate(kl[name]), float(np.exp(np.concatenate(nll[name]).mean()))
        report["configs"][name] = {"kl_mean": float(d.mean()), "kl_p99": float(np.quantile(d, 0.99)),
                                   "perplexity": ppl, "ppl_ratio": ppl / base_ppl,
                                   "top1_agreement": float(np.concatenate(same[name]).mean())}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
