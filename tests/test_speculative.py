"""Speculative decoding through the real compiled runtime (the MRS math itself: test_rejection.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats as sps
from transformers import AutoModelForCausalLM, LlamaConfig

import runtime
import runtime.rejection as rejection_module
from benchmarks.chain import Chain
from export.pipeline import build_artifact
from recipes.default_pair import byte_tokenizer
from runtime.engine import engine_of
from runtime.model_runner import ModelRunner
from runtime.prompt_lookup import TextIndex
from tests.conftest import tiny_recipe


def noisy_copy(src, dst, scale: float, seed: int):
    """A draft that agrees with the target often but not always."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    model.save_pretrained(dst)
    byte_tokenizer().save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def arts(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("spd")
    dlm = noisy_copy(checkpoints["llama-gqa"], root / "noisy", 0.35, seed=1)
    out = {}
    for k in (1, 3, 7):
        path = build_artifact(tiny_recipe(k=k, context_length=64, name=f"k{k}"), root / f"k{k}",
                              tlm=str(checkpoints["llama-gqa"]), dlm=str(dlm), progress=False)
        out[k] = runtime.load_artifact(path)
    return out


def greedy_pair(art, prompt, n, draft_length=None):
    ar = runtime.generate(art, prompt, max_new_tokens=n, speculative=False)
    sd = runtime.generate(art, prompt, max_new_tokens=n, speculative=True, draft_length=draft_length)
    return ar, sd


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_spd_equals_greedy_tlm_into_the_context_limit(arts, k):
    art = arts[k]
    for length in (1, 5, 20, 50):
        prompt = [0] + list(range(40, 40 + length - 1))
        ar, sd = greedy_pair(art, prompt, 200, draft_length=k)
        assert sd.token_ids == ar.token_ids
        assert sd.finish_reason == ar.finish_reason == "length"
        assert len(prompt) + len(sd.token_ids) == 65  # ran into the 64-slot context
    s = sd.metrics.speculative
    assert 0 < s["acceptance_rate"] < 1  # a real mix of accepts and rejections
    # every token is the prefill's, or an accepted draft, or a round's correction/bonus, or the
    # one plain decode step that fills the last slot
    assert len(sd.token_ids) - 1 - s["rounds"] - s["accepted"] in (0, 1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.sampled_from([1, 3, 7]), prompt=st.lists(st.integers(4, 259), min_size=1, max_size=30),
       n=st.integers(1, 40), adaptive=st.booleans())
def test_greedy_equivalence_property(arts, k, prompt, n, adaptive):
    ar, sd = greedy_pair(arts[k], prompt, n, draft_length=None if adaptive else k)
    assert sd.token_ids == ar.token_ids and sd.finish_reason == ar.finish_reason


def test_eos_inside_an_accepted_prefix_ends_generation(arts):
    art = arts[7]
    prompt = [0, 50, 60, 70]
    ref = runtime.generate(art, prompt, max_new_tokens=40, speculative=False).token_ids
    eos = ref[len(ref) // 2]  # declare a token the greedy path emits mid-way to be EOS
    saved = art.eos_token_ids
    art.eos_token_ids = frozenset({eos})
    try:
        ar, sd = greedy_pair(art, prompt, 40, draft_length=7)
    finally:
        art.eos_token_ids = saved
    assert sd.token_ids == ar.token_ids == ref[: ref.index(eos) + 1]
    assert sd.finish_reason == ar.finish_reason == "eos"


def test_dlm_equal_to_tlm_accepts_every_draft(checkpoints, tmp_path):
    k = 3
    path = build_artifact(tiny_recipe(k=k), tmp_path / "same", tlm=str(checkpoints["llama-gqa"]),
                          dlm=str(checkpoints["llama-gqa"]), progress=False)
    art = runtime.load_artifact(path)
    for kw in (dict(), dict(do_sample=True, temperature=0.8, seed=3)):
        r = runtime.generate(art, [0, 9, 8, 7], max_new_tokens=4 * (k + 1) + 1, speculative=True, draft_length=k,
                             **kw)
        s = r.metrics.speculative
        assert s["acceptance_rate"] == 1.0
        assert s["mean_accepted_length"] == k + 1


def test_same_seed_same_output_and_seed_matters(arts):
    kw = dict(max_new_tokens=30, do_sample=True, temperature=1.0, top_p=0.9, speculative=True)
    a = runtime.generate(arts[3], [0, 5, 6], seed=5, **kw)
    b = runtime.generate(arts[3], [0, 5, 6], seed=5, **kw)
    c = runtime.generate(arts[3], [0, 5, 6], seed=6, **kw)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_valid_cache_after_rejections_equals_autoregressive_cache(arts):
    art = arts[7]
    r = runtime.generate(art, [0, 11, 12, 13], max_new_tokens=30, do_sample=True, temperature=1.2, seed=9,
                         speculative=True, draft_length=7)
    s = r.metrics.speculative
    assert s["accepted"] < s["drafted"]  # at least one rejection happened
    committed = np.array([0, 11, 12, 13] + r.token_ids[:-1])
    # each model's sequence is kept by the engine's forest over its cache, for the next generation
    engine = engine_of(art)
    slots = {"tlm": engine.forest.cache.match(committed), "dlm": engine.dlm.cache.match(committed)}
    for role in ("tlm", "dlm"):
        live, mine = art.runners[role], slots[role]
        fresh = ModelRunner(art.path, art.manifest.models[role], art.manifest.capacity)
        Chain(fresh).prefill(committed[: len(mine)])
        assert len(mine) >= len(committed) - 2
        for a, b in zip(live.place.cache, fresh.place.cache, strict=True):
            np.testing.assert_allclose(a[:, :, mine], b[:, :, : len(mine)], atol=1e-5)


# --- the emitted distribution, end to end, on tiny-vocabulary models --------------------------

V, N_POS, SAMPLES = 8, 3, 3000


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("v8")
    dirs = {}
    for role, seed in (("tlm", 21), ("dlm", 22)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=None,
                          max_position_embeddings=64)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)  # peaked, context-dependent distributions
        model.save_pretrained(root / role)
        byte_tokenizer().save_pretrained(root / role)
        dirs[role] = root / role
    path = build_artifact(tiny_recipe(k=2, context_length=16), root / "art", tlm=str(dirs["tlm"]),
                          dlm=str(dirs["dlm"]), progress=False)
    art = runtime.load_artifact(path)
    art.eos_token_ids = frozenset()
    tlm = AutoModelForCausalLM.from_pretrained(dirs["tlm"], dtype=torch.float32).eval()
    return art, tlm


def exact_marginals(tlm, prompt, params):
    """P(token at position i) under the warped TLM, by enumerating every prefix (V^2 of them)."""
    from runtime.sampling import warp

    out = np.zeros((N_POS, V))
    frontier = {(): 1.0}
    for pos in range(N_POS):
        nxt = {}
        for prefix, prob in frontier.items():
            with torch.no_grad():
                logits = tlm(torch.tensor([prompt + list(prefix)])).logits[0, -1].numpy()
            p = warp(logits.astype(np.float64), params)
            out[pos] += prob * p
            for t in np.nonzero(p)[0]:
                nxt[prefix + (int(t),)] = prob * p[t]
        frontier = nxt
    return out


def emitted_counts(art, prompt, kw, seed0=0, draft_length=2):
    counts = np.zeros((N_POS, V))
    kw = dict(speculative=True) | kw
    for s in range(SAMPLES):
        ids = runtime.generate(art, prompt, max_new_tokens=N_POS, seed=seed0 + s, draft_length=draft_length,
                               **kw).token_ids
        counts[np.arange(N_POS), ids] += 1
    return counts


def min_p_value(counts, exact):
    worst = 1.0
    for pos in range(N_POS):
        keep = exact[pos] > 0
        if counts[pos][~keep].sum() > 0:
            return 0.0  # a token the TLM can never emit
        if keep.sum() > 1:
            worst = min(worst, sps.chisquare(counts[pos][keep], exact[pos][keep] * SAMPLES).pvalue)
    return worst


WARPS = [
    dict(do_sample=True, temperature=1.0),
    dict(do_sample=True, temperature=0.7, top_k=4),
    dict(do_sample=True, temperature=1.3, top_p=0.8),
]


@pytest.mark.parametrize("kw", WARPS, ids=["t1", "t0.7-topk4", "t1.3-topp0.8"])
def test_emitted_distribution_matches_the_tlm(tiny_vocab, kw):
    art, tlm = tiny_vocab
    prompt = [0, 3]
    exact = exact_marginals(tlm, prompt, runtime.SamplingParams(**kw))
    counts = emitted_counts(art, prompt, kw)
    assert min_p_value(counts, exact) > 1e-3
    assert np.abs(counts / SAMPLES - exact).max() < 0.04


def test_negative_control_always_accept_fails(tiny_vocab, monkeypatch):
    art, tlm = tiny_vocab
    kw = WARPS[0]
    exact = exact_marginals(tlm, [0, 3], runtime.SamplingParams(**kw))

    def always_accept(draft, q, p, rng):
        n = np.full(draft.shape[0], draft.shape[1])
        return n, runtime.sampling.sample(p[:, -1], rng)

    monkeypatch.setattr(rejection_module, "rejection_sample", always_accept)
    counts = emitted_counts(art, [0, 3], kw)
    assert min_p_value(counts, exact) < 1e-6


def test_draft_sampling_may_differ_from_target(tiny_vocab):
    """A greedy DLM under a sampling TLM: q is one-hot, and the output is still the TLM's."""
    art, tlm = tiny_vocab
    kw = dict(do_sample=True, temperature=1.0)
    exact = exact_marginals(tlm, [0, 3], runtime.SamplingParams(**kw))
    greedy_draft = runtime.SamplingParams()
    counts = emitted_counts(art, [0, 3], kw | dict(draft_sampling=greedy_draft), seed0=10**6)
    assert min_p_value(counts, exact) > 1e-3


def test_spd_metrics_are_consistent(arts):
    r = runtime.generate(arts[3], [0, 1, 2, 3], max_new_tokens=20, speculative=True, draft_length=3)
    s = r.metrics.speculative
    assert s["rounds"] * 3 >= s["drafted"] and s["accepted"] <= s["drafted"]
    assert abs(s["mean_accepted_length"] - (1 + s["accepted"] / s["rounds"])) < 1e-12
    assert len(s["per_position_acceptance"]) == 3 and s["predicted_speedup"] > 0
    assert s["dlm_calls"] > 0 and s["tlm_calls"] >= s["rounds"]




def test_the_dlm_is_fed_the_prompt_only_at_its_first_draft(arts):
    """While the policy decodes plainly the DLM must not run (it would evict the TLM's weights from
    the caches): start() feeds it nothing, the first draft catches up on everything committed."""
    from runtime.draft_model import DraftModelDrafter
    from runtime.forest import Forest

    art = arts[3]
    drafter = DraftModelDrafter(Forest(art.dlm), runtime.SamplingParams(), np.random.default_rng(0))
    calls = art.dlm.calls
    committed = [5, 6, 7, 8, 9]
    drafter.start(committed)
    assert art.dlm.calls == calls and drafter.used == 0
    assert drafter.offer(committed, room=10) == (0, 10) and art.dlm.calls == calls
    proposal = drafter.propose(committed, 1)
    assert len(proposal.tokens) == 1 and drafter.used == len(committed) and art.dlm.calls > calls


def test_the_next_generation_reuses_the_draft_models_cached_prefix(arts):
    """A finished generation's DLM prefix stays in the engine's DLM forest (as the TLM's does), so the next
    turn's first draft catches up on the new tokens only; the output is the cold run's."""
    from runtime.engine import engine_of

    art, prompt = arts[3], [0, 1, 2, 3, 4, 5, 6, 7, 8]
    kw = dict(max_new_tokens=12, speculative="draft", draft_length=3, do_sample=False)
    cold = runtime.generate(art, prompt, **kw)
    stats = engine_of(art).stats
    before = stats["draft_cached_tokens"]
    warm = runtime.generate(art, prompt, **kw)
    assert warm.token_ids == cold.token_ids
    assert stats["draft_cached_tokens"] - before >= len(prompt) - 1


def test_prompt_lookup_finds_the_latest_longest_match():
    """`TextIndex.match` against the plain definition (every window of every length compared), on random texts
    over small vocabularies (many matches), lengths 0 to 60, n-grams 1 to 8, the index built whole and grown
    token by token."""
    rng = np.random.default_rng(7)

    def reference(text: list[int], ngram: int, max_draft: int) -> list[int]:
        for n in range(min(ngram, len(text) - 1), 0, -1):
            starts = [s for s in range(len(text) - n) if text[s : s + n] == text[-n:]]
            if starts:
                return text[starts[-1] + n : starts[-1] + n + max_draft]
        return []

    found = 0
    for _ in range(2000):
        text = rng.integers(0, int(rng.integers(2, 12)), int(rng.integers(0, 60))).tolist()
        ngram, max_draft = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        got = TextIndex(ngram, text).match(max_draft)[1]
        assert got == reference(text, ngram, max_draft), (text, ngram, max_draft)
        grown = TextIndex(ngram, text[:1])
        for i in range(2, len(text) + 1):
            grown.extend(text[i - 1 : i])
            assert grown.match(max_draft)[1] == reference(text[:i], ngram, max_draft), (text[:i], ngram, max_draft)
        found += bool(got)
    assert 500 < found < 2000  # matches and misses both


def test_the_prompt_lookup_index_does_not_grow_with_its_ngram():
    """A server holds one index per request: one with an entry per n-gram length held 64 a token at ngram 64
    (86 MB for a 4,000-token text). This one holds three or four a token whatever its ngram."""
    import tracemalloc

    if tracemalloc.is_tracing():
        pytest.skip("tracemalloc already traces this process: its counts would include everything")
    text = np.random.default_rng(5).integers(0, 49152, 4000).tolist()  # SmolLM2's vocabulary
    sizes = {}
    for ngram in (3, 64):
        tracemalloc.start()
        index = TextIndex(ngram, text)
        sizes[ngram] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert len(index.text) == len(text)
    assert sizes[64] < 2 * sizes[3] and sizes[64] < 4_000_000, sizes  # one entry per length: 86 MB against 0.8


def test_prompt_lookup_offers_on_a_growing_text_what_it_offers_on_the_whole():
    """A generation's drafter converts its text as it grows (start, then what each round added): every round's
    offer and draft equal a fresh drafter's on the whole text."""
    from common.recipe import PromptLookupSettings
    from runtime.prompt_lookup import PromptLookup

    rng = np.random.default_rng(3)
    text = rng.integers(0, 6, 80).tolist()
    growing = PromptLookup(PromptLookupSettings(), None)
    growing.start(text[:20])
    offered = 0
    for n in range(21, 81, 3):  # a round adds 1 to 3 tokens
        fresh = PromptLookup(PromptLookupSettings(), None)
        got, want = growing.offer(text[:n], 8), fresh.offer(text[:n], 8)
        assert got == want
        assert growing.propose(text[:n], 8).tokens.tolist() == fresh.propose(text[:n], 8).tokens.tolist()
        offered += bool(got[1])
    assert offered > 5  # real matches, not only empty offers
