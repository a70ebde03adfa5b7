"""Bad inputs and faults a new user hits: each is refused clearly and nothing of the user's is lost."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper
from transformers import AutoModelForCausalLM

import export.pipeline
import export.weights
import runtime
from common.manifest import ArtifactError
from common.staging import MARKER, OutputExistsError
from export.loader import CheckpointError
from export.pipeline import build_artifact
from quant.onnx_pass import store_float16
from runtime import ArtifactBusyError, NonFiniteLogitsError
from tests.conftest import tiny_recipe

ROOT = Path(__file__).resolve().parents[1]
TLM_ONLY = replace(tiny_recipe(), dlm=None)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "export", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def art(artifact_dir):
    return runtime.load_artifact(artifact_dir)


# 1. --out never destroys what we did not create


def test_out_refuses_a_users_folder_and_keeps_it_byte_for_byte(checkpoints, tmp_path):
    out = tmp_path / "photos"
    (out / "sub").mkdir(parents=True)
    (out / "a.jpg").write_bytes(os.urandom(1000))
    (out / "sub" / "notes.txt").write_text("mine")
    before = _snapshot(out)
    proc = _export_cli("--tlm", str(checkpoints["llama-tied"]), "--out", str(out), "--quiet")
    assert proc.returncode == 2
    assert "not a compiled artifact" in proc.stderr and "--force" in proc.stderr
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"]  # nothing hidden beside it either


def test_out_refuses_an_existing_file(checkpoints, tmp_path):
    out = tmp_path / "report.pdf"
    out.write_bytes(b"%PDF precious")
    with pytest.raises(OutputExistsError, match="not a folder"):
        build_artifact(TLM_ONLY, out, tlm=str(checkpoints["llama-tied"]), progress=False, force=True)
    assert out.read_bytes() == b"%PDF precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.pdf"]


def test_out_refuses_an_artifact_holding_a_users_file(checkpoints, tmp_path):
    out = build_artifact(TLM_ONLY, tmp_path / "art", tlm=str(checkpoints["llama-tied"]), progress=False)
    (out / "my-notes.md").write_text("benchmarks I ran")
    before = _snapshot(out)
    with pytest.raises(OutputExistsError, match="not a compiled artifact"):
        build_artifact(TLM_ONLY, out, tlm=str(checkpoints["llama-tied"]), progress=False)
    assert _snapshot(out) == before


def test_out_replaces_an_artifact_an_empty_folder_or_anything_with_force(checkpoints, tmp_path):
    tlm = str(checkpoints["llama-tied"])
    out = build_artifact(TLM_ONLY, tmp_path / "art", tlm=tlm, progress=False)
    build_artifact(TLM_ONLY, out, tlm=tlm, progress=False)  # our own artifact: replaced atomically
    (tmp_path / "empty").mkdir()
    build_artifact(TLM_ONLY, tmp_path / "empty", tlm=tlm, progress=False)
    forced = tmp_path / "forced"
    forced.mkdir()
    (forced / "junk.txt").write_text("x")
    build_artifact(TLM_ONLY, forced, tlm=tlm, progress=False, force=True)
    for folder in (out, tmp_path / "empty", forced):
        assert runtime.load_artifact(folder).manifest.name == "tiny-test"
    assert not (forced / "junk.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "empty", "forced"]


def test_out_refuses_a_symlink_even_with_force(checkpoints, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "mine.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OutputExistsError, match="not a folder"):
        build_artifact(TLM_ONLY, link, tlm=str(checkpoints["llama-tied"]), progress=False, force=True)
    assert (real / "mine.txt").read_text() == "keep" and link.is_symlink()


def test_a_kill_mid_swap_is_repaired_by_the_next_export(checkpoints, tmp_path, caplog):
    """Killed after the old artifact moved aside and before the new one moved in: --out is missing,
    and the next export puts the old artifact back before building (never deletes the good copy)."""
    tlm = str(checkpoints["llama-tied"])
    out = build_artifact(TLM_ONLY, tmp_path / "art", tlm=tlm, progress=False)
    before = _snapshot(out)
    holder = tmp_path / ".art.old-x1"
    holder.mkdir()
    (holder / MARKER).write_text(json.dumps({"pid": _dead_pid(), "host": os.uname().nodename}))
    os.replace(out, holder / "art")
    from common.staging import clean_stale

    assert clean_stale(out) == [holder]
    assert _snapshot(out) == before and not holder.exists()


# 2. NaN / Inf weights are refused at export, NaN logits at run time


def _damaged_checkpoint(checkpoints, tmp_path, value: float) -> Path:
    path = tmp_path / "damaged"
    shutil.copytree(checkpoints["llama-tied"], path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = value
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("value,word", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(checkpoints, tmp_path, value, word):
    bad = _damaged_checkpoint(checkpoints, tmp_path, value)
    with pytest.raises(CheckpointError, match=rf"TLM weight 'model.layers.1.mlp.down_proj.weight' contains {word}"):
        build_artifact(TLM_ONLY, tmp_path / "art", tlm=str(bad), progress=False)
    assert not (tmp_path / "art").exists()


def test_float16_storage_names_nan_as_nan():
    def model_with(value: float) -> onnx.ModelProto:
        w = numpy_helper.from_array(np.array([[1.0, value]], np.float32), "w")
        graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                                  [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])], [w])
        return helper.make_model(graph)

    with pytest.raises(ValueError, match="'w' contains NaN"):
        store_float16(model_with(float("nan")))
    with pytest.raises(ValueError, match="'w' contains Inf"):
        store_float16(model_with(float("-inf")))
    with pytest.raises(ValueError, match="beyond float16's range"):
        store_float16(model_with(1e6))


def test_runtime_refuses_nan_logits(checkpoints, tmp_path, monkeypatch):
    bad = _damaged_checkpoint(checkpoints, tmp_path, float("nan"))
    monkeypatch.setattr(export.weights, "check_finite", lambda array, key, role: None)  # as before the fix
    art = runtime.load_artifact(build_artifact(TLM_ONLY, tmp_path / "art", tlm=str(bad), progress=False))
    with pytest.raises(NonFiniteLogitsError, match="NaN/Inf logits"):
        runtime.generate(art, [5, 6, 7], max_new_tokens=4)
    with pytest.raises(NonFiniteLogitsError):  # and the artifact is not left held by the failed generation
        runtime.generate(art, [5, 6, 7], max_new_tokens=4)


# 3. --dlm on a recipe without a draft model adds it


def test_dlm_flag_adds_a_draft_model_to_a_recipe_without_one(checkpoints, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mxspd.export"):
        out = build_artifact(TLM_ONLY, tmp_path / "art", tlm=str(checkpoints["llama-gqa"]),
                             dlm=str(checkpoints["draft"]), progress=False)
    assert "adding" in caplog.text and "DLM" in caplog.text
    art = runtime.load_artifact(out)
    assert art.manifest.models["dlm"].source == str(checkpoints["draft"])
    spd = runtime.generate(art, [5, 6, 7], max_new_tokens=12, speculative=True, draft_length=1)  # always drafts
    assert spd.metrics.speculative["dlm_calls"] > 0
    assert spd.token_ids == runtime.generate(art, [5, 6, 7], max_new_tokens=12, speculative=False).token_ids


# 4. Staging folders left by killed exports are cleaned, and only those


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_staging_folders_of_ours_are_removed_and_named(checkpoints, tmp_path, caplog):
    out = tmp_path / "art"
    # A real kill: a process makes its staging folder and dies without cleaning up.
    subprocess.run([sys.executable, "-c", "import os, sys; from pathlib import Path; "
                    "from common.staging import make_staging; make_staging(Path(sys.argv[1]), 'export'); "
                    "(Path(sys.argv[1]).parent / 'killed.txt').touch(); os._exit(9)", str(out)], cwd=ROOT, check=False)
    killed = [p for p in tmp_path.iterdir() if p.name.startswith(".art.export-")]
    assert len(killed) == 1
    (killed[0] / "weights.bin").write_bytes(b"\0" * 4096)
    stale = tmp_path / ".art.partial-x1"
    stale.mkdir()
    (stale / MARKER).write_text(json.dumps({"pid": _dead_pid(), "host": os.uname().nodename}))
    live_owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / ".art.partial-live"
        live.mkdir()
        (live / MARKER).write_text(json.dumps({"pid": live_owner.pid, "host": os.uname().nodename}))
        users = tmp_path / ".art.export-mine"  # our naming, but no marker: not recognisably ours
        users.mkdir()
        (users / "keep.txt").write_text("mine")
        with caplog.at_level(logging.INFO, logger="mxspd.export"):
            build_artifact(TLM_ONLY, out, tlm=str(checkpoints["llama-tied"]), progress=False)
    finally:
        live_owner.kill()
        live_owner.wait()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".art.export-mine", ".art.partial-live", "art", "killed.txt"]
    assert (users / "keep.txt").read_text() == "mine"
    assert f"removed {killed[0]}" in caplog.text and f"removed {stale}" in caplog.text


# 5. Two generations on one loaded artifact never corrupt each other


def test_interleaved_streams_refuse_the_second_and_keep_the_first_correct(art):
    alone = runtime.generate(art, [5, 6, 7], max_new_tokens=20, speculative=False).text
    first = runtime.stream(art, [5, 6, 7], max_new_tokens=20, speculative=False)
    pieces = [next(first)]
    second = runtime.stream(art, [9, 9, 9], max_new_tokens=20, speculative=True)
    with pytest.raises(ArtifactBusyError, match="in use by another generation"):
        next(second)
    pieces.extend(first)
    assert "".join(pieces) == alone
    unfinished = runtime.stream(art, [5, 6, 7], max_new_tokens=20)
    next(unfinished)
    unfinished.close()  # closing an unfinished stream frees the artifact
    assert runtime.generate(art, [5, 6, 7], max_new_tokens=20, speculative=False).text == alone


def test_threads_sharing_an_artifact_wait_their_turn(art):
    prompts = [[5, 6, 7], [9, 8, 7, 6], [20, 21], [30, 31, 32, 33, 34]]
    expected = {i: runtime.generate(art, p, max_new_tokens=24, speculative=i % 2 == 0).token_ids
                for i, p in enumerate(prompts)}
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(3):
                got[i] = runtime.generate(art, prompts[i], max_new_tokens=24, speculative=i % 2 == 0).token_ids
                assert got[i] == expected[i]
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == expected


# 6. A manifest of the wrong shape is refused clearly


@pytest.fixture
def copy_of(artifact_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(artifact_dir, dst)
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda m: m | {"files": {}}, "no checksum for"),
    (lambda m: [], "expected a JSON object"),
    (lambda m: m | {"context_length": "abc"}, "manifest.context_length: expected int, got str 'abc'"),
    (lambda m: m | {"k": True}, "manifest.k: expected int, got bool"),
    (lambda m: {k: v for k, v in m.items() if k != "models"}, "missing keys \\['models'\\]"),
    (lambda m: m | {"models": {"tlm": m["models"]["tlm"] | {"graphs": []}}}, "manifest.models\\['tlm'\\].graphs"),
    (lambda m: m | {"files": m["files"] | {"../../etc/passwd": "0" * 64}}, "not a path inside the artifact"),
    (lambda m: m | {"files": {k: "beef" for k in m["files"]}}, "not a sha256"),
])
def test_manifest_schema_is_checked(copy_of, edit, message):
    path = copy_of / "manifest.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(ArtifactError, match=message):
        runtime.load_artifact(copy_of)


# 7. The smaller ones


def test_garbage_config_is_a_clear_error(checkpoints, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama-tied"], bad)
    (bad / "config.json").write_text("{ this is not json")
    proc = _export_cli("--tlm", str(bad), "--out", str(tmp_path / "art"), "--quiet")
    assert proc.returncode == 2 and "config.json cannot be read" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "art").exists()


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(prompt=[10.0, 1.7]), TypeError, "prompt"),
    (dict(prompt=np.array([[1, 2]])), TypeError, "prompt"),
    (dict(prompt=[True, 5]), TypeError, "prompt"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
    (dict(seed="42"), TypeError, "seed"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(stop=""), ValueError, "stop"),
    (dict(stop=["ok", 3]), TypeError, "stop"),
    (dict(speculative="no"), ValueError, "speculative"),
    (dict(chat="yes"), TypeError, "chat"),
])
def test_bad_generation_arguments_name_the_parameter(art, kwargs, error, name):
    kwargs = {"prompt": [5, 6, 7]} | kwargs
    with pytest.raises(error, match=name):
        runtime.generate(art, **kwargs)
    with pytest.raises(error, match=name):
        runtime.stream(art, **kwargs)  # refused when called, before the first piece is asked for


def test_numpy_integer_prompts_are_accepted(art):
    ids = runtime.generate(art, np.array([5, 6, 7], dtype=np.int32), max_new_tokens=5).token_ids
    assert ids == runtime.generate(art, [5, 6, 7], max_new_tokens=5).token_ids


def test_cli_prints_nothing_before_a_parameter_error(artifact_dir):
    proc = subprocess.run([sys.executable, "-m", "runtime", str(artifact_dir), "--prompt", "hello",
                           "--max-new-tokens", "0"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "max_new_tokens" in proc.stderr and proc.stdout == ""


def test_ctrl_c_is_a_message_not_a_traceback(artifact_dir, monkeypatch, capsys):
    import export.__main__
    import runtime.__main__

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "stream", interrupt)
    assert runtime.__main__.main([str(artifact_dir), "--max-new-tokens", "3"]) == 130
    monkeypatch.setattr(export.pipeline, "build_artifact", interrupt)
    assert export.__main__.main(["--quiet"]) == 130
    err = capsys.readouterr().err
    assert err.count("interrupted") == 2 and "Traceback" not in err


def test_quiet_export_prints_no_progress(checkpoints, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "quiet"\nprefill_chunk = 8\ncontext_length = 64\nmax_prompt_length = 32\n'
                      f'speculative = false\n[tlm]\nmodel = "{checkpoints["llama-tied"]}"\ndtype = "float16"\n')
    proc = _export_cli("--recipe", str(recipe), "--out", str(tmp_path / "art"), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "" and "%|" not in proc.stdout


def test_load_artifact_on_a_file_says_it_is_a_file(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ArtifactError, match="is a file, not an artifact folder"):
        runtime.load_artifact(tmp_path / "manifest.json")


# A property test of generate()'s argument checks: run correctly, or name the offending parameter.

ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**70), st.floats(allow_nan=True),
                st.text(max_size=3), st.lists(st.integers(-2, 300), max_size=3))
PARAMS = {
    "max_new_tokens": st.one_of(st.integers(1, 6), ANY),
    "do_sample": st.one_of(st.booleans(), ANY),
    "temperature": st.one_of(st.floats(0.05, 5), st.just(1e-300), ANY),
    "top_k": st.one_of(st.integers(0, 300), ANY),
    "top_p": st.one_of(st.floats(0.01, 1.0), ANY),
    "seed": st.one_of(st.integers(0, 2**64), ANY),
    "stop": st.one_of(st.just(()), st.sampled_from(["\n", ["a", "b"]]), ANY),
    "speculative": st.one_of(st.booleans(), ANY),
    "chat": st.one_of(st.booleans(), ANY),
    "draft_length": st.one_of(st.none(), st.integers(1, 3), ANY),
}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.one_of(st.lists(st.integers(0, 259), min_size=1, max_size=6), st.text(max_size=8), ANY),
       kwargs=st.fixed_dictionaries({}, optional=PARAMS))
def test_generate_arguments_run_or_name_the_parameter(art, prompt, kwargs):
    try:
        result = runtime.generate(art, prompt, **kwargs)
    except (ValueError, TypeError) as exc:
        named = [name for name in ["prompt", *kwargs] if name in str(exc)]
        assert named, f"{type(exc).__name__} names no parameter: {exc}"
        return
    assert result.finish_reason in ("eos", "length", "stop") and 1 <= len(result.token_ids)
    limit = kwargs.get("max_new_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool):
        assert len(result.token_ids) <= limit
