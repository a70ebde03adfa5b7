"""MXFP6 decode speed by lowering, side by side in one run, on a recipe's TLM (default: the default recipe).

    python -m benchmarks.mx_decode [--recipe NAME] [--new-tokens 128] [--repeats 3] [--engines a,b,...] [--plain]
                                   [--context N]

Engines (ENGINES): float32; MXFP6 E2M3 through ONNX Runtime's MatMulNBits (`fused`, 8-bit codes and
float32 scales: 9 bits per weight); through mxspd's native 6-bit kernel with int16 or int8
activations (`native`, `native8`: 6.25 bits per weight); and the native ones with the LM head in
MXFP6 too (`_lm_head`) or in MXINT8 (`_head8`, 8.25 bits). Prints, per engine: greedy decode
tokens/s of every repeat (engines alternated) and their median, time to first token (the prompt's
prefill), the weight bytes one decode call reads and the floor they imply at this machine's read
bandwidth (benchmarks.bandwidth), the fraction of that floor reached, the length of the greedy
output identical to float32's, and teacher-forced top-1 agreement with float32 on it, and whether
greedy prompt lookup and lookahead give exactly the autoregressive tokens. `--plain` also builds
every engine with `batch_invariant = false` (named `<engine>:plain`; ONNX Runtime's MatMul and
attention): the cost of batch invariance is the ratio of the two. `--context N` also builds every
engine with N KV slots (`<engine>:ctxN`): what a larger cache capacity costs one request's decode
(`speed_over_ctxN`). `--small-pages` also loads a copy of every engine as artifacts loaded before
the initializer index (`<engine>:small_pages`: each session maps its own weights, from a weights file
cached in small folios as a build leaves it): what one mapping in 2 MiB pages is worth
(`speed_over_small_pages`; docs/export.md, "One mapping of the weights").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

import runtime
from benchmarks.accuracy import ALL_INT8, HEAD6, HEAD8, KV16, KV32, PLAIN, SENSITIVE8, TARGET_KV, Divergence, score
from benchmarks.bandwidth import read_bandwidth_gbs, weight_bytes_per_call
from benchmarks.decode import time_ours
from benchmarks.variants import build_cached, small_pages_copy, variant, with_settings
from common.cache import cache_root
from common.recipe import Recipe
from recipes import DEFAULT_RECIPE, get_recipe
from runtime.request import encode_prompt

ENGINES = {  # name -> (mx_format, lowering (None: the recipe's own; native8 by default), other TLM settings)
    "fp32": (None, "exact", TARGET_KV),  # the reference: float32 weights and the target's float32 cache
    "mxfp6": ("fp6_e2m3", None, {}),  # the recipe's own MX settings (a plain one: head and table MXINT8)
    "mxfp6_16": ("fp6_e2m3", "native", {}),  # the same, int16 activations (the default until 2026-11-30)
    "mxfp6_fused": ("fp6_e2m3", "fused", PLAIN),
    "mxfp6_native": ("fp6_e2m3", "native", PLAIN),
    "mxfp6_native8": ("fp6_e2m3", "native8", PLAIN),
    "mxfp6_native_lm_head": ("fp6_e2m3", "native", HEAD6),
    "mxfp6_native8_lm_head": ("fp6_e2m3", "native8", HEAD6),
    "mxfp6_native_head8": ("fp6_e2m3", "native", HEAD8),
    "mxfp6_native8_head8": ("fp6_e2m3", "native8", HEAD8),
    "mxfp6_native_sensitive8": ("fp6_e2m3", "native", SENSITIVE8),
    "mxint8_native": ("fp6_e2m3", "native", ALL_INT8),
    "mxfp6_kv16": ("fp6_e2m3", None, KV16),  # the recipe's own, with a float16 KV cache (the default's own)
    "mxfp6_kv32": ("fp6_e2m3", None, KV32),  # the recipe's own, with a float32 KV cache
    "mxfp4": ("fp4_e2m1", None, {}),  # the recipe's own MX settings in MXFP4 (its weights: int8 activations)
    "mxfp4_kv16": ("fp4_e2m1", None, KV16),
}


# A short answer stops at EOS after a few tokens and times nothing; this one runs past 128 on SmolLM2.
LONG_ANSWER = "Write a Python function that returns the square of a number, and explain it."


def engine_recipe(recipe: Recipe, engine: str, new_tokens: int) -> Recipe:
    """The recipe's TLM alone, built as `engine` (ENGINES), generating `new_tokens`."""
    fmt, lowering, settings = ENGINES[engine]
    return replace(with_settings(variant(recipe, fmt, lowering, with_dlm=False), settings), max_new_tokens=new_tokens)


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=DEFAULT_RECIPE)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default=LONG_ANSWER, help="a prompt whose greedy answer runs the whole --new-tokens")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {list(ENGINES)}")
    ap.add_argument("--plain", action="store_true", help="also each engine built with batch_invariant = false")
    ap.add_argument("--context", type=int, help="also each engine built with this context_length (KV slots): what a "
                    "larger cache costs one request's decode")
    ap.add_argument("--small-pages", action="store_true", help="also each engine as loaded before the initializer "
                    "index: each session maps its own weights, cached in small folios")
    args = ap.parse_args(argv)
    names = args.engines.split(",")
    if unknown := sorted(set(names) - set(ENGINES)):
        ap.error(f"unknown engines {unknown}: choose from {list(ENGINES)}")
    if "fp32" not in names:
        ap.error("--engines must include fp32 (the reference every other engine is compared with)")
    recipe = get_recipe(args.recipe)
    tmp = tempfile.TemporaryDirectory()  # small-pages copies and float32's log-probabilities, removed at exit
    arts = {}
    for name in names:
        r = engine_recipe(recipe, name, args.new_tokens)
        builds = {name: r} | ({f"{name}:plain": replace(r, batch_invariant=False)} if args.plain else {}) | (
            {f"{name}:ctx{args.context}": replace(r, context_length=args.context)} if args.context else {})
        for key, built in builds.items():
            path = build_cached(built, cache_root() / "bench" / f"{recipe.name}-{key.replace(':', '-')}")
            arts[key] = runtime.load_artifact(path)
            if args.small_pages and key == name:
                copy = small_pages_copy(path, Path(tmp.name) / key)
                arts[f"{key}:small_pages"] = runtime.load_artifact(copy, verify=False)
    art0 = arts["fp32"]
    prompt = encode_prompt(art0, args.prompt)  # with the recipe's chat template
    n = args.new_tokens
    rows: dict[str, list[float]] = {k: [] for k in arts}
    ttft: dict[str, list[float]] = {k: [] for k in arts}
    ids: dict[str, list[int]] = {}
    for art in arts.values():  # warm-up
        time_ours(art, prompt, 8)
    for _ in range(args.repeats):
        for name, art in arts.items():
            tps, r = time_ours(art, prompt, n)
            rows[name].append(round(tps, 1))
            ttft[name].append(round(r.metrics.ttft_s * 1e3, 1))
            ids[name] = r.token_ids
    gbs = read_bandwidth_gbs()
    seq = np.asarray(prompt + ids["fp32"], dtype=np.int64)
    generated = slice(len(prompt) - 1, None)  # predictions of the generated positions only
    divergence = Divergence(Path(tmp.name) / "fp32-logprobs.npy", len(seq) - 1)  # float32's, scored first (top-1 used)
    ref_top1 = score(art0, seq, divergence)[1][generated]
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "recipe": recipe.name, "new_tokens": n, "repeats": args.repeats, "read_bandwidth_GB_per_s": round(gbs, 1),
        "engines": {},
    }
    for name, art in arts.items():
        med = float(np.median(rows[name]))
        mb = weight_bytes_per_call(art.path, "tlm") / 1e6
        report["engines"][name] = {
            "tokens_per_s": rows[name], "median": med, "ttft_ms": ttft[name], "prompt_tokens": len(prompt),
            "weights_read_per_token_MB": round(mb, 1),
            "floor_tokens_per_s": round(gbs * 1e3 / mb, 1), "fraction_of_floor": round(med * mb / (gbs * 1e3), 3),
            "greedy_prefix_equal_to_fp32": same_prefix(ids[name], ids["fp32"]), "generated": len(ids[name]),
            "top1_agreement_with_fp32": round(float((score(art, seq, divergence)[1][generated] == ref_top1).mean()),
                                               4),
            "kernel": art.manifest.models["tlm"].quant.get("kernel", "float32"),
            "batch_invariant": art.manifest.models["tlm"].batch_invariant,
            "speculation_equals_autoregressive": {
                m: runtime.generate(art, prompt, max_new_tokens=n, speculative=m).token_ids == ids[name]
                for m in ("prompt_lookup", "lookahead")},
        }
        base, _, kind = name.partition(":")
        if kind:  # the engine's own build over this variant's
            key = "speed_over_plain" if kind == "plain" else f"speed_over_{kind}"
            report["engines"][base][key] = round(float(np.median(rows[base])) / med, 3)
    divergence.close()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
