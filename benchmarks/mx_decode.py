"""MXFP6 decode speed, side by side in one run, on the ~220M Llama of benchmarks.decode.

    python -m benchmarks.mx_decode [--new-tokens 64] [--repeats 3] [--skip-genai]

Engines: our fp32 autoregressive decode, MXFP6 (E2M3) fused (MatMulNBits 8-bit), MXFP6 exact
(weights unpacked to float32 at load), MXFP6 fused with the LM head compressed too, and
onnxruntime-genai's int4 model of the same checkpoint.
Prints tokens/s (median of repeats, engines alternated), weight bytes on disk, and agreement with
fp32: teacher-forced top-1 agreement on the fp32 greedy sequence for ours, and the length of the
greedy prefix identical to fp32 for all. The checkpoint has random weights (no download), whose
nearly flat logits make top-1 agreement a pessimistic figure; benchmarks.accuracy measures it on
the trained default TLM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import numpy as np

import runtime
from benchmarks.accuracy import score
from benchmarks.decode import TLM, checkpoint, genai_model, time_genai, time_ours
from benchmarks.variants import build_cached
from common.recipe import ModelSpec, Recipe
from recipes.default_pair import cache_root

ENGINES = {  # name -> (mx_format, lowering, mx_lm_head)
    "fp32": (None, "fused", False),
    "mxfp6_fused": ("fp6_e2m3", "fused", False),
    "mxfp6_exact": ("fp6_e2m3", "exact", False),
    "mxfp6_fused_lm_head": ("fp6_e2m3", "fused", True),
}


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-genai", action="store_true")
    args = ap.parse_args()
    tlm_dir = checkpoint("llama-220m", TLM, 0)
    arts, sizes = {}, {}
    for name, (fmt, lowering, head) in ENGINES.items():
        spec = ModelSpec(str(tlm_dir), mx_format=fmt, mx_lowering=lowering, mx_lm_head=head)
        recipe = Recipe(name=f"bench-220m-{name}", tlm=spec,
                        k=4, prefill_chunk=32, context_length=512, max_prompt_length=64,
                        max_new_tokens=args.new_tokens, speculative=False)
        art_dir = build_cached(recipe, cache_root() / "bench" / f"mx-220m-{name}")
        arts[name] = runtime.load_artifact(art_dir)
        sizes[name] = (art_dir / "tlm" / "weights.bin").stat().st_size
    og_model = None
    if not args.skip_genai:
        import onnxruntime_genai as og

        genai_dir = genai_model(tlm_dir, "int4")
        og_model = og.Model(str(genai_dir))
        sizes["genai_int4"] = sum(p.stat().st_size for p in genai_dir.glob("*.onnx*"))
    prompt = [0] + list(np.random.default_rng(0).integers(4, 32000, 15))
    n = args.new_tokens
    rows: dict[str, list[float]] = {k: [] for k in sizes}
    ids: dict[str, list[int]] = {}
    for art in arts.values():  # warm-up
        time_ours(art, prompt, 8)
    if og_model is not None:
        time_genai(og_model, prompt, 8)
    for _ in range(args.repeats):
        for name, art in arts.items():
            tps, r = time_ours(art, prompt, n)
            rows[name].append(tps)
            ids[name] = r.token_ids
        if og_model is not None:
            tps, out = time_genai(og_model, prompt, n)
            rows["genai_int4"].append(tps)
            ids["genai_int4"] = [int(t) for t in out]
    seq = np.asarray(prompt + ids["fp32"], dtype=np.int64)
    generated = slice(len(prompt) - 1, None)  # predictions of the generated positions only
    ref_top1 = score(arts["fp32"], seq)[1][generated]
    med = {k: float(np.median(v)) for k, v in rows.items()}
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "new_tokens": n, "repeats": args.repeats,
        "engines": {
            k: {"tokens_per_s": med[k], "speedup_over_fp32": med[k] / med["fp32"], "weight_mib": sizes[k] / 2**20,
                "greedy_prefix_equal_to_fp32": same_prefix(ids[k], ids["fp32"]),
                **({"top1_agreement_with_fp32": float((score(arts[k], seq)[1][generated] == ref_top1).mean()),
                    "kernel": arts[k].manifest.models["tlm"].quant.get("kernel", "float32")} if k in arts else {})}
            for k in med
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
