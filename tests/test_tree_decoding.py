"""The token-tree runtime and the draft-free methods (prompt lookup, lookahead decoding)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import runtime
import runtime.rejection as rejection_module
from benchmarks.chain import Chain
from common import graph_io
from common.recipe import LookaheadSettings
from export.pipeline import build_artifact
from recipes.default_pair import byte_tokenizer
from runtime.draft_policy import DraftPolicy
from runtime.engine import engine_of
from runtime.lookahead import Lookahead, window_sees
from runtime.model_runner import ModelRunner
from tests.conftest import tiny_recipe
from tests.test_speculative import V, emitted_counts, exact_marginals, min_p_value

METHODS = {  # settings a user may pick at run time; all fit the artifact's largest graph (T = 13)
    "lookahead": [dict(adaptive=False), dict(ngram=4, window=2, guesses=2, adaptive=False),
                  dict(ngram=2, window=5, guesses=4, adaptive=False), {}],
    "prompt_lookup": [dict(adaptive=False), dict(ngram=1, max_draft=3, adaptive=False), {}],
}


@pytest.fixture(scope="module")
def tlm_only(checkpoints, tmp_path_factory):
    """A TLM-only artifact (no draft model) whose recipe speculates by lookahead."""
    recipe = tiny_recipe(dlm=None, context_length=64, speculative=True, speculation="lookahead")
    path = build_artifact(recipe, tmp_path_factory.mktemp("la") / "art", tlm=str(checkpoints["llama-gqa"]),
                          progress=False)
    return runtime.load_artifact(path)


@pytest.fixture(scope="module")
def hf(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama-gqa"]).eval()
    model.generation_config.eos_token_id = None  # the runtime's EOS is tested separately
    return model


def chain_logits(art, tokens: list[int]) -> np.ndarray:
    """Logits of the last token of `tokens`, by a plain chain forward from an empty cache."""
    return Chain(ModelRunner(art.path, art.manifest.models["tlm"], art.manifest.capacity)).prefill(np.array(tokens))


def test_tree_rows_equal_chain_forwards_also_after_committing_non_leading_rows(tlm_only):
    art, rng = tlm_only, np.random.default_rng(0)
    tlm = Chain(art.tlm)
    committed = [0, *rng.integers(4, 250, 10).tolist()]
    tlm.prefill(np.array(committed[:-1]))
    for _ in range(3):
        # a random tree under the root, then a lookahead-style window that sees the root only
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, 7)])
        levels, width = 2, 3
        sees = np.zeros((7 + levels * width,) * 2, bool)
        sees[:7, :7] = graph_io.tree_sees(parents)
        sees[7:, 0] = True
        sees[7:, 7:] = window_sees(levels, width)
        tokens = np.array([committed[-1], *rng.integers(4, 250, len(sees) - 1)])
        logits = tlm.run(art.tlm.graph_for(len(tokens)), tokens, sees).copy()
        for row in range(len(tokens)):
            seen = np.flatnonzero(sees[row])  # a chain, in position order
            np.testing.assert_allclose(logits[row], chain_logits(art, committed[:-1] + tokens[seen].tolist()),
                                       atol=2e-4, rtol=1e-4)
        leaf = int(rng.integers(3, 7))  # commit the root and a path to a leaf: rows not leading
        path = np.flatnonzero(sees[leaf, :7])
        tlm.commit(path)
        committed = committed[:-1] + tokens[path].tolist() + [int(rng.integers(4, 250))]
    np.testing.assert_allclose(tlm.run(graph_io.DECODE, np.array(committed[-1:]))[0], chain_logits(art, committed),
                               atol=2e-4, rtol=1e-4)


def _ar(art, prompt, n):
    return runtime.generate(art, prompt, max_new_tokens=n, speculative=False)


PROMPTS = [[0], [0, 7, 7, 7, 7, 7, 7], [0, *range(40, 47)], [0, *range(40, 48)], [0, *[5, 6, 7] * 5, 5],
           [0, *range(100, 130)]]  # lengths around the prefill chunk (8), repetitive and not


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equals_the_tlm_and_transformers_into_the_context_limit(tlm_only, hf, method):
    art, accepted = tlm_only, 0
    for prompt in PROMPTS:
        ar = _ar(art, prompt, 200)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64 - len(prompt) + 1, do_sample=False,
                              num_beams=1, pad_token_id=3)[0, len(prompt):].tolist()
        assert ar.token_ids == ref
        for settings in METHODS[method]:
            r = runtime.generate(art, prompt, max_new_tokens=200, speculative=method, **{method: settings})
            assert r.token_ids == ar.token_ids, (prompt, settings)
            assert r.finish_reason == "length" and len(prompt) + len(r.token_ids) == 65
            accepted += r.metrics.speculative["accepted"]
    assert accepted > 50  # the drafts were really used, not all rejected


@pytest.mark.parametrize("method", sorted(METHODS))
def test_eos_inside_an_accepted_run_ends_generation(tlm_only, method):
    art, saved = tlm_only, tlm_only.eos_token_ids
    prompt = [0, *[5, 6, 7] * 5, 5]
    ref = _ar(art, prompt, 40).token_ids
    try:
        for eos in sorted(set(ref[1:]))[:4]:
            art.eos_token_ids = frozenset({eos})
            r = runtime.generate(art, prompt, max_new_tokens=40, speculative=method, **{method: METHODS[method][0]})
            assert r.token_ids == ref[: ref.index(eos) + 1] and r.finish_reason == "eos"
    finally:
        art.eos_token_ids = saved


def test_the_recipe_method_runs_without_a_draft_model(tlm_only):
    r = runtime.generate(tlm_only, [0, 5, 6, 7, 5, 6], max_new_tokens=20)
    assert r.metrics.speculative["method"] == "lookahead"  # recipe: speculative, speculation = "lookahead"
    assert runtime.generate(tlm_only, [0, 5], max_new_tokens=5, speculative=True).metrics.speculative
    assert not runtime.generate(tlm_only, [0, 5], max_new_tokens=5, speculative=False).metrics.speculative
    with pytest.raises(Exception, match="no draft model"):
        runtime.generate(tlm_only, [0, 5], speculative="draft")


@pytest.mark.parametrize("kwargs, word", [
    (dict(speculative="medusa"), "speculative"),
    (dict(speculative="lookahead", lookahead=dict(window=0)), "window"),
    (dict(speculative="lookahead", lookahead=dict(windows=3)), "windows"),
    (dict(speculative="lookahead", lookahead=[3]), "lookahead"),
    (dict(speculative="lookahead", lookahead=dict(adaptive="yes")), "adaptive"),
    (dict(speculative="lookahead", lookahead=dict(window=9, guesses=9)), "T = 37"),
    (dict(speculative="prompt_lookup", prompt_lookup=dict(max_draft=40)), "max_draft"),
    (dict(speculative="prompt_lookup", prompt_lookup=dict(ngram=1.5)), "ngram"),
    (dict(speculative="lookahead", draft_length=2), "draft_length"),
])
def test_bad_method_settings_are_clear_errors(tlm_only, kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        runtime.generate(tlm_only, [0, 5], max_new_tokens=3, **kwargs)


def _pinned_costs(art, monkeypatch) -> None:
    """Costs that grow with the rows, as the policy prices every call (not this process's timings of a tiny
    model's calls, mostly noise: they could make a 13-row step cheaper as two calls, or drafting look dear
    on a busy machine)."""
    entries = {name: replace(e, cost_ms=1.0 + e.tokens / 100) for name, e in art.tlm.entries.items()}
    monkeypatch.setattr(art.tlm, "entries", entries)
    monkeypatch.setattr(art.tlm.costs, "ms", lambda graph, adapt=True, warm=True: entries[graph].cost_ms)


def test_metrics_of_the_draft_free_methods(tlm_only, monkeypatch):
    _pinned_costs(tlm_only, monkeypatch)  # every step is one call
    prompt = [0, *[5, 6, 7] * 5, 5]
    for method in METHODS:
        r = runtime.generate(tlm_only, prompt, max_new_tokens=30, speculative=method, **{method: METHODS[method][0]})
        s = r.metrics.speculative
        assert s["method"] == method and s["accepted"] <= s["drafted"]
        steps = s["rounds"] + s["plain_decode_steps"]
        assert s["tokens_per_tlm_call"] == pytest.approx((len(r.token_ids) - 1) / steps)
        prefilled = len(prompt) - r.metrics.cached_prompt_tokens  # a repeated prompt reuses the cache
        assert s["tlm_calls"] == steps + len(tlm_only.tlm.plan(prefilled))  # and the prefill's calls
        assert s["tokens_per_tlm_call"] > 1.2  # a repetitive prompt: several tokens per call
        if method == "lookahead":
            assert s["lookahead_steps"] == s["rounds"]  # window steps are rounds, even without candidates


def test_kept_policies_are_per_settings_and_halve_their_history_once_per_generation(tlm_only, monkeypatch):
    art = tlm_only
    _pinned_costs(art, monkeypatch)  # prompt lookup drafts on the repeats, however busy the machine
    engine = engine_of(art)
    engine.policies.clear()
    for window, guesses in ((2, 1), (1, 2)):  # the same T = 7, different methods
        runtime.generate(art, [0, *[5, 6, 7] * 4], max_new_tokens=12, speculative="lookahead",
                         lookahead=dict(window=window, guesses=guesses))
    assert len([k for k in engine.policies if k[0] == "lookahead"]) == 2
    prompt = [0, *[5, 6, 7] * 4]
    runtime.generate(art, prompt, max_new_tokens=20, speculative="prompt_lookup")
    (kept,) = [p for k, p in engine.policies.items() if k[0] == "prompt_lookup"]
    judged = lambda: sum(t for t, _ in kept.counts.values())  # noqa: E731 - drafts judged so far, every kind
    assert judged() >= 4
    halved = judged() / 2  # each kind of draft's history: alone, a new generation halves it
    seen = []
    observe = kept.observe
    kept.observe = lambda *a: (seen.append(judged()), observe(*a))  # history at the first round
    runtime.generate(art, prompt, max_new_tokens=20, speculative="prompt_lookup")
    assert seen[0] == halved


def test_a_lookahead_round_with_nothing_to_score_offers_nothing_and_is_not_a_choice():
    la = Lookahead(LookaheadSettings(ngram=3, window=3, guesses=3))
    la.start([1, 2, 3, 4])
    assert la.offer([1, 2, 3, 4, 9], room=2) == (0, 0)  # no n-gram starts with 9; the window needs room 4
    policy = DraftPolicy("lookahead", lambda role, rows, warm: 1.0 + rows, [1], window=9)
    policy.plain_wanted = 0
    assert policy.choose([(0, 0)]) == [0] and policy.plain_in_a_row == 0  # no plain step counted toward a probe
    assert policy.choose([(0, 1)]) == [0] and policy.plain_in_a_row == 1  # a step on offer that does not pay
    assert la.propose([1, 2, 3, 4, 9], 0).empty
    assert la.offer([1, 2, 3, 4, 9], room=10) == (0, 1)
    assert len(la.propose([1, 2, 3, 4, 9], 1).aux_tokens) == 3


# --- sampled: the emitted distribution is the TLM's, end to end --------------------------------

@pytest.fixture(scope="module")
def tiny_vocab_tlm(tmp_path_factory):
    torch.manual_seed(21)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=None,
                      max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    root = tmp_path_factory.mktemp("v8tree")
    model.save_pretrained(root / "tlm")
    byte_tokenizer().save_pretrained(root / "tlm")
    path = build_artifact(tiny_recipe(dlm=None, context_length=24), root / "art", tlm=str(root / "tlm"),
                          progress=False)
    art = runtime.load_artifact(path)
    art.eos_token_ids = frozenset()
    return art, model


SAMPLED = {"lookahead": dict(speculative="lookahead", lookahead=dict(adaptive=False)),
           "prompt_lookup": dict(speculative="prompt_lookup", prompt_lookup=dict(adaptive=False))}
PROMPT = [0, 3, 5, 3, 5, 3]  # repetitive: both methods propose candidates from the first round


@pytest.mark.parametrize("method", sorted(SAMPLED))
@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)], ids=["t1", "t0.7-topk4"])
def test_sampled_output_is_distributed_as_the_tlm(tiny_vocab_tlm, method, warp):
    art, tlm = tiny_vocab_tlm
    kw = dict(do_sample=True, **warp)
    exact = exact_marginals(tlm, PROMPT, runtime.SamplingParams(**kw))
    counts = emitted_counts(art, PROMPT, kw | SAMPLED[method], draft_length=None)
    assert min_p_value(counts, exact) > 1e-3
    assert np.abs(counts / counts[0].sum() - exact).max() < 0.04


@pytest.mark.parametrize("method", sorted(SAMPLED))
def test_negative_control_accepting_candidates_on_trust_fails(tiny_vocab_tlm, method, monkeypatch):
    art, tlm = tiny_vocab_tlm
    kw = dict(do_sample=True, temperature=1.0)
    exact = exact_marginals(tlm, PROMPT, runtime.SamplingParams(**kw))

    def accept_first(tokens, parents, target, rng):  # a candidate accepted with probability 1
        path, node = [], 0
        while (kids := [i for i in range(1, len(tokens)) if parents[i] == node]):
            path.append(node := kids[0])
        return path, int(runtime.sampling.sample(target(node), rng))

    monkeypatch.setattr(rejection_module, "verify_candidates", accept_first)
    counts = emitted_counts(art, PROMPT, kw | SAMPLED[method], draft_length=None)
    assert min_p_value(counts, exact) < 1e-6


def test_cli_picks_a_method_and_its_settings(tlm_only, capsys):
    from runtime.__main__ import main

    assert main([str(tlm_only.path), "--prompt", "abcabcabc", "--max-new-tokens", "12", "--speculative",
                 "prompt_lookup", "--max-draft", "3", "--always-draft"]) == 0
    assert "speculative (prompt_lookup)" in capsys.readouterr().out
    assert main([str(tlm_only.path), "--prompt", "ab", "--speculative", "lookahead", "--window", "0"]) == 2
    assert "lookahead.window must be >= 1" in capsys.readouterr().err


def test_recipe_tables_choose_the_method_and_are_checked():
    from common.recipe import RecipeError, recipe_from_dict

    r = recipe_from_dict({"name": "x", "tlm": {"model": "m"}, "speculation": "lookahead",
                          "lookahead": {"ngram": 4, "window": 2, "guesses": 2}})
    assert r.lookahead.ngram == 4 and r.dlm is None
    from export.pipeline import graph_plan

    assert graph_plan(r, "tlm")[graph_io.LOOKAHEAD] == graph_io.lookahead_tokens(4, 2, 2) == 13
    for bad, word in (({"speculation": "medusa"}, "speculation"), ({"lookahead": {"window": 0}}, "window"),
                      ({"prompt_lookup": {"max_drafts": 3}}, "max_drafts"), ({"speculation": "draft"}, "dlm")):
        with pytest.raises(RecipeError, match=word):
            recipe_from_dict({"name": "x", "tlm": {"model": "m"}, "speculation": "lookahead"} | bad)


@pytest.mark.parametrize("max_rows", [2, 3, None])
def test_the_forest_scores_a_tree_with_window_rows_over_several_calls_as_one_call(tlm_only, max_rows):
    """A lookahead step's rows (a candidate trie and Jacobi window rows, the server's per-request
    proposal) split over calls: each row sees its tree ancestors from earlier calls through their
    slots, and gets the same bits as the whole step in one call."""
    from runtime.forest import Forest
    from runtime.proposal import Proposal

    tlm, prompt = tlm_only.tlm, np.array([0, 5, 6, 7, 8])
    proposal = Proposal(np.array([9, 10, 11, 12]), np.array([0, 0, 1, 2]), None, np.array([20, 21, 22, 23]),
                        window_sees(2, 2))
    tokens, _, sees = proposal.rows(13)
    chain = Chain(tlm)
    chain.prefill(prompt)
    whole = chain.run(tlm.graph_for(len(tokens)), tokens, sees).copy()
    forest = Forest(tlm, max_rows=max_rows)
    root, _ = forest.root(prompt)
    [rows], [slots] = forest.extend_rows([root], [list(tokens)], [len(tokens)], sees=[sees])
    assert np.array_equal(rows, whole)
    assert root.length == len(prompt) + len(tokens) and root.order[len(prompt):] == slots.tolist()
