"""Build-time prepacked weights: one deduplicated copy per model, mapped by every graph's session.

ONNX Runtime's prepacking serves the kernels it runs itself: every float32 MatMul when an artifact is
built with `batch_invariant = false`, MatMulNBits always. Batch-invariant artifacts run float32
weights through ai.mxspd::RowMatMul, whose panels are packed by the compiler into the weights file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import onnx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import common.targets
import runtime
from benchmarks.variants import heap_prepacked_copy
from common.recipe import LookaheadSettings, ModelSpec, PromptLookupSettings
from common.targets import TargetUnavailableError, platform_signature
from export.pipeline import build_artifact
from recipes.default_pair import byte_tokenizer
from tests.conftest import tiny_recipe

ROOT = Path(__file__).resolve().parents[1]


def _prepacked_entries(path: Path) -> dict[str, tuple[str, str]]:
    """weight name -> (location, prepacked value) for each initializer that has a prepacked blob."""
    out = {}
    for t in onnx.load(str(path), load_external_data=False).graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        packed = [v for k, v in info.items() if k.startswith("prepacked")]
        if packed:
            assert len(packed) == 1
            out[t.name] = (info["location"], packed[0])
    return out


@pytest.fixture(scope="module")
def plain_dir(checkpoints, tmp_path_factory):
    """float32, not batch-invariant: every weight runs through ONNX Runtime's MatMul."""
    return build_artifact(replace(tiny_recipe(), batch_invariant=False), tmp_path_factory.mktemp("plain") / "art",
                          tlm=str(checkpoints["llama-gqa"]), dlm=str(checkpoints["draft"]), progress=False)


@pytest.fixture(scope="module")
def mx_fused_dir(checkpoints, tmp_path_factory):
    recipe = replace(tiny_recipe(), tlm=ModelSpec(model="", mx_format="fp6_e2m3", mx_lowering="fused"))
    return build_artifact(recipe, tmp_path_factory.mktemp("mx") / "art", tlm=str(checkpoints["llama-gqa"]),
                          dlm=str(checkpoints["draft"]), progress=False)


@pytest.mark.parametrize("which", ["fp32", "mx-fused"])
def test_every_graph_maps_the_same_prepacked_blobs(plain_dir, mx_fused_dir, which):
    art_dir = plain_dir if which == "fp32" else mx_fused_dir
    manifest = runtime.load_artifact(art_dir).manifest
    assert manifest.prepacked_for == platform_signature()
    for role, entry in manifest.models.items():
        graphs = {g: _prepacked_entries(art_dir / e.file) for g, e in entry.graphs.items()}
        first = next(iter(graphs.values()))
        n_matmuls = 7 * entry.dims.n_layers + 1  # q k v o gate up down per layer, and the LM head
        if entry.batch_invariant:  # float32 weights (the DLM's; the LM head where not MX) are RowMatMul panels
            n_matmuls = 0 if not entry.quant else n_matmuls if entry.quant["lm_head"] else n_matmuls - 1
        assert len(first) == n_matmuls, f"{role}: {len(first)} prepacked weights, expected {n_matmuls}"
        assert all(g == first for g in graphs.values()), "graphs point at different copies"
        for location, value in first.values():
            offset = int(value.split("|")[1].split(";")[0])
            assert location == "weights.bin" and offset % 4096 == 0  # ORT maps only aligned blobs
        if which == "mx-fused" and role == "tlm":
            assert sum(v.startswith("MatMulNBits+") for _, v in first.values()) == n_matmuls


def test_mapped_and_heap_prepacked_give_the_same_tokens(plain_dir, mx_fused_dir, tmp_path):
    for art_dir in (plain_dir, mx_fused_dir):
        mapped = runtime.load_artifact(art_dir)
        heap = runtime.load_artifact(heap_prepacked_copy(art_dir, tmp_path / art_dir.parent.name), verify=False)
        for prompt in ([0, 40, 41], list(range(4, 30))):
            for spd in (False, True):
                kw = dict(max_new_tokens=20, speculative=spd)
                ours = runtime.generate(mapped, prompt, **kw).token_ids
                assert ours == runtime.generate(heap, prompt, **kw).token_ids


def test_prepacked_for_another_platform_is_refused_naming_both(artifact_dir, tmp_path, monkeypatch):
    here = platform_signature()
    monkeypatch.setattr(common.targets, "platform_signature", lambda: here | {"cpu_flags": "avx2 fma"})
    with pytest.raises(TargetUnavailableError, match=f"cpu_flags: artifact {here['cpu_flags']!r}, this machine "
                                                      "'avx2 fma'.*Re-run `python -m export`"):
        runtime.load_artifact(artifact_dir)
    monkeypatch.setattr(common.targets, "platform_signature", lambda: here | {"onnxruntime": "9.9.9"})
    with pytest.raises(TargetUnavailableError, match=f"onnxruntime: artifact '{here['onnxruntime']}', this "
                                                      "machine '9.9.9'"):
        runtime.load_artifact(artifact_dir)


@pytest.fixture(scope="module")
def mid_artifact(tmp_path_factory):
    """~14M parameters (56 MB fp32): big enough that a second copy of the weights shows in PSS."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=4096, bos_token_id=0, eos_token_id=1, pad_token_id=3)
    ck = tmp_path_factory.mktemp("mid") / "ck"
    AutoModelForCausalLM.from_config(config).save_pretrained(ck)
    byte_tokenizer().save_pretrained(ck)
    # the six graphs this bound was set for: no extra score graphs for prompt lookup, no lookahead graph
    # and ONNX Runtime's own MatMul, whose prepacked copies this measures
    recipe = replace(tiny_recipe(), dlm=None, prompt_lookup=PromptLookupSettings(max_draft=3),
                     lookahead=LookaheadSettings(ngram=2, window=1, guesses=1), batch_invariant=False)
    return build_artifact(recipe, ck.parent / "art", tlm=str(ck), progress=False)


def _memory(art_dir: Path, *flags: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", str(art_dir), *flags], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_three_graphs_hold_one_copy_of_the_weights(mid_artifact):
    """PSS growth after load + generate stays near one prepacked copy for all 6 graphs; per-session heap prepacking
    (the negative control) holds about one copy per graph, and the same bound catches it."""
    mapped, heap = _memory(mid_artifact), _memory(mid_artifact, "--heap-prepacked")
    assert mapped["graphs_per_model"] == {"tlm": 6}  # prefill, prefill_last, decode and three score graphs
    assert mapped["pss_growth_over_one_prepacked_copy"] < 1.25, mapped
    assert heap["pss_growth_over_one_prepacked_copy"] > 2.0, heap


def test_the_weights_mapping_pss_counts_the_pages_touched_in_weights_files_only(tmp_path):
    """benchmarks.memory --answers reports the weights files' share of PSS: the pages this process touched
    in a mapped weights.bin (4 MiB of 16), and nothing of another mapped file (the negative control)."""
    import mmap

    from benchmarks.memory import weights_mapping_pss_mib

    before = weights_mapping_pss_mib()
    maps = []
    for name in ("weights.bin", "other.bin"):
        path = tmp_path / name
        path.write_bytes(bytes(16 << 20))
        with path.open("rb") as f:
            maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        assert sum(maps[-1][i] for i in range(0, 4 << 20, 4096)) == 0  # touch every page of the first 4 MiB
    grown = weights_mapping_pss_mib() - before
    for m in maps:
        m.close()
    assert 3.9 < grown < 4.5, grown
