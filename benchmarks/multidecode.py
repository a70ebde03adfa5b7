"""MultiDecode side by side in one run: many sequences per call against the same work done one by one.

    python -m benchmarks.multidecode [--models default-fp32,default-mxfp6,220m] [--new-tokens 48]

For each TLM (the default recipe's, in fp32 and MXFP6 fused, and the ~220M random Llama of
benchmarks.decode), TLM-only artifacts built once and cached:
- parallel sampling, n = 4 and 8: generate(n=...) against n single generations with seeds s + i;
- beam search, B = 4: all beams in one call per step, against one call per beam
  (rows_per_call=1) and against transformers' generate(num_beams=4) on the same checkpoint (fp32);
- four questions over one context: generate_multi against four generate(context + question).
Tokens/s are new tokens summed over the sequences, over wall time (prefill included). The
"same" column counts the sequences equal token for token to the one-by-one (or transformers')
ones; the fp32 logits of different graph sizes differ by ~1e-6, so a sampled draw that lands
within that of a CDF boundary (or a beam near-tie) can differ, and MXFP6 fused differs more.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import numpy as np
import torch
from transformers import AutoModelForCausalLM

import runtime
from benchmarks.decode import TLM, checkpoint
from benchmarks.variants import build_cached
from common.cache import cache_root
from common.recipe import ModelSpec, Recipe
from recipes import get_recipe
from recipes.builtin import builtin_model_dir

CONTEXT = ('import os\n\n\ndef list_python_files(root):\n    """Return the paths of the Python files under root."""\n'
           '    paths = []\n    for folder, _, names in os.walk(root):\n        for name in names:\n'
           '            if name.endswith(".py"):\n                paths.append(os.path.join(folder, name))\n'
           '    return paths\n\n\n')
QUESTIONS = ["def count_lines(path):\n", "class Cache:\n", "def main():\n", "# Read the configuration\n"]
PROMPT = "def binary_search(items, target):\n"


def artifacts(names: list[str]) -> dict[str, tuple[runtime.Artifact, str | None]]:
    """name -> (artifact, the fp32 checkpoint for transformers' beam search, or None for MXFP6)."""
    out = {}
    base = replace(get_recipe("tiny-stdlib-spd"), dlm=None, speculative=False, context_length=512)
    for name in names:
        if name == "220m":
            ckpt = str(checkpoint("llama-220m", TLM, 0))
            recipe = Recipe(name="bench-220m-md", tlm=ModelSpec(ckpt), dlm=None, k=8, prefill_chunk=32,
                            context_length=512, max_prompt_length=128, max_new_tokens=64, speculative=False)
        else:
            fmt = None if name == "default-fp32" else "fp6_e2m3"
            recipe = replace(base, name=f"md-{name}", tlm=replace(base.tlm, mx_format=fmt))
            ckpt = str(builtin_model_dir("stdlib-tlm")) if fmt is None else None
        out[name] = (runtime.load_artifact(build_cached(recipe, cache_root() / "bench" / f"md-{name}")), ckpt)
    return out


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def row(name: str, task: str, tokens_multi: int, t_multi: float, tokens_seq: int, t_seq: float,
        ours: list[list[int]], theirs: list[list[int]]) -> None:
    multi, seq = tokens_multi / t_multi, tokens_seq / t_seq
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    print(f"| {name} | {task} | {multi:.1f} | {seq:.1f} | {multi / seq:.2f}x | {same}/{len(ours)} |", flush=True)


def bench(name: str, art: runtime.Artifact, ref: str | None, new: int) -> None:
    art.eos_token_ids = frozenset()  # fixed lengths: every run does the same work
    prompt = art.tokenizer(PROMPT)["input_ids"] if name != "220m" else [0, *range(300, 315)]
    runtime.generate(art, prompt, max_new_tokens=8, speculative=False)  # warm up
    for n in (4, 8):
        r, t_multi = timed(lambda n=n: runtime.generate(art, prompt, n=n, do_sample=True, seed=0,
                                                        max_new_tokens=new))
        singles, t_seq = timed(lambda n=n: [runtime.generate(art, prompt, do_sample=True, seed=i, max_new_tokens=new,
                                                             speculative=False) for i in range(n)])
        row(name, f"parallel sampling n={n}", r.metrics.new_tokens, t_multi, sum(len(s.token_ids) for s in singles),
            t_seq, [b.token_ids for b in r.branches], [s.token_ids for s in singles])
    beams, t_multi = timed(lambda: runtime.beam_search(art, prompt, num_beams=4, max_new_tokens=new))
    one, t_one = timed(lambda: runtime.beam_search(art, prompt, num_beams=4, max_new_tokens=new, rows_per_call=1))
    tokens = len(beams.sequences[0].token_ids)
    row(name, "beam search B=4 (vs one call per beam)", tokens, t_multi, len(one.sequences[0].token_ids), t_one,
        [beams.sequences[0].token_ids], [one.sequences[0].token_ids])
    if ref is not None:
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            kw = dict(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      num_beams=4, do_sample=False, pad_token_id=0)
            model.generate(max_new_tokens=4, **kw)  # warm up
            out, t_hf = timed(lambda: model.generate(max_new_tokens=new, **kw))
        hf = out[0, len(prompt):].tolist()
        row(name, "beam search B=4 (vs transformers)", tokens, t_multi, len(hf), t_hf,
            [beams.sequences[0].token_ids], [hf])
    context = art.tokenizer(CONTEXT)["input_ids"] if name != "220m" else [0, *range(400, 460)]
    questions = QUESTIONS if name != "220m" else [list(range(500 + 10 * i, 506 + 10 * i)) for i in range(4)]
    r, t_multi = timed(lambda: runtime.generate_multi(art, context, questions, max_new_tokens=new))
    tok = art.tokenizer
    q_ids = [tok(q, add_special_tokens=False)["input_ids"] if isinstance(q, str) else q for q in questions]
    singles, t_seq = timed(lambda: [runtime.generate(art, context + q, max_new_tokens=new, speculative=False)
                                    for q in q_ids])
    row(name, "4 questions over one context", r.metrics.new_tokens, t_multi,
        sum(len(s.token_ids) for s in singles), t_seq, [b.token_ids for b in r.branches],
        [s.token_ids for s in singles])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default-fp32,default-mxfp6,220m")
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    np.random.seed(0)
    print("| TLM | task | MultiDecode tok/s | one by one tok/s | speedup | same |\n|---|---|---|---|---|---|")
    for name, (art, ref) in artifacts(args.models.split(",")).items():
        bench(name, art, ref, args.new_tokens)


if __name__ == "__main__":
    main()
