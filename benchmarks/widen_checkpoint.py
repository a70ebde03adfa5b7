"""A real model widened to a bigger one's cost, computing the same text (recipes/widen.py's Net2WiderNet).

    python -m benchmarks.widen_checkpoint --source REF --r 8 --out DIR [--dtype float16]

REF is any Llama checkpoint the exporter reads (a folder, a .gguf file, `builtin:NAME`). Every width is
r times the source's, so the decoder costs r^2 times as much and the logits are the source's: a model
with a 7B's bytes per token that writes real text, for speculation's speed on an accelerator (Figure 7
at 7B cost, docs/gpu.md) without training one. SmolLM2-135M at r = 8 is 7.25B parameters (hidden 4,608,
MLP 12,288, 72 heads of 64; 14.5 GB in float16); its draft can be SmolLM2 itself (the same tokenizer).
float16 storage is exact only where r is a power of two (W / r then lowers W's exponent); other r are
refused in float16. Memory: the widened model in float32 (29 GB at r = 8) plus its float16 copy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from export.loader import read_config, resolve_model_dir
from export.weights import checkpoint_tensors
from recipes.widen import RECORD, parameter_count, widen


def load_source(reference: str) -> tuple[LlamaForCausalLM, Path]:
    """The checkpoint's model in float32 (its weights read one tensor at a time) and its resolved folder."""
    model_dir = resolve_model_dir(reference, "source")
    config = read_config(model_dir, context_length=1)
    if config.model_type != "llama":
        raise ValueError(f"{reference}: widening supports Llama checkpoints, this one is {config.model_type!r}")
    config.dtype = "float32"
    model = LlamaForCausalLM(config).eval()
    tensors = checkpoint_tensors(model_dir)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if config.tie_word_embeddings else {}
    with torch.no_grad():
        for key, param in model.state_dict().items():  # parameters (RoPE tables are not in a state dict)
            param.copy_(tensors(tied.get(key, key)).float())
    return model, model_dir


def build(reference: str, r: int, out: Path, dtype: str = "float32") -> dict:
    if dtype == "float16" and r & (r - 1):
        raise ValueError(f"float16 storage of a widening is exact only for a power-of-two r, got r = {r}: use float32")
    t0 = time.perf_counter()
    source, model_dir = load_source(reference)
    wide = widen(source, r)
    if dtype == "float16":
        wide = wide.half()
        wide.config.dtype = "float16"
    wide.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    record = {"source": reference, "r": r, "dtype": dtype, "parameters": parameter_count(wide),
              "source_parameters": parameter_count(source), "seconds": round(time.perf_counter() - t0, 1)}
    (Path(out) / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True)
    ap.add_argument("--r", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    args = ap.parse_args(argv)
    if args.r < 1:
        ap.error("--r must be >= 1")
    if args.out.exists() and any(args.out.iterdir()):
        ap.error(f"{args.out} is not empty")
    print(json.dumps(build(args.source, args.r, args.out, args.dtype)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
