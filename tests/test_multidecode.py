"""MultiDecode: a forest of branches over one KV cache (parallel sampling, beam search, questions)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import runtime
from benchmarks.chain import Chain
from common.recipe import ModelSpec
from export.pipeline import build_artifact
from recipes import get_recipe
from recipes.builtin import builtin_model_dir
from runtime.forest import CapacityError, Forest
from runtime.model_runner import ModelRunner
from tests.conftest import tiny_recipe

PROMPT = [0, 5, 6, 7, 100, 120]


def _build(tmp_path_factory, name, recipe, **paths):
    return runtime.load_artifact(build_artifact(recipe, tmp_path_factory.mktemp(name) / "art", progress=False,
                                                **paths))


@pytest.fixture(scope="module")
def art(checkpoints, tmp_path_factory):
    """fp32 GQA TLM only, with room for many branches."""
    return _build(tmp_path_factory, "md", tiny_recipe(dlm=None, context_length=160), tlm=str(checkpoints["llama-gqa"]))


@pytest.fixture(scope="module")
def mx(checkpoints, tmp_path_factory):
    """The GQA TLM in MXFP6 E2M3, both lowerings: exact (float32 kernels) and fused (MatMulNBits)."""
    tlm = str(checkpoints["llama-gqa"])
    recipe = tiny_recipe(dlm=None, context_length=160)
    return {lowering: _build(tmp_path_factory, f"md-{lowering}", replace(
        recipe, tlm=ModelSpec(model=tlm, mx_format="fp6_e2m3", mx_lowering=lowering)), tlm=tlm)
        for lowering in ("exact", "fused")}


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory):
    """The shipped default TLM: fp32, and MXFP6 as its recipe quantizes it (fused)."""
    recipe = replace(get_recipe("tiny-stdlib-spd"), dlm=None, speculative=False, context_length=256)
    return {"fp32": _build(tmp_path_factory, "dp32", replace(recipe, tlm=replace(recipe.tlm, mx_format=None))),
            "mxfp6": _build(tmp_path_factory, "dpmx", recipe)}


@pytest.fixture
def no_eos(art):
    saved = art.eos_token_ids
    art.eos_token_ids = frozenset()
    yield art
    art.eos_token_ids = saved


def _single(art, prompt, **kw):
    return runtime.generate(art, prompt, speculative=False, **kw)


def _chain(runner: ModelRunner, tokens: list[int]) -> np.ndarray:
    return Chain(runner).prefill(np.array(tokens)).copy()


@pytest.mark.parametrize("max_rows", [None, 3])
def test_every_branch_equals_a_chain_forward_under_churn(art, max_rows):
    """Forks, releases and uneven extensions for many steps; slots are reused; after every step each
    extended branch's logits equal a plain chain forward of that branch's own tokens."""
    rng = np.random.default_rng(1)
    ref = ModelRunner(art.path, art.manifest.models["tlm"], art.manifest.capacity)
    forest = Forest(art.tlm, max_rows=max_rows)
    root, _ = forest.root(np.array(PROMPT))
    tokens = {id(root): list(PROMPT)}
    nodes = {id(root): list(range(len(PROMPT)))}  # one id per token written: what the cache must keep
    branches, written = [root], 0
    for _ in range(200):
        if len(branches) < 6 and rng.random() < 0.5:
            parent = branches[rng.integers(len(branches))]
            child = forest.fork(parent)
            tokens[id(child)], nodes[id(child)] = list(tokens[id(parent)]), list(nodes[id(parent)])
            branches.append(child)
        old = [b for b in branches if b.length > 30] + ([branches[0]] if len(branches) > 3 else [])
        for b in {id(b): b for b in old}.values():
            forest.release(b)
            branches.remove(b)
        if not branches:  # a fresh sequence from an empty cache view
            b = forest.attach([])
            tokens[id(b)], nodes[id(b)] = [], []
            branches.append(b)
        chosen = [b for b in branches if rng.random() < 0.7] or branches[:1]
        chains = [rng.integers(4, 250, rng.integers(1, 4)).tolist() for _ in chosen]
        logits = forest.extend(chosen, chains)
        for b, chain, row in zip(chosen, chains, logits, strict=True):
            tokens[id(b)] += chain
            nodes[id(b)] += list(range(len(PROMPT) + written, len(PROMPT) + written + len(chain)))
            written += len(chain)
            assert b.length == len(tokens[id(b)])
            np.testing.assert_allclose(row, _chain(ref, tokens[id(b)]), atol=2e-4, rtol=1e-4)
        kept = {n for b in branches for n in nodes[id(b)]}  # shared prefixes once, released branches' own gone
        assert forest.free_slots() == art.manifest.context_length - len(kept)
    assert written > 3 * art.manifest.context_length  # slots were freed and reused many times over


def _eos_set(art, prompt, seeds, n_new, **kw):
    """Tokens that end the single runs of these seeds at different lengths."""
    art.eos_token_ids = frozenset()
    runs = [_single(art, prompt, do_sample=True, seed=s, max_new_tokens=n_new, **kw).token_ids for s in seeds]
    return frozenset({runs[0][3], runs[1][7]})


@pytest.mark.parametrize("which", ["fp32", "mx-exact", "default-fp32"])
def test_parallel_branch_i_equals_a_single_run_with_seed_plus_i(art, mx, default_pair, which, fewest_calls):
    target = {"fp32": art, "mx-exact": mx["exact"], "default-fp32": default_pair["fp32"]}[which]
    prompt = PROMPT if which != "default-fp32" else target.tokenizer("def binary_search(items, target):\n")["input_ids"]
    saved = target.eos_token_ids
    try:
        for kw in (dict(), dict(temperature=0.7, top_k=20), dict(top_p=0.9)):
            target.eos_token_ids = _eos_set(target, prompt, [7, 8], 30, **kw)  # branches end at different steps
            r = runtime.generate(target, prompt, n=4, do_sample=True, seed=7, max_new_tokens=30, **kw)
            assert r.seeds == [7, 8, 9, 10]
            for i, b in enumerate(r.branches):
                alone = _single(target, prompt, do_sample=True, seed=7 + i, max_new_tokens=30, **kw)
                assert (b.token_ids, b.finish_reason) == (alone.token_ids, alone.finish_reason), (i, kw)
            assert len({b.finish_reason for b in r.branches}) > 1 or len({len(b.token_ids) for b in r.branches}) > 1
            prefill_calls = len(target.tlm.plan(len(prompt)))  # MultiDecode starts cold
            assert r.metrics.tlm_calls == prefill_calls + r.metrics.steps  # one call per step for all branches
            assert r.metrics.steps == max(len(b.token_ids) for b in r.branches) - 1
    finally:
        target.eos_token_ids = saved


def test_more_branches_than_the_largest_graph_are_split_into_several_calls_per_step(no_eos, fewest_calls):
    art = no_eos
    largest = max(g.tokens for g in art.tlm.graphs.values())
    n = largest + 3
    r = runtime.generate(art, PROMPT, n=n, do_sample=True, seed=3, max_new_tokens=5)
    assert r.metrics.tlm_calls == 1 + r.metrics.steps * 2
    for i in (0, n - 1):
        assert r.branches[i].token_ids == _single(art, PROMPT, do_sample=True, seed=3 + i, max_new_tokens=5).token_ids


def test_stream_branches_yields_each_branch_text(no_eos):
    done = []
    pieces = list(runtime.stream_branches(no_eos, PROMPT, 3, on_done=done.append, do_sample=True, seed=1,
                                          max_new_tokens=12))
    texts = ["".join(p for i, p in pieces if i == b) for b in range(3)]
    assert texts == [b.text for b in done[0].branches]
    assert {i for i, _ in pieces} == {0, 1, 2}


@pytest.mark.parametrize("which", ["fp32", "mx-exact"])
def test_questions_over_one_context_equal_separate_runs(art, mx, which):
    target = art if which == "fp32" else mx["exact"]
    context = [0, *range(40, 60)]
    questions = [[70, 71, 72], [80, 81], [90], list(range(200, 211))]  # the last spans two prefill chunks
    r = runtime.generate_multi(target, context, questions, max_new_tokens=20)
    for q, b in zip(questions, r.branches, strict=True):
        alone = _single(target, context + q, max_new_tokens=20)
        assert (b.token_ids, b.finish_reason) == (alone.token_ids, alone.finish_reason)
    assert r.metrics.prompt_tokens == len(context) + sum(map(len, questions))
    unrelated = [[0, 9, 8, 7], [0, 50], [0, *range(100, 115)]]
    r = runtime.generate_multi(target, None, unrelated, max_new_tokens=20)
    for p, b in zip(unrelated, r.branches, strict=True):
        assert b.token_ids == _single(target, p, max_new_tokens=20).token_ids


def test_text_questions_on_the_default_pair_equal_separate_runs(default_pair):
    target = default_pair["fp32"]
    tok = target.tokenizer
    context = "import os\n\ndef list_python_files(root):\n"
    questions = ['    """Return', "    for name in", "    paths = []\n"]
    r = runtime.generate_multi(target, context, questions, max_new_tokens=24)
    for q, b in zip(questions, r.branches, strict=True):
        ids = tok(context)["input_ids"] + tok(q, add_special_tokens=False)["input_ids"]
        assert b.token_ids == _single(target, ids, max_new_tokens=24).token_ids


def test_fused_mx_branches_match_chain_forwards_within_the_kernels_noise(mx, default_pair):
    """MatMulNBits quantizes activations to int8 per block, so a different summation order in
    attention (a branch's slots are not contiguous) can move a logit by a few hundredths: branch logits stay
    within that of a chain forward, and greedy answers differ from single runs only at near-ties."""
    for target in (mx["fused"], default_pair["mxfp6"]):
        ref = ModelRunner(target.path, target.manifest.models["tlm"], target.manifest.capacity)
        forest = Forest(target.tlm)
        root, _ = forest.root(np.array(PROMPT))
        branches = [forest.fork(root) for _ in range(4)]
        seqs = [list(PROMPT) for _ in branches]
        rng = np.random.default_rng(0)
        for _ in range(20):
            chains = [[int(t)] for t in rng.integers(4, 250, 4)]
            rows = forest.extend(branches, chains)
            for s, c, row in zip(seqs, chains, rows, strict=True):
                s += c
                np.testing.assert_allclose(row, _chain(ref, s), atol=0.1)
        context, questions = [0, *range(40, 60)], [[70, 71, 72], [80, 81], [90]]
        r = runtime.generate_multi(target, context, questions, max_new_tokens=20)
        for q, b in zip(questions, r.branches, strict=True):
            alone = _single(target, context + q, max_new_tokens=20).token_ids
            if b.token_ids != alone:
                first = next(i for i, (x, y) in enumerate(zip(b.token_ids, alone, strict=False)) if x != y)
                top2 = np.sort(_chain(ref, context + q + alone[:first]))[-2:]
                assert top2[1] - top2[0] < 0.1, "a divergence away from a near-tie"


def _hf(path):
    """transformers' float32 reference (transformers 5 loads a checkpoint in its stored dtype, and the
    shipped default pair is float16: a float16 reference flipped a near-tie between beams)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _hf_beams(model, prompt, **kw):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=3, **kw)
    return out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()


BEAMS = [dict(num_beams=4, max_new_tokens=12), dict(num_beams=3, max_new_tokens=25, length_penalty=0.5),
         dict(num_beams=2, max_new_tokens=15, length_penalty=2.0, early_stopping="never"),
         dict(num_beams=5, max_new_tokens=20, early_stopping=True, num_return_sequences=3),
         dict(num_beams=4, max_new_tokens=38, length_penalty=-1.0, num_return_sequences=4)]


def _assert_beams_equal(art, model, prompt, kw):
    ref, ref_scores = _hf_beams(model, prompt, **kw)
    r = runtime.beam_search(art, prompt, **kw)
    assert len(r.sequences) == len(ref) == kw.get("num_return_sequences", 1)
    for s, row in zip(r.sequences, ref, strict=True):
        assert s.token_ids + [3] * (len(row) - len(s.token_ids)) == row
    # Scores are sums of up to 40 log-probabilities from two float32 engines whose kernels accumulate
    # in other orders, CPU by CPU (an AVX-512 Xeon: -1761.3358 vs -1761.3362): the tolerance follows
    # the score's magnitude. The tokens above are compared exactly.
    np.testing.assert_allclose([s.score for s in r.sequences], ref_scores, rtol=2e-6, atol=1e-4)
    return r


@pytest.mark.parametrize("kw", BEAMS)
def test_beam_search_equals_transformers(art, checkpoints, kw, fewest_calls):
    model, saved = _hf(checkpoints["llama-gqa"]), art.eos_token_ids
    try:
        art.eos_token_ids = frozenset()
        no_eos = _assert_beams_equal(art, model, PROMPT, kw)
        assert no_eos.metrics.tlm_calls == 1 + no_eos.metrics.steps  # all beams in one call per step
        best = no_eos.sequences[0].token_ids
        for eos in (best[2], best[len(best) // 2]):  # EOS inside the horizon: hypotheses finish early
            art.eos_token_ids = frozenset({eos})
            model.generation_config.eos_token_id = eos
            _assert_beams_equal(art, model, PROMPT, kw)
    finally:
        art.eos_token_ids = saved


def test_beam_search_with_two_eos_ids_keeps_three_candidates_per_beam(art, checkpoints):
    model, saved = _hf(checkpoints["llama-gqa"]), art.eos_token_ids
    try:
        art.eos_token_ids = frozenset()
        best = runtime.beam_search(art, PROMPT, num_beams=3, max_new_tokens=20).sequences[0].token_ids
        eos = sorted({best[3], best[9]})
        art.eos_token_ids, model.generation_config.eos_token_id = frozenset(eos), eos
        r = _assert_beams_equal(art, model, PROMPT, dict(num_beams=3, max_new_tokens=20, num_return_sequences=3))
        assert any(s.finish_reason == "eos" for s in r.sequences)
    finally:
        art.eos_token_ids = saved


def test_stop_strings_and_sampled_questions_follow_the_single_runs(no_eos):
    art = no_eos
    text = _single(art, PROMPT, do_sample=True, seed=21, max_new_tokens=30).text
    stop = text[len(text) // 2]  # one character that the seed-21 branch produces mid-way
    r = runtime.generate(art, PROMPT, n=3, do_sample=True, seed=20, max_new_tokens=30, stop=[stop])
    assert r.branches[1].finish_reason == "stop"
    for i, b in enumerate(r.branches):
        alone = _single(art, PROMPT, do_sample=True, seed=20 + i, max_new_tokens=30, stop=[stop])
        assert (b.token_ids, b.finish_reason) == (alone.token_ids, alone.finish_reason)
    context, questions = [0, *range(40, 50)], [[70, 71], [80]]
    m = runtime.generate_multi(art, context, questions, max_new_tokens=15, do_sample=True, seed=5, top_k=30)
    for i, (q, b) in enumerate(zip(questions, m.branches, strict=True)):
        alone = _single(art, context + q, do_sample=True, seed=5 + i, top_k=30, max_new_tokens=15)
        assert b.token_ids == alone.token_ids


def test_forest_misuse_is_refused(art):
    forest = Forest(art.tlm)
    root, _ = forest.root(np.array(PROMPT))
    child = forest.fork(root)
    with pytest.raises(ValueError, match="distinct, live"):
        forest.extend([child, child], [[5], [6]])
    forest.release(child)
    with pytest.raises(ValueError, match="distinct, live"):
        forest.extend([child], [[5]])
    with pytest.raises(ValueError, match="rows per call"):
        Forest(art.tlm, max_rows=999)


def test_a_root_beside_live_branches_takes_free_slots_and_gives_a_chain_forwards_logits(art):
    """A prompt rooted while other branches live goes into free slots (theirs stay theirs) and gets the
    logits a plain chain forward gives; a root whose prefill fails leaves no branch behind."""
    forest, prompt = Forest(art.tlm), np.array(PROMPT[::-1])
    other, _ = forest.root(np.array(PROMPT))
    branch, logits = forest.root(prompt)
    assert not set(branch.order) & set(other.order) and len(branch.order) == len(prompt)
    ref = ModelRunner(art.path, art.manifest.models["tlm"], art.manifest.capacity)
    np.testing.assert_allclose(logits, _chain(ref, list(prompt)), atol=2e-4, rtol=1e-4)
    with pytest.raises(CapacityError):
        forest.root(np.zeros(art.manifest.capacity, np.int64))
    assert forest.live == [other, branch]


def test_beam_search_on_the_default_pair_equals_transformers(default_pair):
    target = default_pair["fp32"]
    model = _hf(builtin_model_dir("stdlib-tlm"))
    model.generation_config.eos_token_id = sorted(target.eos_token_ids)
    prompt = target.tokenizer("class Stack:\n    def __init__(self):\n        self.")["input_ids"]
    _assert_beams_equal(target, model, prompt, dict(num_beams=4, max_new_tokens=30))


def test_beam_search_with_mx_runs_and_shares_prefixes(mx, fewest_calls):
    for target in mx.values():
        fp = runtime.beam_search(target, PROMPT, num_beams=4, max_new_tokens=30, num_return_sequences=4)
        assert len(fp.sequences) == 4 and fp.metrics.tlm_calls == 1 + fp.metrics.steps
        scores = [s.score for s in fp.sequences]
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("call, word", [
    (lambda a: runtime.generate(a, PROMPT, n=0, do_sample=True), "n must be >= 1"),
    (lambda a: runtime.generate(a, PROMPT, n=1.5, do_sample=True), "n must be an integer"),
    (lambda a: runtime.generate(a, PROMPT, n=3), "do_sample=True"),
    (lambda a: runtime.generate(a, PROMPT, n=2, do_sample=True, speculative="lookahead"), "speculative"),
    (lambda a: runtime.generate(a, PROMPT, n=4, do_sample=True, max_new_tokens=40),
     r"6 prompt tokens \+ 4 branches x 39 new tokens = 162 cache slots, but the cache holds 160"),
    (lambda a: runtime.beam_search(a, PROMPT, num_beams=0), "num_beams must be >= 1"),
    (lambda a: runtime.beam_search(a, PROMPT, num_beams=2, num_return_sequences=3), "cannot exceed num_beams"),
    (lambda a: runtime.beam_search(a, PROMPT, num_beams=2, length_penalty=float("nan")), "length_penalty"),
    (lambda a: runtime.beam_search(a, PROMPT, num_beams=2, early_stopping="soon"), "early_stopping"),
    (lambda a: runtime.beam_search(a, PROMPT, num_beams=8, max_new_tokens=21), r"8 beams x 20 new tokens = 166"),
    (lambda a: runtime.generate_multi(a, PROMPT, [], max_new_tokens=4), "questions is empty"),
    (lambda a: runtime.generate_multi(a, PROMPT, "why?", max_new_tokens=4), "list of strings"),
    (lambda a: runtime.generate_multi(a, PROMPT, [[5], []], max_new_tokens=4), "question 1 is empty"),
    (lambda a: runtime.generate_multi(a, PROMPT, [[5], [9999]], max_new_tokens=4), r"\[0, 260\)"),
    (lambda a: runtime.generate_multi(a, PROMPT, [[5]] * 8, max_new_tokens=20), "8 questions"),
    (lambda a: runtime.generate_multi(a, PROMPT, [b"ab"], max_new_tokens=4), "string or a sequence of token ids"),
    (lambda a: runtime.generate_multi(a, PROMPT, [5], max_new_tokens=4), "string or a sequence of token ids"),
    (lambda a: runtime.beam_search(a, PROMPT, num_beams=2, rows_per_call=999), "rows per call"),
])
def test_bad_requests_are_refused_before_any_work(art, call, word):
    calls = art.tlm.calls
    with pytest.raises((ValueError, TypeError), match=word):
        call(art)
    assert art.tlm.calls == calls


def test_capacity_error_is_a_value_error_naming_the_numbers(art):
    with pytest.raises(CapacityError, match="kv_slots"):
        runtime.generate(art, PROMPT, n=16, do_sample=True, max_new_tokens=20)


def test_cli_runs_parallel_sampling_beams_and_questions(no_eos, capsys):
    from runtime.__main__ import main

    path = str(no_eos.path)
    assert main([path, "--prompt", "ab", "--n", "3", "--sample", "--seed", "4", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "branch 2 | seed 6" in out and "3 TLM calls" not in out and "18 tokens in 5 steps, 6 TLM calls" in out
    alone = _single(no_eos, "ab", do_sample=True, seed=6, max_new_tokens=6).text
    assert f"=== branch 2 | seed 6 | length | 6 tokens ===\nab{alone}\n" in out
    assert main([path, "--prompt", "ab", "--beams", "3", "--num-return", "2", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "=== beam 1 | score" in out and "=== beam 2" not in out
    assert main([path, "--prompt", "ab", "--question", "c", "--question", "de", "--max-new-tokens", "4"]) == 0
    assert "=== question 1 | length | 4 tokens ===\nabde" in capsys.readouterr().out
    assert main([path, "--prompt", "ab", "--n", "2", "--beams", "2"]) == 2
    assert "choose one of" in capsys.readouterr().err
    assert main([path, "--prompt", "ab", "--n", "2"]) == 2
    assert "do_sample=True" in capsys.readouterr().err
    assert main([path, "--prompt", "ab", "--beams", "2", "--sample"]) == 2
    assert "deterministic" in capsys.readouterr().err
    assert main([path, "--prompt", "ab", "--question", "c", "--window", "3"]) == 2
    assert "without speculation" in capsys.readouterr().err
    assert main([path, "--prompt", "ab", "--num-return", "2"]) == 2
    assert "apply to --beams only" in capsys.readouterr().err
