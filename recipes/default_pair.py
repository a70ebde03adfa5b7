"""The embedded default model pair: a small Llama TLM and DLM trained on Python standard-library code.

Both models learn the same text (the standard library's own source, which every machine has), so the
DLM agrees with the TLM because it learned the same data. The trained weights ship in
`recipes/builtin/` (fp16 safetensors, ~13 MB); `python -m recipes.default_pair` reproduces them
deterministically (fixed seeds, fixed data order, fixed step counts). Held-out modules (HELD_OUT)
never enter the training text and serve for evaluation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BUILTIN_DIR = Path(__file__).parent / "builtin"
VOCAB_SIZE = 4096
HELD_OUT = ("json", "csv", "argparse", "textwrap", "fractions", "heapq", "bisect", "shlex")
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}

CONFIGS = {
    "stdlib-tlm": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=4),
    "stdlib-dlm": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2),
}
# Optimisation budget per model: ~45 min (TLM) and ~4 min (DLM) on 2 CPU cores. The TLM needs the
# longer run to beat the DLM: at 600 steps it was still behind it (held-out perplexity 88 vs 71).
TRAINING = {
    "stdlib-tlm": dict(seed=1234, steps=1500, batch=16, seq_len=256, lr=3e-3, warmup=60),
    "stdlib-dlm": dict(seed=4321, steps=2000, batch=16, seq_len=256, lr=3e-3, warmup=60),
}
DATA_SEED = 20261123


def stdlib_files(split: str = "train") -> list[Path]:
    """Standard-library modules in a fixed order; `split` is "train" or "heldout"."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f for f in root.rglob("*.py")
        if not {"test", "tests", "idlelib", "site-packages", "lib2to3"} & set(f.relative_to(root).parts)
    )
    held = [f for f in files if f.relative_to(root).parts[0].removesuffix(".py") in HELD_OUT]
    return held if split == "heldout" else [f for f in files if f not in held]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges (SPECIAL + 256 byte tokens): instant, for tests and benchmarks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(list(SPECIAL.values()) + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)


def training_texts(at_least: int) -> list[str]:
    """The training modules' texts in order, as many as reach `at_least` characters in all."""
    texts, total = [], 0
    for f in stdlib_files("train"):
        texts.append(f.read_text(errors="replace"))
        total += len(texts[-1])
        if total >= at_least:
            break
    return texts


def train_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE, max_bytes: int = 4_000_000) -> None:
    """Byte-level BPE trained deterministically on the first max_bytes of the training modules."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = training_texts(max_bytes)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    fast.add_bos_token = True
    fast.save_pretrained(out_dir)


def encode_files(tok: PreTrainedTokenizerFast, files: list[Path]) -> np.ndarray:
    """One token stream: each module's tokens followed by EOS."""
    ids: list[int] = []
    for f in files:
        ids.extend(tok(f.read_text(errors="replace"), add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
    return np.asarray(ids, dtype=np.int64)


def new_model(name: str, tok: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        **CONFIGS[name],
    )
    return LlamaForCausalLM(config)


def optimise(model: LlamaForCausalLM, stream: np.ndarray, hp: dict, loss: Callable[[torch.Tensor], torch.Tensor],
             lr_at: Callable[[int], float], rng: np.random.Generator, weight_decay: float, desc: str,
             progress: bool = True) -> LlamaForCausalLM:
    """AdamW on random windows of the stream (`rng` picks them), learning rate `lr_at(step)`: the loop
    that trains the default pair and distils draft models."""
    from tqdm import tqdm

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], betas=(0.9, 0.95), weight_decay=weight_decay)
    n = hp["seq_len"]
    bar = tqdm(range(hp["steps"]), desc=desc, disable=not progress, unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = rng.integers(0, len(stream) - n, size=hp["batch"])
        value = loss(torch.from_numpy(np.stack([stream[s:s + n] for s in starts])))
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{value.item():.3f}")
    return model.eval()


def train_model(name: str, tok: PreTrainedTokenizerFast, stream: np.ndarray, progress: bool = True) -> LlamaForCausalLM:
    """Warm-up and cosine decay to 0.1 of the peak, all from fixed seeds."""
    hp = TRAINING[name]
    model = new_model(name, tok, hp["seed"])

    def lr_at(step: int) -> float:
        warm = min(1.0, (step + 1) / hp["warmup"])
        cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * step / hp["steps"]))
        return hp["lr"] * warm * cosine

    def loss(batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss  # the model shifts labels itself

    return optimise(model, stream, hp, loss, lr_at, np.random.default_rng(DATA_SEED), 0.1, f"training {name}",
                    progress)


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, stream: np.ndarray, seq_len: int = 256) -> float:
    """Token-level perplexity over consecutive non-overlapping windows of the stream."""
    total, count = 0.0, 0
    for s in range(0, len(stream) - 1, seq_len):
        chunk = torch.from_numpy(stream[s:s + seq_len + 1])[None]
        if chunk.shape[1] < 2:
            break
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
        total += nll.item()
        count += chunk.shape[1] - 1
    return math.exp(total / count)


def shipped_model_dir(name: str, rebuild: str = "recipes.default_pair") -> Path:
    """A checkpoint folder shipped in recipes/builtin/; FileNotFoundError (saying how to rebuild it) if
    its files are missing. `rebuild`: the module that trains it."""
    target = BUILTIN_DIR / name
    if not (target / "config.json").is_file() or not (target / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"builtin model {name!r} is missing from {target}: reinstall the package, or rebuild it with "
            f"`python -m {rebuild}`"
        )
    return target


def main(argv: list[str] | None = None) -> None:
    """Train the tokenizer and both models and write them (fp16) with a training record."""
    parser = argparse.ArgumentParser(prog="python -m recipes.default_pair", description=main.__doc__)
    parser.add_argument("--out", type=Path, default=BUILTIN_DIR)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the shipped weights used 2)")
    parser.add_argument("--only", choices=sorted(CONFIGS), help="train one model (each has its own seeds)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    record_path = args.out / "training.json"
    record: dict = json.loads(record_path.read_text()) if record_path.is_file() else {"models": {}}
    record.update({"torch": torch.__version__, "threads": args.threads, "data_seed": DATA_SEED,
                   "held_out_modules": list(HELD_OUT)})
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        tok_dir = Path(tmp) / "tokenizer"
        train_tokenizer(tok_dir)
        tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        train_stream = encode_files(tok, stdlib_files("train"))
        held_stream = encode_files(tok, stdlib_files("heldout"))
        record.update(train_tokens=int(len(train_stream)), held_out_tokens=int(len(held_stream)))
        for name in [args.only] if args.only else CONFIGS:
            t0 = time.perf_counter()
            model = train_model(name, tok, train_stream)
            seconds = time.perf_counter() - t0
            ppl = perplexity(model, held_stream)
            staged = Path(tmp) / name
            model.to(torch.float16).save_pretrained(staged)  # ~2 bytes per parameter in the repo
            tok.save_pretrained(staged)
            shutil.rmtree(args.out / name, ignore_errors=True)
            os.replace(staged, args.out / name)
            record["models"][name] = {
                "config": CONFIGS[name], "training": TRAINING[name], "train_seconds": round(seconds, 1),
                "parameters": sum(p.numel() for p in model.parameters()),
                "held_out_perplexity_fp32": round(ppl, 3),
            }
            print(f"{name}: held-out perplexity {ppl:.3f} ({seconds:.0f} s)")
    record_path.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
