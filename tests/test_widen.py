"""The widened TLM computes the small TLM's function, has the promised shapes, and builds once into the cache."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from common.staging import MARKER, OutputExistsError
from export.loader import load_model, resolve_model_dir
from quant.mx import dequantize, quantize
from recipes import get_recipe, widen
from recipes.builtin import builtin_model_dir
from recipes.default_pair import stdlib_files

TOL = 1e-4
N_TOKENS = 256


@pytest.fixture(scope="module")
def small() -> LlamaForCausalLM:
    return load_model(builtin_model_dir("stdlib-tlm"), context_length=N_TOKENS, progress=False)


@pytest.fixture(scope="module")
def held_out_ids() -> torch.Tensor:
    """The first N_TOKENS tokens of a held-out module (never in the training text)."""
    tok = PreTrainedTokenizerFast.from_pretrained(builtin_model_dir("stdlib-tlm"))
    text = stdlib_files("heldout")[0].read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"][:N_TOKENS]
    assert len(ids) == N_TOKENS
    return torch.tensor([ids])


@pytest.fixture(scope="module")
def small_logits(small, held_out_ids) -> torch.Tensor:
    with torch.no_grad():
        return small(input_ids=held_out_ids).logits


def max_diff(model: LlamaForCausalLM, ids: torch.Tensor, ref: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(input_ids=ids).logits - ref).abs().max().item()


@pytest.mark.parametrize("r", sorted({2, 3, widen.WIDE_R}))  # 3: not a power of two
def test_widened_model_has_the_same_logits(small, held_out_ids, small_logits, r):
    wide = widen.widen(small, r)
    assert max_diff(wide, held_out_ids, small_logits) <= TOL


def test_a_wrong_widening_is_caught(small, held_out_ids, small_logits):
    """Negative controls: the same comparison sees a missing 1/r and a broken GQA head layout."""
    wide = widen.widen(small, 2)
    with torch.no_grad():
        wide.model.layers[0].mlp.down_proj.weight.mul_(2)  # forgot the 1/r on down_proj
    assert max_diff(wide, held_out_ids, small_logits) > 100 * TOL

    wide = widen.widen(small, 2)
    attn = wide.model.layers[0].self_attn
    d, n_kv = small.config.head_dim, small.config.num_key_value_heads
    # interleave the kv head copies (k0 k0 k1 k1 ...) while q heads stay tiled: q heads read the wrong kv heads
    order = torch.arange(2 * n_kv).view(2, n_kv).t().reshape(-1)
    rows = (order[:, None] * d + torch.arange(d)).reshape(-1)
    with torch.no_grad():
        for proj in (attn.k_proj, attn.v_proj):
            proj.weight.copy_(proj.weight[rows])
    assert max_diff(wide, held_out_ids, small_logits) > 100 * TOL


def test_mx_quantization_commutes_with_the_recipe_widening(small):
    """WIDE_R is a power of two: MXFP6 of the widened weights is the widened MXFP6 weights (exactly)."""
    r = widen.WIDE_R
    wide = widen.widen(small, r)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.5.mlp.down_proj.weight"):
        w = small.state_dict()[name].numpy().T  # the exporter's W[K, N], blocked along K
        ww = wide.state_dict()[name].numpy().T
        expected = np.tile(dequantize(quantize(w, "fp6_e2m3", axis=0)), (r, r)) / r
        np.testing.assert_array_equal(dequantize(quantize(ww, "fp6_e2m3", axis=0)), expected)


def test_widened_config_shapes(small):
    r = 3
    src = small.config
    cfg = widen.widen(small, r).config
    assert cfg.hidden_size == r * src.hidden_size == r * 256
    assert cfg.intermediate_size == r * src.intermediate_size == r * 704
    assert cfg.num_attention_heads == r * 8 and cfg.num_key_value_heads == r * 4
    assert cfg.head_dim == src.head_dim == 32 and cfg.num_hidden_layers == src.num_hidden_layers
    assert cfg.vocab_size == src.vocab_size and cfg.rms_norm_eps == src.rms_norm_eps
    assert src.tie_word_embeddings and not cfg.tie_word_embeddings
    assert cfg.to_dict()["head_dim"] == 32  # written explicitly, not derived from hidden / heads
    decoder = sum(p.numel() for n, p in small.named_parameters() if ".layers." in n)
    wide_decoder = sum(p.numel() for n, p in widen.widen(small, r).named_parameters() if ".layers." in n)
    norms = sum(p.numel() for n, p in small.named_parameters() if ".layers." in n and "norm" in n)
    assert wide_decoder == r * r * (decoder - norms) + r * norms


def test_recipe_r_is_in_the_decode_bound_range(small):
    with torch.device("meta"):
        wide = LlamaForCausalLM(widen.widened_config(small.config, widen.WIDE_R))
    assert 75e6 <= widen.parameter_count(wide) <= 200e6


def test_builtin_builds_once_into_the_cache(tmp_path, monkeypatch, held_out_ids, small_logits):
    monkeypatch.setenv("MXSPD_CACHE", str(tmp_path))
    first = resolve_model_dir("builtin:stdlib-tlm-wide")
    assert first == tmp_path / "builtin" / "stdlib-tlm-wide"
    assert [p.name for p in first.parent.iterdir()] == ["stdlib-tlm-wide"]  # no staging folder left behind
    assert PreTrainedTokenizerFast.from_pretrained(first).get_vocab() == PreTrainedTokenizerFast.from_pretrained(
        builtin_model_dir("stdlib-tlm")).get_vocab()
    loaded = load_model(first, context_length=N_TOKENS, progress=False)
    assert loaded.config.hidden_size == widen.WIDE_R * 256
    assert max_diff(loaded, held_out_ids, small_logits) <= TOL  # the saved float32 checkpoint, end to end

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a current cached widening")

    with monkeypatch.context() as m:
        m.setattr(widen, "build", no_rebuild)
        assert resolve_model_dir("builtin:stdlib-tlm-wide") == first

    record = json.loads((first / widen.RECORD).read_text())
    (first / widen.RECORD).write_text(json.dumps({**record, "source_sha256": "0" * 64}))  # shipped weights changed
    assert resolve_model_dir("builtin:stdlib-tlm-wide") == first
    assert json.loads((first / widen.RECORD).read_text()) == record
    assert [p.name for p in first.parent.iterdir()] == ["stdlib-tlm-wide"]


def test_cli_build_is_deterministic(tmp_path, capsys):
    for out in ("a", "b"):
        widen.main(["--r", "2", "--out", str(tmp_path / out)])
    assert "parameters" in capsys.readouterr().out
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", widen.RECORD} <= set(files)
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_cli_refuses_to_replace_a_folder_that_is_not_a_widening(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(OutputExistsError, match="not a widened model"):
        widen.main(["--r", "1", "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_killed_build_is_cleaned_by_the_next(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / ".w.partial-killed"
    left.mkdir()
    (left / MARKER).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    widen.main(["--r", "1", "--out", str(tmp_path / "w")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]
    assert not (tmp_path / "w" / MARKER).exists()


def test_wide_recipe_pairs_the_wide_tlm_with_the_distilled_dlm():
    wide, tiny = get_recipe("stdlib-wide-spd"), get_recipe("tiny-stdlib-spd")
    assert wide.tlm.model == "builtin:stdlib-tlm-wide" and wide.tlm.mx_format == "fp6_e2m3"
    assert wide.tlm.mx_lm_head == "format"
    assert wide.dlm.model == "builtin:stdlib-dlm-distilled" and wide.dlm.dtype == tiny.dlm.dtype
    assert (wide.prompts, wide.k, wide.context_length, wide.sampling) == (
        tiny.prompts, tiny.k, tiny.context_length, tiny.sampling)


def test_widen_refuses_bad_input(small):
    with pytest.raises(ValueError, match="positive integer"):
        widen.widen(small, 0)


def test_any_checkpoint_widens_to_a_bigger_cost_with_the_same_logits(small, held_out_ids, small_logits, tmp_path,
                                                                      checkpoints):
    """benchmarks.widen_checkpoint (a real model at a 7B's cost: docs/gpu.md) from a checkpoint reference,
    stored in float32 or, for a power-of-two r, exactly in float16 (the source's weights are float16)."""
    from benchmarks.widen_checkpoint import build

    source = str(builtin_model_dir("stdlib-tlm"))
    for r, dtype in ((3, "float32"), (2, "float16")):
        record = build(source, r, tmp_path / dtype, dtype)
        assert record["parameters"] > r * record["source_parameters"] and record["dtype"] == dtype
        with safe_open(tmp_path / dtype / "model.safetensors", "pt") as f:
            assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {f"torch.{dtype}"}
        wide = LlamaForCausalLM.from_pretrained(tmp_path / dtype, dtype=torch.float32)
        assert max_diff(wide, held_out_ids, small_logits) <= TOL
    with pytest.raises(ValueError, match="power-of-two r"):
        build(source, 3, tmp_path / "refused", "float16")
    with pytest.raises(ValueError, match="supports Llama checkpoints, this one is 'qwen2'"):
        build(str(checkpoints["qwen2"]), 2, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
