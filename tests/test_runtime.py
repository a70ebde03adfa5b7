"""The autoregressive runtime against transformers, and its handling of limits and bad input."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import runtime
from runtime.forest import Forest
from runtime.request import PromptTooLongError


@pytest.fixture(scope="module")
def art(artifact_dir):
    return runtime.load_artifact(artifact_dir)


@pytest.fixture(scope="module")
def hf_model(checkpoints):
    return AutoModelForCausalLM.from_pretrained(checkpoints["llama-gqa"], attn_implementation="eager").eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n, do_sample=False, pad_token_id=3,
        )
    return out[0, len(prompt):].tolist()


# prompt lengths around the prefill chunk (8): below, at, just past, several chunks
@pytest.mark.parametrize("length", [1, 7, 8, 9, 17, 30])
def test_greedy_matches_transformers_generate(art, hf_model, length):
    rng = np.random.default_rng(length)
    prompt = [0] + rng.integers(4, 260, length - 1).tolist() if length > 1 else [0]
    ours = runtime.generate(art, prompt, max_new_tokens=64, speculative=False)
    ref = hf_greedy(hf_model, prompt, 64)
    assert ours.token_ids == ref
    assert ours.finish_reason == ("eos" if ref[-1] == 1 else "length")
    assert len(ours.token_ids) == 64 or ours.finish_reason == "eos"


def test_codegen_artifact_greedy_matches_transformers_generate(checkpoints, tmp_path):
    """CodeGen (partial rotary, fused qkv) through export, compile and the runtime."""
    from dataclasses import replace

    from export.pipeline import build_artifact
    from tests.conftest import tiny_recipe

    recipe = replace(tiny_recipe(), dlm=None)
    cg = runtime.load_artifact(build_artifact(recipe, tmp_path / "cg", tlm=str(checkpoints["codegen"]),
                                              progress=False))
    model = AutoModelForCausalLM.from_pretrained(checkpoints["codegen"], attn_implementation="eager").eval()
    prompt = [0, 17, 99, 42, 8, 250, 31, 64, 5, 77, 12]
    assert runtime.generate(cg, prompt, max_new_tokens=40).token_ids == hf_greedy(model, prompt, 40)


def test_text_prompt_and_metrics(art):
    r = runtime.generate(art, "def f(x):\n", max_new_tokens=10, speculative=False)
    assert r.text == art.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    m = r.metrics
    assert m.prompt_tokens == len(art.tokenizer("def f(x):\n")["input_ids"])
    assert m.new_tokens == len(r.token_ids)
    assert m.ttft_s > 0 and m.total_s >= m.ttft_s and m.e2e_tokens_per_s > 0


def test_stream_yields_the_same_text(art):
    done = []
    pieces = list(runtime.stream(art, "abc", max_new_tokens=12, speculative=False, on_done=done.append))
    assert "".join(pieces) == done[0].text
    assert len(pieces) >= 2


def test_context_limit_ends_with_length(art):
    c = art.manifest.context_length
    prompt = [0] + [65] * (c - 11)
    r = runtime.generate(art, prompt, max_new_tokens=500, speculative=False)
    assert r.finish_reason in ("length", "eos")
    if r.finish_reason == "length":
        assert len(prompt) + len(r.token_ids) == c + 1  # every slot used, plus the final token


def test_the_recipes_max_prompt_length_is_enforced(checkpoints, tmp_path):
    from export.pipeline import build_artifact
    from tests.conftest import tiny_recipe

    short = runtime.load_artifact(build_artifact(tiny_recipe(dlm=None, max_prompt_length=10), tmp_path / "a",
                                                 tlm=str(checkpoints["llama-gqa"]), progress=False))
    assert len(runtime.generate(short, [0] * 10, max_new_tokens=2).token_ids) == 2
    with pytest.raises(PromptTooLongError, match="11 tokens but the recipe's max_prompt_length is 10"):
        runtime.generate(short, [0] * 11, max_new_tokens=2)


def test_prompt_too_long_is_a_clear_error(art):
    c = art.manifest.context_length
    with pytest.raises(PromptTooLongError, match="context length"):
        runtime.generate(art, [5] * c)
    with pytest.raises(ValueError, match="empty"):
        runtime.generate(art, [])
    with pytest.raises(ValueError, match="token ids"):
        runtime.generate(art, [5, 100000])


@pytest.mark.parametrize("kwargs, word", [
    (dict(do_sample=True, temperature=-1.0), "temperature"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
    (dict(do_sample=True, top_p=0.0), "top_p"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(do_sample=True, top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_bad_sampling_parameters(art, kwargs, word):
    with pytest.raises(ValueError, match=word):
        runtime.generate(art, "x", **kwargs)


def test_sampling_is_reproducible_with_a_seed(art):
    kw = dict(max_new_tokens=24, do_sample=True, temperature=1.3, top_k=50, top_p=0.95, speculative=False)
    a = runtime.generate(art, "import", seed=11, **kw)
    b = runtime.generate(art, "import", seed=11, **kw)
    c = runtime.generate(art, "import", seed=12, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string(art):
    full = runtime.generate(art, "a", max_new_tokens=20, speculative=False)
    stop = full.text[3:5]
    r = runtime.generate(art, "a", max_new_tokens=20, speculative=False, stop=[stop])
    assert r.finish_reason == "stop" and stop in r.text and len(r.token_ids) <= len(full.token_ids)


def test_trimmed_tokens_are_forgotten(art):
    """After a trim (rejected drafts), new tokens see exactly what they would have seen without the detour."""
    forest = Forest(art.tlm)
    branch, _ = forest.root(np.array([0, 70, 71, 72]))
    (straight,), (slots,) = forest.extend_rows([branch], [[80]], [1])
    straight = straight.copy()
    forest.trim(branch, slots)
    detour = forest.extend_rows([branch], [[90, 91, 92]], [3])[1][0]
    (seen,), (after,) = forest.extend_rows([branch], [[80]], [1])
    assert not np.array_equal(straight, seen)  # the control: untrimmed, the detour is seen
    forest.trim(branch, np.concatenate([detour, after]))
    (again,), _ = forest.extend_rows([branch], [[80]], [1])
    np.testing.assert_array_equal(straight, again)


def test_a_trim_keeps_the_other_tokens_in_order(art):
    """Rejected rows may lie between kept ones (a token tree's siblings, lookahead's window): the branch's
    order loses just those slots, the rest in place."""
    forest = Forest(art.tlm)
    branch, _ = forest.root(np.array([0, 70, 71]))
    _, (slots,) = forest.extend_rows([branch], [[80, 81, 82, 83, 84]], [1])
    before, gone = list(branch.order), slots[[1, 3]]
    forest.trim(branch, gone)
    assert branch.order == [s for s in before if s not in gone.tolist()] and branch.length == len(before) - 2


def test_sessions_spin_within_a_call_only(art):
    """Idle spinning pools steal the cores from the next session's call; pools that never spin wake
    their threads op by op (docs/benchmarks.md)."""
    for runner in (art.tlm, art.dlm):
        for g in runner.graphs.values():
            options = g.session.get_session_options()
            assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
            assert options.get_session_config_entry("session.force_spinning_stop") == "1"


def test_a_load_leaves_no_pool_thread_spinning(artifact_dir):
    """A new pool's threads spin before their first sleep; a load waits until they sleep, or its
    first calls would share the cores with a dozen spinning threads (common.targets.parked_pools)."""
    time.sleep(0.05)  # earlier tests' threads settle
    art = runtime.load_artifact(artifact_dir)  # noqa: F841 - kept alive: its sessions own the pools
    cpu = time.process_time()
    time.sleep(0.1)
    assert time.process_time() - cpu < 0.03  # 0.2 s of CPU when the load does not wait
