"""The distilled draft model: trained toward its teacher reproducibly, and agreeing with the shipped TLM
more often than the independently trained shipped DLM it starts from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from recipes.builtin import builtin_model_dir
from recipes.default_pair import encode_files, stdlib_files
from recipes.distill import DISTILLED, agreement, distill, kl_to_teacher


def tiny_llama(seed: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_distillation_moves_the_student_toward_the_teacher_deterministically():
    teacher = tiny_llama(0, 3)
    stream = np.random.default_rng(1).integers(0, 64, 4000)
    hp = dict(seed=3, steps=40, batch=4, seq_len=32, lr=3e-3, warmup=5)
    held = torch.from_numpy(np.random.default_rng(2).integers(0, 64, (4, 32)))
    with torch.no_grad():
        before = kl_to_teacher(tiny_llama(5, 1), teacher, held).item()
    a, b = (distill(teacher, tiny_llama(5, 1), stream, hp, progress=False) for _ in range(2))
    with torch.no_grad():
        after = kl_to_teacher(a, teacher, held).item()
    assert after < 0.8 * before, (before, after)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("name", sorted(DISTILLED))
def test_shipped_distilled_dlm_agrees_with_its_tlm_more_often(name):
    """Held-out modules, teacher-forced: the distilled DLM's argmax is the TLM's clearly more often than
    the shipped DLM's (measured 0.50 for the shipped DLM, 0.6 or more distilled)."""
    teacher_dir = builtin_model_dir(DISTILLED[name]["teacher"])
    tok = PreTrainedTokenizerFast.from_pretrained(teacher_dir)
    held = encode_files(tok, stdlib_files("heldout"))
    load = lambda d: LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    tlm = load(teacher_dir)
    plain = agreement(tlm, load(builtin_model_dir("stdlib-dlm")), held, tokens=20_000)
    distilled = agreement(tlm, load(builtin_model_dir(name)), held, tokens=20_000)
    assert distilled > plain + 0.05, (plain, distilled)
