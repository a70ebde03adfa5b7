"""The embedded default model pair: a small Llama TLM and DLM over Python standard-library code.

Needs no download: the tokenizer is a byte-level BPE trained on the standard library's own source
(every machine has it), and the models are built from fixed configs with fixed seeds, then cached.
Held-out modules (HELD_OUT) never enter the training text and serve for evaluation.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VERSION = 1
VOCAB_SIZE = 4096
HELD_OUT = ("json", "csv", "argparse", "textwrap", "fractions", "heapq", "bisect", "shlex")
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}

CONFIGS = {
    "stdlib-tlm": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=4, seed=1234),
    "stdlib-dlm": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, seed=4321),
}


def cache_root() -> Path:
    return Path(os.environ.get("MXSPD_CACHE", Path.home() / ".cache" / "mxspd"))


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


def train_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE, max_bytes: int = 4_000_000) -> None:
    """Byte-level BPE trained deterministically on the first max_bytes of the training modules."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, total = [], 0
    for f in stdlib_files("train"):
        text = f.read_text(errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
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


def build_model(name: str, out_dir: Path, tokenizer_dir: Path) -> None:
    cfg = dict(CONFIGS[name])
    torch.manual_seed(cfg.pop("seed"))
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        **cfg,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out_dir)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy2(f, out_dir / f.name)


def builtin_model_dir(name: str) -> Path:
    """Return the cached checkpoint folder of a builtin model, building it on first use."""
    if name not in CONFIGS:
        raise ValueError(f"unknown builtin model {name!r}; available: {sorted(CONFIGS)}")
    digest = hashlib.sha256(repr((VERSION, CONFIGS[name], HELD_OUT, VOCAB_SIZE)).encode()).hexdigest()[:10]
    target = cache_root() / "builtin" / f"{name}-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tok_dir = Path(tmp) / "tokenizer"
        train_tokenizer(tok_dir)
        build_model(name, Path(tmp) / "model", tok_dir)
        try:
            os.replace(Path(tmp) / "model", target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    return target
