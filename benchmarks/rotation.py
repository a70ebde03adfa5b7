"""What a Hadamard rotation within each 32-weight block would buy MXFP4, before building it into the kernels.

    python -m benchmarks.rotation [--recipe smollm2-135m-chat] [--text os:licences] [--tokens 4096]
                                  [--window N] [--calibration TEXT]

Rotating a linear's inputs by R (block-diagonal, 32 x 32 Hadamard blocks along K, orthonormal) and its
weights by R too leaves the float product unchanged (x W = (x R)(R W)) but spreads each block's outliers
over its 32 weights, which MR-GPTQ and llama.cpp's MXFP4 work found to help a power-of-two block scale. This
simulates it in transformers' float32 model of the recipe's TLM: every decoder linear in MXFP4 (`min_error`
exponents), rounded to nearest and with error feedback (GPTQ, act order, over the calibration text: the
recipe's, else the standard-library modules the default pair trained on, `stdlib:train`; the recipe's
`mx_calibration_tokens` of it, as a build reads), each with and without the rotation; the LM head and the
activations stay float. Prints perplexity ratio, mean KL and top-1 agreement against float32 on held-out
text (benchmarks.accuracy's texts, in windows of the recipe's context, at most 512). Results:
docs/formats.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from benchmarks.accuracy import LICENCES, STDLIB_TRAIN, WINDOW, calibration_reference, held_out_tokens
from export.calibration import calibrate, float_model
from export.loader import resolve_model_dir
from export.onnx_export import short_name
from quant.error_feedback import feedback_factor, quantize_with_feedback
from quant.mx import fake_quantize
from recipes import DEFAULT_RECIPE, get_recipe

BLOCK = 32


def hadamard(n: int = BLOCK) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / np.sqrt(n)


def rotate_rows(a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """R a for a [K, ...] with K a multiple of the block: each block of rows times the Hadamard block."""
    return (h @ a.reshape(a.shape[0] // BLOCK, BLOCK, -1)).reshape(a.shape)


def log_probs(model, ids: torch.Tensor, window: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([torch.log_softmax(model(ids[None, s : s + window]).logits[0], -1)
                          for s in range(0, len(ids), window)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=DEFAULT_RECIPE)
    ap.add_argument("--text", default=LICENCES, help="held-out text: FILE, pydoc:topics, os:licences or stdlib")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, help="positions per window (default: the recipe's context, at most 512)")
    ap.add_argument("--calibration", help="calibration text (default: the recipe's, else standard-library modules)")
    args = ap.parse_args(argv)
    recipe = get_recipe(args.recipe)
    model_dir = resolve_model_dir(recipe.tlm.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = float_model(model_dir, recipe.context_length)
    window = args.window or min(recipe.context_length, WINDOW)
    text_file = None if args.text == "stdlib" else Path(args.text)
    ids = torch.from_numpy(held_out_tokens(tokenizer, text_file, args.tokens + 1))
    inputs, targets = ids[:-1], ids[1:]
    reference = log_probs(model, inputs, window)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    with tempfile.TemporaryDirectory() as tmp:
        named = args.calibration or recipe.tlm.mx_calibration or STDLIB_TRAIN
        text = calibration_reference(named, Path(tmp))
        statistics, what = calibrate(text, recipe.tlm.mx_calibration_tokens,
                                     model_dir, recipe.context_length,
                                     lambda name: not name.startswith("lm_head"), progress=False, model=model)
    print(f"{recipe.tlm.model}: every decoder linear MXFP4 (min_error), head and activations float32; "
          f"{len(targets)} held-out tokens of {args.text}; calibration: {what.replace(text, named)}")
    h = hadamard()
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    for feedback in (False, True):
        for rotate in (False, True):
            hooks = []
            for name, module in linears.items():
                w = original[name].double().T  # [K, N]
                stats = torch.from_numpy(statistics[short_name(name) + ".weight.T"]).double()
                if rotate:
                    w, stats = rotate_rows(w, h), rotate_rows(rotate_rows(stats, h).T, h).T  # R W, R H R
                    hooks.append(module.register_forward_pre_hook(
                        lambda _m, a: ((a[0].reshape(*a[0].shape[:-1], -1, BLOCK) @ h.float()).reshape(a[0].shape),)))
                w32 = w.float().numpy()
                if feedback:
                    order, u = feedback_factor(stats.float().numpy())
                    q = quantize_with_feedback(w32, u, "fp4_e2m1", scale="min_error", order=order)
                else:
                    q = fake_quantize(w32, "fp4_e2m1", axis=0, scale="min_error")
                module.weight.data = torch.from_numpy(np.ascontiguousarray(q.T))
            got = log_probs(model, inputs, window)
            for hook in hooks:
                hook.remove()
            for name, module in linears.items():
                module.weight.data = original[name].clone()
            kl = (reference.exp() * (reference - got)).sum(-1).mean().item()
            nll = [-lp.gather(1, targets[:, None]).mean().item() for lp in (reference, got)]
            top1 = (reference.argmax(-1) == got.argmax(-1)).float().mean().item()
            label = f"{'error feedback' if feedback else 'to nearest'}{', rotated' if rotate else ''}"
            print(f"  {label:26s} perplexity {np.exp(nll[1] - nll[0]):.4f}x  KL {kl:.4f}  top-1 {top1:.1%}")


if __name__ == "__main__":
    main()
