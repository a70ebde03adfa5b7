"""The shipped default pair: present, one tokenizer, a TLM better than its DLM, a deterministic trainer."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, PreTrainedTokenizerFast

from export.loader import resolve_model_dir
from recipes import default_pair
from recipes.builtin import builtin_model_dir
from recipes.default_pair import BUILTIN_DIR, CONFIGS, HELD_OUT, stdlib_files


def test_shipped_pair_resolves_and_shares_one_tokenizer():
    dirs = {name: resolve_model_dir(f"builtin:{name}") for name in CONFIGS}
    toks = {n: PreTrainedTokenizerFast.from_pretrained(d).get_vocab() for n, d in dirs.items()}
    assert toks["stdlib-tlm"] == toks["stdlib-dlm"] and len(toks["stdlib-tlm"]) == default_pair.VOCAB_SIZE
    for name, d in dirs.items():
        cfg = AutoConfig.from_pretrained(d)
        assert cfg.model_type == "llama" and cfg.hidden_size == CONFIGS[name]["hidden_size"]
    size = sum(f.stat().st_size for f in BUILTIN_DIR.rglob("*") if f.is_file())
    assert size <= 40 * 2**20  # the repo ships at most 40 MB of weights


def test_training_record_shows_a_target_better_than_its_draft():
    record = json.loads((BUILTIN_DIR / "training.json").read_text())
    ppl = {n: m["held_out_perplexity_fp32"] for n, m in record["models"].items()}
    assert ppl["stdlib-tlm"] < ppl["stdlib-dlm"]
    assert record["held_out_modules"] == list(HELD_OUT)


def test_held_out_modules_never_enter_training_text():
    train, held = set(stdlib_files("train")), set(stdlib_files("heldout"))
    assert held and not train & held
    root = Path(sysconfig.get_paths()["stdlib"])
    assert {f.relative_to(root).parts[0].removesuffix(".py") for f in held} == set(HELD_OUT)


def test_unknown_builtin_is_an_error():
    with pytest.raises(ValueError, match="unknown builtin"):
        builtin_model_dir("stdlib-huge")


def test_training_is_deterministic(monkeypatch):
    tok = PreTrainedTokenizerFast.from_pretrained(builtin_model_dir("stdlib-dlm"))
    stream = np.random.default_rng(0).integers(0, len(tok), 5000)
    monkeypatch.setitem(default_pair.TRAINING, "stdlib-dlm",
                        dict(seed=3, steps=3, batch=2, seq_len=32, lr=1e-3, warmup=1))
    a, b = (default_pair.train_model("stdlib-dlm", tok, stream, progress=False).state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    fresh = default_pair.new_model("stdlib-dlm", tok, seed=3).state_dict()
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], fresh["model.layers.0.mlp.up_proj.weight"])
