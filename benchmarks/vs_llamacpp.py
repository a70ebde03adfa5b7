"""Decode and prefill against llama.cpp on the same weights and CPU, side by side in one run.

    python -m benchmarks.vs_llamacpp [--recipe smollm2-135m-chat] [--formats F32,Q8_0,Q6_K,Q4_1]
                                     [--engines fp32,mxfp6_native,mxfp6_native_head8] [--genai int4,fp32]
                                     [--speculation prompt_lookup,lookahead] [--new-tokens 128]
                                     [--prompts long|recipe] [--repeats 2] [--threads 2] [--no-pss]
    python -m benchmarks.vs_llamacpp --checkpoint DIR [--formats Q8_0,Q6_K,Q4_K_M] [--engines mxfp6]
                                     [--prompt-tokens 32] [--new-tokens 64] [--prefill-chunk 128] ...

llama.cpp through llama-cpp-python (a benchmark-only extra, `pip install -e ".[peers]"`; it builds
llama.cpp from source; where the native build crashes, benchmarks/peers.py says how to build it). Its
formats are made with llama_model_quantize and cached: from the recipe's GGUF (requantized where the
source is already quantized, as a user of a Q4_1 download would), or with `--checkpoint` (any Llama-
family folder, real or from benchmarks.make_checkpoint, `--layers N` cuts and GQA shapes included) from
an F16 GGUF of the checkpoint's own weights (benchmarks.gguf_writer). `--genai` adds onnxruntime-genai's
model builder's builds (the `bench` extra; int4 is MatMulNBits 4-bit, block 32), made from a float32
Hugging Face copy of the same GGUF (its builder reads float GGUFs only) and cached. `--speculation` adds
the last engine with each speculation method (`ours:ENGINE+METHOD`, the draft policy deciding each
round); its text is compared with the same engine's autoregressive text (lossless). Ours are the
recipe's TLM built as benchmarks.mx_decode's engines (with `--checkpoint`: a recipe of that folder
alone, speculation off; `mxfp6` is what a recipe of plain `mx_format = "fp6_e2m3"` builds, `mxfp4` the same
in MXFP4; against Q4_K_M and Q4_0: `--formats Q4_K_M,Q4_0,Q6_K --engines mxfp4`). Every system
gets the same prompt token ids (`--prompts long`: one chat-templated request for code with an
explanation; `recipe`: the recipe's prompts one after another, each system's decode speed their tokens
over their time; with `--checkpoint`: `--prompt-tokens` fixed pseudo-random ids), greedy, the same
thread count and context; runs alternate between systems. Prints per system: decode tokens/s of every
run and their median, prefill ms (the whole prompt: time to the first token), the ratio to llama.cpp
Q6_K (and to each F32), the weight bytes read per token (llama.cpp: its file less the token embedding
table, of which a token reads one row) with the floor they imply at the read bandwidth measured in the
same run (the median of a probe before each round and one after: on a shared machine it moves), whether
the greedy text equals the system's own float32 text where that system was run (`compared_with` names
the system compared: for a speculating engine its autoregressive self), and PSS after loading and
generating (each system alone in a fresh process, measured once this one has let every system go: while
it still mapped a model's file, the child's PSS counted half of that file's pages).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

import runtime
from benchmarks.bandwidth import cpu_name, read_bandwidth_gbs, weight_bytes_per_call
from benchmarks.decode import time_ours
from benchmarks.memory import smaps_mib
from benchmarks.mx_decode import ENGINES, LONG_ANSWER, engine_recipe
from benchmarks.peers import Genai, LlamaCpp, checkpoint_gguf, llama_path, streamed_bytes
from benchmarks.variants import build_cached
from common.cache import cache_root
from common.recipe import ModelSpec, Recipe
from export.gguf_checkpoint import gguf_file
from recipes import get_recipe
from runtime.request import encode_prompt

REFERENCE = "Q6_K"  # issue 27's yardstick: llama.cpp's 6.56-bit format


def checkpoint_recipe(checkpoint: Path, prompt_tokens: int, new_tokens: int, prefill_chunk: int) -> Recipe:
    """A recipe of the checkpoint alone, MXFP6 with the defaults, no speculation: 1,024 positions (more
    where the prompt and new tokens need them), so that prompts of any length up to that share one build."""
    context = max(1024, -(-(prompt_tokens + new_tokens + 1) // 256) * 256)
    key = hashlib.sha256(str(checkpoint.resolve()).encode()).hexdigest()[:8]
    chunk = min(prefill_chunk, context)
    suffix = "" if chunk == 128 else f"-c{chunk}"  # each chunk its own cached build
    return Recipe(name=f"{checkpoint.name}-{key}{suffix}",
                  tlm=ModelSpec(model=str(checkpoint.resolve()), mx_format="fp6_e2m3"),
                  speculative=False, context_length=context, max_prompt_length=context - 64,
                  prefill_chunk=chunk, max_new_tokens=64)


def setup(args) -> tuple[Recipe, Path]:
    """The recipe our engines are built from, and the GGUF llama.cpp's formats are made from."""
    if args.checkpoint is None:
        recipe = get_recipe(args.recipe)
        return recipe, gguf_file(recipe.tlm.model)
    recipe = checkpoint_recipe(args.checkpoint, args.prompt_tokens, args.new_tokens, args.prefill_chunk)
    return recipe, checkpoint_gguf(args.checkpoint)


def ours(recipe, engine: str, new_tokens: int) -> Path:
    """Our build of `engine`, in the cache folder benchmarks.mx_decode uses for it."""
    return build_cached(engine_recipe(recipe, engine, new_tokens), cache_root() / "bench" / f"{recipe.name}-{engine}")


def pss_of(system: str, prompt: list[int], args) -> float:
    """PSS growth (MiB) of a fresh process that loads `system` alone and generates 16 tokens."""
    model = ["--checkpoint", str(args.checkpoint), "--prompt-tokens", str(args.prompt_tokens), "--prefill-chunk",
             str(args.prefill_chunk)] if args.checkpoint else ["--recipe", args.recipe]
    out = subprocess.run([sys.executable, "-m", "benchmarks.vs_llamacpp", *model, "--new-tokens", str(args.new_tokens),
                          "--threads", str(args.threads), "--pss-of", system, "--prompt-ids",
                          ",".join(map(str, prompt))], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _measure_pss(system: str, prompt: list[int], args) -> None:
    kind, _, name = system.partition(":")
    recipe, source = setup(args)
    # found before the baseline: checking a cached build reads every build source (Python heap, kept)
    path = llama_path(source, name, args.checkpoint) if kind == "llama.cpp" else ours(recipe, name, args.new_tokens)
    base = smaps_mib()["pss"]
    if kind == "llama.cpp":
        loaded = LlamaCpp(path, args.threads, recipe.context_length)
        loaded.generate(prompt, 16)
    else:
        loaded = runtime.load_artifact(path)
        runtime.generate(loaded, prompt, max_new_tokens=16, speculative=False)
    print(round(smaps_mib()["pss"] - base, 1))  # while `loaded` is alive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2-135m-chat")
    ap.add_argument("--checkpoint", type=Path, help="a Llama-family checkpoint folder instead of the recipe's GGUF")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="with --checkpoint: prompt length in token ids")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="with --checkpoint: our prefill graph's rows")
    ap.add_argument("--formats", help="llama.cpp formats (default F32,Q8_0,Q6_K,Q4_1; Q8_0,Q6_K,Q4_K_M with "
                    "--checkpoint)")
    ap.add_argument("--engines", help=f"ours, from {list(ENGINES)} (default fp32,mxfp6_native,mxfp6_native_head8; "
                    "mxfp6 with --checkpoint)")
    ap.add_argument("--genai", default="", help="onnxruntime-genai builds to add (int4, fp32, ...)")
    ap.add_argument("--speculation", default="", help="the last engine with these methods too (prompt_lookup, ...)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", choices=("long", "recipe"), default="long",
                    help="one long-answer prompt, or every prompt of the recipe")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-pss", action="store_true", help="skip the PSS of each system alone")
    ap.add_argument("--pss-of", help=argparse.SUPPRESS)  # internal: one system's PSS, in a fresh process
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pss_of:
        return _measure_pss(args.pss_of, [int(i) for i in args.prompt_ids.split(",")], args)
    by_checkpoint = args.checkpoint is not None
    formats = (args.formats or ("Q8_0,Q6_K,Q4_K_M" if by_checkpoint else "F32,Q8_0,Q6_K,Q4_1")).split(",")
    engines = (args.engines or ("mxfp6" if by_checkpoint else "fp32,mxfp6_native,mxfp6_native_head8")).split(",")
    if unknown := sorted(set(engines) - set(ENGINES)):
        ap.error(f"unknown engines {unknown}: choose from {list(ENGINES)}")
    if not by_checkpoint and ("F32" not in formats or "fp32" not in engines):
        ap.error("each system needs its float32 (F32 / fp32): outputs are compared with it")
    if by_checkpoint and (args.genai or args.prompts != "long"):
        ap.error("--checkpoint times fixed token ids: --genai and --prompts go with a recipe")
    recipe, source = setup(args)
    arts = {f"ours:{e}": runtime.load_artifact(ours(recipe, e, args.new_tokens)) for e in engines}
    llamas: dict[str, LlamaCpp | Genai] = {
        f"llama.cpp:{f}": LlamaCpp(llama_path(source, f, args.checkpoint), args.threads, recipe.context_length)
        for f in formats}
    llamas |= {f"genai:{p}": Genai(source, p, args.threads) for p in filter(None, args.genai.split(","))}
    if by_checkpoint:  # fixed ids past the special ones: timing does not depend on what they say
        vocab = arts[f"ours:{engines[0]}"].tlm.dims.vocab_size
        prompts = [np.random.default_rng(0).integers(3, vocab, args.prompt_tokens).tolist()]
    else:
        texts = list(recipe.prompts) if args.prompts == "recipe" else [LONG_ANSWER]
        if not texts:
            ap.error(f"recipe {recipe.name!r} has no prompts; use --prompts long")
        prompts = [encode_prompt(arts["ours:fp32"], text) for text in texts]
    prompt = prompts[0]
    n = args.new_tokens
    speculating = {f"ours:{engines[-1]}+{m}": m for m in filter(None, args.speculation.split(","))}
    arts |= {system: arts[f"ours:{engines[-1]}"] for system in speculating}
    speed: dict[str, list[float]] = {k: [] for k in [*llamas, *arts]}
    prefill: dict[str, list[float]] = {k: [] for k in speed}
    ids: dict[str, list[int]] = {}

    def run(system: str, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
        """(prefill ms, decode tokens/s, new token ids)."""
        if system in llamas:
            return llamas[system].generate(prompt, new)
        tps, r = time_ours(arts[system], prompt, new, speculating.get(system, False))
        return r.metrics.ttft_s * 1e3, tps, r.token_ids

    for system in speed:  # warm-up
        run(system, prompt, 8)
    probes = []  # the read bandwidth, once per round: on a shared machine it moves while the systems run
    for _ in range(args.repeats):
        probes.append(read_bandwidth_gbs(repeats=3, allocations=2))
        for system in speed:
            tokens, seconds, ms, ids[system] = 0, 0.0, [], []
            for p in prompts:
                prefill_ms, tps, new_ids = run(system, p, n)
                tokens, seconds = tokens + len(new_ids) - 1, seconds + ((len(new_ids) - 1) / tps if tps else 0.0)
                ms.append(prefill_ms)
                ids[system] += new_ids
            speed[system].append(round(tokens / seconds, 1) if seconds else 0.0)
            prefill[system].append(round(float(np.mean(ms)), 1))
    probes.append(read_bandwidth_gbs(repeats=3, allocations=2))
    gbs = float(np.median(probes))
    ref_system = f"llama.cpp:{REFERENCE}"
    ref = float(np.median(speed[ref_system])) if ref_system in speed else None
    ref_prefill = float(np.median(prefill[ref_system])) if ref_system in speed else None
    report = {"machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
              "cpu": cpu_name(), "recipe": recipe.name, "checkpoint": str(args.checkpoint or recipe.tlm.model),
              "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts], "new_tokens": n,
              "threads": args.threads, "read_bandwidth_GB_per_s": round(gbs, 1),
              "read_bandwidth_probes_GB_per_s": [round(g, 1) for g in probes], "systems": {}}
    for system in speed:
        kind, _, name = system.partition(":")
        own_f32 = {"llama.cpp": "llama.cpp:F32", "genai": "genai:fp32" if "genai:fp32" in speed else "ours:fp32"
                   }.get(kind, "ours:fp32")
        if system in speculating:  # lossless: the same engine's autoregressive text
            own_f32 = system.partition("+")[0]
        own_f32 = own_f32 if own_f32 in speed else None
        mb = (streamed_bytes(llamas[system].path) if kind == "llama.cpp"
              else llamas[system].weight_bytes() if kind == "genai"
              else weight_bytes_per_call(arts[system].path, "tlm")) / 1e6
        med, med_prefill = float(np.median(speed[system])), float(np.median(prefill[system]))
        report["systems"][system] = {
            "decode_tokens_per_s": speed[system], "median": med, "prefill_ms": prefill[system],
            f"vs_llama.cpp_{REFERENCE}": round(med / ref, 3) if ref else None,
            f"prefill_vs_llama.cpp_{REFERENCE}": round(ref_prefill / med_prefill, 3) if ref_prefill else None,
            # the system the next two figures compare with: its own float32, or for a speculating
            # engine its autoregressive self (genai without its fp32 build: ours); None where not run
            "compared_with": own_f32,
            "vs_own_f32": round(med / float(np.median(speed[own_f32])), 3) if own_f32 else None,
            "weights_read_per_token_MB": round(mb, 1), "floor_tokens_per_s": round(gbs * 1e3 / mb, 1),
            "fraction_of_floor": round(med * mb / (gbs * 1e3), 3),
            "text_equals_own_f32": ids[system] == ids[own_f32] if own_f32 else None, "generated": len(ids[system]),
            "pss_mib_alone": None,
        }
    if not args.no_pss:
        # Alone: a page this process still mapped would count half to the child (PSS shares it out)
        arts.clear()
        llamas.clear()
        gc.collect()
        for system in report["systems"]:
            if not (system.startswith("genai:") or system in speculating):
                report["systems"][system]["pss_mib_alone"] = pss_of(system, prompt, args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
