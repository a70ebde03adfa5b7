"""Configurations that do not fit are refused before any work, naming the estimate and what the machine has."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import common.resources as resources
import export.pipeline as pipeline
import runtime
from benchmarks.make_checkpoint import config_for, make_checkpoint, tensor_shapes, write_safetensors, write_tokenizer
from common.recipe import ModelSpec
from common.resources import GIB, DoesNotFitError
from export import fit
from export.__main__ import main as export_main
from export.fit import parameter_counts
from tests.conftest import tiny_recipe


def _no_loading(*args, **kwargs):
    raise AssertionError("a model was loaded although the export does not fit")


def test_an_export_that_does_not_fit_in_memory_is_refused_before_loading(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: 100 << 20)
    monkeypatch.setattr(pipeline, "placeholder_model", _no_loading)
    with pytest.raises(DoesNotFitError, match=r"does not fit in memory: needs about 0\.\d GiB .* 0\.1 GiB available"):
        pipeline.build_artifact(tiny_recipe(dlm=None), tmp_path / "art", tlm=str(checkpoints["llama-gqa"]),
                                progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a staging folder


def test_an_export_that_does_not_fit_on_disk_is_refused_before_loading(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "free_disk", lambda path: 1 << 10)
    monkeypatch.setattr(pipeline, "placeholder_model", _no_loading)
    code = export_main(["--recipe", "tiny-stdlib-spd", "--tlm", str(checkpoints["llama-gqa"]), "--dlm",
                        str(checkpoints["draft"]), "--out", str(tmp_path / "art"), "--quiet"])
    assert code == 2 and list(tmp_path.iterdir()) == []


def test_an_artifact_that_does_not_fit_in_memory_is_refused_before_loading(artifact_dir, monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: 1 << 10)  # the tiny artifact needs ~1 MiB
    with pytest.raises(DoesNotFitError, match=f"artifact {artifact_dir} does not fit in memory: needs about"):
        runtime.load_artifact(artifact_dir)
    monkeypatch.undo()
    assert runtime.load_artifact(artifact_dir).tlm  # the negative control: the real machine has room


def test_the_parameter_count_comes_from_the_config_alone(checkpoints):
    for kind in ("llama-gqa", "draft"):
        model = AutoModelForCausalLM.from_pretrained(checkpoints[kind])
        total, largest = parameter_counts(checkpoints[kind], 64)
        assert total == model.num_parameters()
        assert largest == max(p.numel() for p in model.parameters())


def test_a_real_shaped_checkpoint_is_written_tensor_by_tensor(tmp_path):
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, torch_dtype="float16")
    shapes = tensor_shapes(config)
    write_safetensors(tmp_path / "model.safetensors", shapes, seed=3, progress=False)
    tensors = load_file(tmp_path / "model.safetensors")
    assert {k: v.shape for k, v in tensors.items()} == shapes
    assert all(v.dtype == np.float16 for v in tensors.values())
    assert (tensors["model.norm.weight"] == 1).all()
    q = tensors["model.layers.0.self_attn.q_proj.weight"].astype(np.float32)
    assert abs(q.std() - 0.02) < 0.002 and abs(q.mean()) < 0.002
    config.save_pretrained(tmp_path)
    write_tokenizer(tmp_path, 300, "<s>", "</s>", None)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.float16))
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 300
    again = tmp_path / "again"
    again.mkdir()
    write_safetensors(again / "model.safetensors", shapes, seed=3, progress=False)
    assert (again / "model.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()  # seeded


def test_make_checkpoint_states_the_weights_are_random(tmp_path, monkeypatch):
    import benchmarks.make_checkpoint as mc

    monkeypatch.setitem(mc.SHAPES, "toy", mc.LLAMA | dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=2, num_key_value_heads=2,
                                                          max_position_embeddings=64, vocab_size=400))
    out = make_checkpoint("toy", tmp_path / "toy", progress=False)
    assert "RANDOM weights" in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 400
    assert GIB > (out / "model.safetensors").stat().st_size > 0


def test_make_checkpoint_layers_keeps_the_widths(tmp_path):
    import benchmarks.make_checkpoint as mc

    full, short = mc.config_for("llama2-7b"), mc.config_for("llama2-7b", layers=2)
    assert (short.num_hidden_layers, full.num_hidden_layers) == (2, 32)
    assert (short.hidden_size, short.intermediate_size, short.vocab_size) == (4096, 11008, 32000)
    assert mc.config_for("codegen-350m", layers=3).n_layer == 3
    shapes = mc.tensor_shapes(short)
    assert not any(".layers.2." in name for name in shapes) and any(".layers.1." in name for name in shapes)
    with pytest.raises(ValueError, match="at least 1"):
        mc.config_for("llama2-7b", layers=0)


def test_the_disk_estimate_follows_the_measured_7b_export():
    """A Llama-2-7B-shaped MXFP6 export (the MXINT8 head and table, the defaults) peaked at 10.8 GB of extra
    disk (docs/benchmarks.md, "Real sizes"; 0.80x its 13.5 GB checkpoint): the check asks for that and a
    little more, not 2x it."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_for("llama2-7b"))
    sizes = [p.numel() for p in model.parameters()]
    params = {"tlm": (sum(sizes), max(sizes))}
    needed = fit.export_disk(params, {"tlm": ModelSpec(model="", mx_format="fp6_e2m3")})
    assert 10.8e9 <= needed <= 1.1 * 10.8e9
