"""Calibration text for a recipe's MX quantizer: plain prose, then the TLM's own answers in its chat template.

GPTQ-style error feedback (quant/error_feedback.py) weighs rounding errors by the inputs the model
sees, so its text should look like them. With no dataset to draw on, the text is made of two parts:
a prose file that needs no download (default: the Apache-2.0 licence Debian ships, which the
accuracy benchmark never scores), and the n-gram draft's instructions (recipes/ngram_draft.py; the
recipe's own prompts left out) in the chat template, each followed by the float32 model's greedy
answer as transformers generates it from the same checkpoint. Measured on SmolLM2 (docs/benchmarks-history.md,
Accuracy): the answers alone gained little on held-out prose, the licence alone most on the other
licence; both together gained on both held-out texts. Deterministic: fixed instructions, greedy decoding.

    python -m recipes.calibration_text [--recipe smollm2-135m-chat] [--prose FILE] [--prompts 48] [--out FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from export.calibration import float_model
from export.loader import resolve_model_dir
from recipes import DEFAULT_RECIPE, get_recipe
from recipes.default_pair import BUILTIN_DIR
from recipes.ngram_draft import instructions

PROSE = Path("/usr/share/common-licenses/Apache-2.0")
ANSWER_TOKENS = 96
BATCH = 8


def calibration_text(reference: str, prompts: list[str], answer_tokens: int = ANSWER_TOKENS,
                     progress: bool = True) -> str:
    """Each prompt in the checkpoint's chat template followed by its float32 greedy answer."""
    model_dir = resolve_model_dir(reference, "tlm")
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, padding_side="left")
    model = float_model(model_dir, 2048)
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    parts = []
    for start in tqdm(range(0, len(chats), BATCH), desc="answering", unit="batch", disable=not progress):
        asked = chats[start : start + BATCH]
        batch = tok(asked, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=answer_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
        answers = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        parts += [chat + answer.strip() + tok.eos_token + "\n" for chat, answer in zip(asked, answers, strict=True)]
    return "".join(parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m recipes.calibration_text", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=DEFAULT_RECIPE)
    p.add_argument("--prompts", type=int, default=48, help="instructions answered")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS)
    p.add_argument("--prose", default=str(PROSE), help="plain text put first ('' for none)")
    p.add_argument("--out", type=Path, help="default: recipes/builtin/<recipe>-calibration.txt")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.answer_tokens < 1:
        p.error("--prompts and --answer-tokens must be >= 1")
    recipe = get_recipe(args.recipe)
    out = args.out or BUILTIN_DIR / f"{recipe.name}-calibration.txt"
    prompts = instructions(exclude=recipe.prompts)[: args.prompts]
    try:
        prose = Path(args.prose).read_text() + "\n" if args.prose else ""
    except OSError as exc:
        p.error(f"--prose: {exc}")
    text = prose + calibration_text(recipe.tlm.model, prompts, args.answer_tokens)
    out.write_text(text)
    print(f"{out}: {len(prompts)} answers, {len(text):,} characters")


if __name__ == "__main__":
    main()
