"""Autoregressive decode and speculative decoding, side by side in one run, on a ~200M Llama.

    python -m benchmarks.decode [--new-tokens 128] [--repeats 3] [--skip-genai] [--skip-hf]

Builds (once, cached) a Llama-shaped checkpoint with random weights (hidden 1024, 12 layers,
vocab 32000, ~220M parameters) and a ~20M draft, exports our artifact and onnxruntime-genai's
fp32 model from the same folder, then alternates the engines so drift affects all alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import runtime
from benchmarks.variants import build_cached
from common.cache import cache_root
from common.recipe import ModelSpec, Recipe
from recipes.default_pair import byte_tokenizer

TLM = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
           num_key_value_heads=16, vocab_size=32000)
DLM = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, vocab_size=32000)


def checkpoint(name: str, cfg: dict, seed: int) -> Path:
    path = cache_root() / "bench" / name
    if not (path / "config.json").is_file():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, **cfg))
        model.save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
    return path


def genai_model(ckpt: Path, precision: str = "fp32", provider: str = "cpu") -> Path:
    out = ckpt.parent / f"{ckpt.name}-genai-{precision}" if provider == "cpu" else \
        ckpt.parent / f"{ckpt.name}-genai-{provider}-{precision}"
    if not (out / "genai_config.json").is_file():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
                        "-p", precision, "-e", provider], check=True, capture_output=True)
    return out


def time_ours(art, prompt, n, speculative=False):
    for runner in art.runners.values():  # cold: a repeated prompt would find its prefix in the caches
        runner.forget()
    r = runtime.generate(art, prompt, max_new_tokens=n, speculative=speculative)
    return r.metrics.decode_tokens_per_s, r


def time_genai(model, prompt, n):
    """(decode tokens/s, token ids, perf_counter after the prompt's prefill)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    out = [gen.get_next_tokens()[0]]
    t0 = time.perf_counter()
    while len(out) < n:
        gen.generate_next_token()
        out.append(gen.get_next_tokens()[0])
    return (len(out) - 1) / (time.perf_counter() - t0), out, t0


def time_hf(ckpt, prompt, n):
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=3)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=3, min_new_tokens=n)
    return (n - 1) / (time.perf_counter() - t0), out[0, len(prompt):].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--skip-genai", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    tlm_dir, dlm_dir = checkpoint("llama-220m", TLM, 0), checkpoint("llama-20m", DLM, 1)
    recipe = Recipe(name="bench-220m", tlm=ModelSpec(str(tlm_dir)), dlm=ModelSpec(str(dlm_dir)), k=args.k,
                    prefill_chunk=32, context_length=512, max_prompt_length=64, max_new_tokens=args.new_tokens)
    art_dir = cache_root() / "bench" / "artifact-220m"
    build_cached(recipe, art_dir)
    art = runtime.load_artifact(art_dir)
    prompt = [0] + list(np.random.default_rng(0).integers(4, 32000, 15))
    n = args.new_tokens
    og_model = None
    if not args.skip_genai:
        import onnxruntime_genai as og

        og_model = og.Model(str(genai_model(tlm_dir)))
    rows: dict[str, list[float]] = {"ours_ar": [], "genai_fp32": [], "ours_spd": []}
    time_ours(art, prompt, 8)  # warm-up
    if og_model is not None:
        time_genai(og_model, prompt, 8)
    spd = None
    for _ in range(args.repeats):
        rows["ours_ar"].append(time_ours(art, prompt, n)[0])
        if og_model is not None:
            rows["genai_fp32"].append(time_genai(og_model, prompt, n)[0])
        tps, spd = time_ours(art, prompt, n, speculative=True)
        rows["ours_spd"].append(tps)
    ours_ids = runtime.generate(art, prompt, max_new_tokens=n, speculative=False).token_ids
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "new_tokens": n, "repeats": args.repeats,
        "median_tokens_per_s": {k: float(np.median(v)) for k, v in rows.items() if v},
        "load_s": art.load_seconds,
        "weights_mib": sum(p.stat().st_size for p in art_dir.rglob("weights.bin")) / 2**20,
    }
    med = report["median_tokens_per_s"]
    if og_model is not None:
        _, genai_ids, _ = time_genai(og_model, prompt, n)
        report["ratio_ours_over_genai_fp32"] = med["ours_ar"] / med["genai_fp32"]
        report["same_tokens_as_genai"] = [int(t) for t in genai_ids] == ours_ids
    if not args.skip_hf:
        tps, hf_ids = time_hf(tlm_dir, prompt, min(n, 32))
        report["hf_generate_tokens_per_s"] = tps
        report["ratio_ours_over_hf"] = med["ours_ar"] / tps
        report["same_tokens_as_hf"] = hf_ids == ours_ids[: len(hf_ids)]
    s = spd.metrics.speculative
    report["spd"] = {key: s.get(key) for key in ("method", "draft_lengths_used", "acceptance_rate",
                                                 "mean_accepted_length", "tokens_per_tlm_call", "cost_ratio_c",
                                                 "tlm_step_s", "tlm_score_step_s", "predicted_speedup")}
    report["spd"]["measured_speedup"] = med["ours_spd"] / med["ours_ar"]
    if s.get("predicted_speedup"):
        report["spd"]["measured_over_predicted"] = report["spd"]["measured_speedup"] / s["predicted_speedup"]
    steps = max(s["rounds"] + s["plain_decode_steps"], 1)
    report["spd"]["host_overhead_fraction_of_tlm_step"] = s["host_s"] / steps / s["tlm_step_s"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
