"""The real-size benchmark's like-for-like input: a checkpoint's own weights as the F16 GGUF llama.cpp runs.

transformers' GGUF loader (which undoes llama.cpp's Q/K row order itself) must read back exactly the
float16-rounded checkpoint; where llama-cpp-python is installed (the `peers` extra), llama.cpp's greedy
tokens must equal transformers' and the benchmark's --checkpoint mode must report every system.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks import gguf_writer
from benchmarks.gguf_writer import UnsupportedCheckpointError, write_f16_gguf
from tests.conftest import save_checkpoint

IDS = [5, 17, 200, 43, 99, 12, 7, 64]


def float16_model(checkpoint):
    """transformers' model of the checkpoint with every weight rounded to float16, as the GGUF stores it
    (the norms too: they are 1 here, exact either way)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def gguf_logits(path) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].numpy()


def peaked_attention_checkpoint(kind: str, path):
    """A tiny checkpoint whose attention weights its keys unevenly (Q and K x8), so rows out of order show."""
    ck = save_checkpoint(kind, path)
    model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(ck)
    return ck


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-tied"])
def test_f16_gguf_holds_the_checkpoint_in_llamacpp_order(tmp_path, kind, monkeypatch):
    ck = peaked_attention_checkpoint(kind, tmp_path / kind)
    with torch.no_grad():
        ref = float16_model(ck)(torch.tensor([IDS])).logits[0].numpy()
    ours = gguf_logits(write_f16_gguf(ck, tmp_path / "f16.gguf", progress=False))
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max(), rtol=1e-4)
    # negative control: Q and K in transformers' own row order are read back scrambled
    monkeypatch.setattr(gguf_writer, "permute", lambda w, heads: w)
    scrambled = gguf_logits(write_f16_gguf(ck, tmp_path / "unpermuted.gguf", progress=False))
    assert np.abs(scrambled - ref).max() > max(1e-2 * np.abs(ref).max(), 20 * np.abs(ours - ref).max())


def test_a_checkpoint_llamacpp_cannot_hold_is_refused_by_name(tmp_path):
    ck = save_checkpoint("codegen", tmp_path / "codegen")
    with pytest.raises(UnsupportedCheckpointError, match="model_type 'codegen' is not a Llama-family"):
        write_f16_gguf(ck, tmp_path / "x.gguf", progress=False)
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written


def test_llamacpp_greedy_tokens_equal_transformers(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the benchmark-only `peers` extra")
    from benchmarks.peers import LlamaCpp

    ck = save_checkpoint("llama-gqa", tmp_path / "ck")
    path = write_f16_gguf(ck, tmp_path / "f16.gguf", progress=False)
    _, _, tokens = LlamaCpp(path, threads=1, context=64).generate(IDS, 12)
    model, ids = float16_model(ck), list(IDS)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert tokens == ids[len(IDS):], llama_cpp.__version__


def test_checkpoint_mode_reports_each_system_against_the_reference(tmp_path, capsys, monkeypatch):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the benchmark-only `peers` extra")
    from benchmarks import vs_llamacpp

    monkeypatch.setenv("MXSPD_CACHE", str(tmp_path / "cache"))
    ck = save_checkpoint("llama-gqa", tmp_path / "ck")
    monkeypatch.setattr("sys.argv", ["vs_llamacpp", "--checkpoint", str(ck), "--formats", "F16,Q8_0,Q6_K",
                                     "--engines", "mxfp6", "--prompt-tokens", "16", "--new-tokens", "8",
                                     "--repeats", "1", "--no-pss"])
    vs_llamacpp.main()
    report = json.loads(capsys.readouterr().out)
    assert set(report["systems"]) == {"llama.cpp:F16", "llama.cpp:Q8_0", "llama.cpp:Q6_K", "ours:mxfp6"}
    ours = report["systems"]["ours:mxfp6"]
    assert ours["vs_llama.cpp_Q6_K"] > 0 and ours["prefill_vs_llama.cpp_Q6_K"] > 0 and ours["generated"] == 8
    assert ours["compared_with"] is None and report["prompt_tokens"] == [16]


def test_a_llamacpp_file_s_bits_per_weight_count_the_matrices_a_token_reads(tmp_path, monkeypatch):
    """An F16 GGUF: 16 bits per matrix weight (the 1-D norms left out), its token table not streamed beside an
    output matrix; the same file without output.weight ties its head to the table, which is then read whole.
    A recipe's model with float weights is llama.cpp's source as an F16 GGUF written once, in the cache."""
    import gguf

    from benchmarks import peers

    monkeypatch.setenv("MXSPD_CACHE", str(tmp_path / "cache"))
    ck = save_checkpoint("llama-gqa", tmp_path / "ck")
    path = peers.llama_source(str(ck))
    assert path.parent == tmp_path / "cache" / "bench" / "gguf" and peers.llama_source(str(ck)) == path
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    assert peers.matrix_bits(path) == 16.0
    assert peers.streamed_bytes(path) == sum(tensors.values()) - tensors["token_embd.weight"]
    reader, tied = gguf.GGUFReader(path), tmp_path / "tied.gguf"
    writer = gguf.GGUFWriter(tied, "llama")
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name != "output.weight":
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert peers.streamed_bytes(tied) == sum(tensors.values()) - tensors["output.weight"]
    assert peers.matrix_bits(tied) == 16.0
