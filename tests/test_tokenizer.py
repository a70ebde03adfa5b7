"""The runtime's tokenizer (tokenizers + Jinja only) gives transformers' results; the runtime imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from recipes.builtin import builtin_model_dir
from recipes.default_pair import byte_tokenizer
from runtime.tokenizer import Tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "Grüße, naïve café — ✓ 漢字", "  spaces   and\ttabs\n\n", "a", "</s>x<s>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(params=["default-pair", "byte"])
def pair(request, tmp_path):
    if request.param == "default-pair":
        folder = builtin_model_dir("stdlib-tlm")
    else:
        folder = tmp_path / "byte"
        byte_tokenizer().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder), Tokenizer(folder)


def test_encode_decode_and_eos_equal_transformers(pair):
    hf, ours = pair
    assert ours.eos_token_id == hf.eos_token_id
    for text in TEXTS:
        for special in (True, False):
            ids = hf(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_clean_up_tokenization_spaces_changes_nothing_as_in_transformers(pair, tmp_path):
    hf, _ = pair
    hf.clean_up_tokenization_spaces = True
    hf.save_pretrained(tmp_path / "clean")
    hf, ours = AutoTokenizer.from_pretrained(tmp_path / "clean"), Tokenizer(tmp_path / "clean")
    for text in ("a , b . c ? d ! e ' f n't g 'm h 's i 've j 're", "x ."):
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids)


def test_chat_template_renders_as_transformers(pair):
    hf, ours = pair
    hf.chat_template = ours.chat_template = TEMPLATE
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Sum 2 and 3?"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == list(
            hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False))


def test_a_template_may_raise_and_a_missing_template_is_clear(pair):
    _, ours = pair
    ours.chat_template = "{{ raise_exception('only user messages') }}"
    with pytest.raises(Exception, match="only user messages"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])
    ours.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="return_dict"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], return_dict=True)


def test_the_runtime_and_the_server_import_neither_torch_nor_transformers():
    code = ("import sys, runtime, serve.app, runtime.__main__; "
            "print(sorted(m for m in ('torch', 'transformers', 'onnx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _llama_like(tmp_path):
    """A SentencePiece-style tokenizer as Llama's: Metaspace pieces, byte fallback, one leading space stripped."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "▁the", "▁a", "é", "ab", "▁ab", "c", "▁c", "d", "\u2581\u00e9"]:
        vocab.setdefault(piece, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return Tokenizer(tmp_path)


@pytest.mark.parametrize("kind", ["default-pair", "byte-level-bpe", "llama-like"])
def test_text_pieces_equal_the_whole_decode_at_every_token(kind, tmp_path):
    """Windowed decoding (O(1) per token) shows exactly the full decode whenever that is whole
    characters, never retracts from valid text, and the rest completes it."""
    import numpy as np

    from benchmarks.make_checkpoint import write_tokenizer
    from runtime.results import TextPieces

    if kind == "default-pair":
        tok = Tokenizer(builtin_model_dir("stdlib-tlm"))
    elif kind == "byte-level-bpe":
        write_tokenizer(tmp_path, 400, "<s>", "</s>", None)
        tok = Tokenizer(tmp_path)
    else:
        tok = _llama_like(tmp_path)
    vocab = tok.backend.get_vocab_size()
    rng = np.random.default_rng(0)
    words = ["a", " the", " ab", "c", " d", "é", "€", "😀", " ", "x"]
    for _ in range(60):
        ids, pieces = [], TextPieces(tok)
        if kind == "llama-like":  # byte fallback invalidates a whole run of bytes, so no random bytes: real text
            sample = tok("".join(rng.choice(words, size=int(rng.integers(1, 20)))), add_special_tokens=False)
        else:  # random ids, broken UTF-8 included
            sample = {"input_ids": rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist()}
        final = tok.decode(sample["input_ids"], skip_special_tokens=True)
        for token in sample["input_ids"]:
            ids.append(token)
            pieces.add(token)
            full = tok.decode(ids, skip_special_tokens=True)
            if "\ufffd" not in full:  # (byte fallback shows a split character's whole run as U+FFFD meanwhile)
                assert pieces.shown == full
            if "\ufffd" not in final:
                assert final.startswith(pieces.shown)  # never retracted
        assert pieces.shown + pieces.rest(final) == final
