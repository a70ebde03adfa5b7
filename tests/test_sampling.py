"""Tests for runtime.sampling: parameter validation, warpers (vs Hugging Face), the sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from runtime.sampling import SamplingParams, sample, softmax, warp

# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 0.0, "do_sample": False}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"do_sample": 1}, "do_sample"),
    ],
)
def test_bad_params_raise_naming_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_good_params_accepted() -> None:
    SamplingParams()
    SamplingParams(do_sample=True, temperature=0.7, top_k=5, top_p=0.9)
    SamplingParams(do_sample=True, temperature=2, top_k=np.int64(3), top_p=1.0)


# --------------------------------------------------------------------------- warp


def test_greedy_is_one_hot_at_first_argmax() -> None:
    logits = np.array([[0.0, 3.0, 3.0, -1.0], [5.0, 1.0, 2.0, 5.0]], dtype=np.float32)
    probs = warp(logits, SamplingParams())
    assert probs.dtype == np.float64
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_greedy_ignores_temperature_and_filters() -> None:
    logits = np.random.default_rng(0).normal(size=(3, 5, 17))
    want = warp(logits, SamplingParams())
    got = warp(logits, SamplingParams(temperature=0.3, top_k=2, top_p=0.5))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.argmax(got, axis=-1), np.argmax(logits, axis=-1))


def test_plain_sampling_is_softmax() -> None:
    logits = np.random.default_rng(1).normal(size=(4, 11))
    probs = warp(logits, SamplingParams(do_sample=True))
    e = np.exp(logits)
    np.testing.assert_allclose(probs, e / e.sum(-1, keepdims=True), rtol=1e-12)


def test_temperature_scales_logits() -> None:
    logits = np.random.default_rng(2).normal(size=(4, 11))
    probs = warp(logits, SamplingParams(do_sample=True, temperature=0.5))
    np.testing.assert_allclose(probs, softmax(2.0 * logits), rtol=1e-12)


def test_softmax_is_stable_for_large_logits() -> None:
    probs = warp(np.array([1e4, 1e4 - 1.0, -np.inf]), SamplingParams(do_sample=True))
    assert np.all(np.isfinite(probs))
    np.testing.assert_allclose(probs, [1 / (1 + math.exp(-1)), 1 / (1 + math.e), 0.0])


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_k(k: int) -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 20))  # continuous: no ties
    probs = warp(logits, SamplingParams(do_sample=True, top_k=k))
    assert np.all(np.count_nonzero(probs, axis=-1) == k)
    top = np.argsort(logits, axis=-1)[:, -k:]
    assert np.all(np.take_along_axis(probs, top, axis=-1) > 0)
    np.testing.assert_allclose(probs.sum(-1), 1.0)


def test_top_k_larger_than_vocab_is_a_no_op() -> None:
    logits = np.random.default_rng(4).normal(size=(2, 5))
    np.testing.assert_allclose(
        warp(logits, SamplingParams(do_sample=True, top_k=50)),
        warp(logits, SamplingParams(do_sample=True)),
    )


def test_top_k_keeps_ties_at_the_boundary() -> None:
    probs = warp(np.array([3.0, 1.0, 1.0, 0.0]), SamplingParams(do_sample=True, top_k=2))
    assert np.count_nonzero(probs) == 3


@pytest.mark.parametrize(
    ("top_p", "want"),
    [
        # sorted ascending 0.1, 0.2, 0.3, 0.4; cumulative 0.1, 0.3, 0.6, 1.0;
        # removed where cumulative <= 1 - top_p.
        (0.95, [0.1, 0.2, 0.3, 0.4]),  # nothing dropped: 0.1 > 0.05
        (0.5, [0.0, 0.0, 0.3 / 0.7, 0.4 / 0.7]),  # drops cum 0.1, 0.3 (<= 0.5)
        (0.35, [0.0, 0.0, 0.0, 1.0]),  # drops cum 0.6 (<= 0.65) too
        (0.01, [0.0, 0.0, 0.0, 1.0]),  # the top token always survives
    ],
)
def test_top_p_hand_computed(top_p: float, want: list[float]) -> None:
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    probs = warp(logits, SamplingParams(do_sample=True, top_p=top_p))
    np.testing.assert_allclose(probs, want, rtol=1e-12, atol=1e-15)


def test_top_p_drops_the_tail_when_it_sums_below_threshold() -> None:
    # probs 0.05, 0.05, 0.9: with top_p = 0.85 the tail (cum 0.05, 0.10) is <= 0.15 -> removed.
    logits = np.log(np.array([0.05, 0.9, 0.05]))
    probs = warp(logits, SamplingParams(do_sample=True, top_p=0.85))
    np.testing.assert_allclose(probs, [0.0, 1.0, 0.0], atol=1e-15)


def test_warp_preserves_leading_dims_and_normalises() -> None:
    logits = np.random.default_rng(5).normal(size=(2, 3, 4, 9)).astype(np.float32)
    for params in (
        SamplingParams(),
        SamplingParams(do_sample=True, temperature=0.8, top_k=4, top_p=0.7),
    ):
        probs = warp(logits, params)
        assert probs.shape == logits.shape and probs.dtype == np.float64
        np.testing.assert_allclose(probs.sum(-1), 1.0)


def _hf_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Reference: Hugging Face's warpers in generate()'s order (temperature, top-k, top-p)."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    scores = torch.from_numpy(logits.astype(np.float64))
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    warpers = []
    if params.temperature != 1.0:
        warpers.append(lp.TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        warpers.append(lp.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(lp.TopPLogitsWarper(params.top_p))
    for w in warpers:
        scores = w(ids, scores)
    return torch.softmax(scores, dim=-1).numpy()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.3, 0, 1.0),
        (1.0, 1, 1.0),
        (1.0, 5, 1.0),
        (1.0, 0, 0.9),
        (1.0, 0, 0.5),
        (0.6, 0, 0.8),
        (0.7, 10, 0.9),
        (1.5, 3, 0.3),
        (1.0, 0, 0.001),
    ],
)
def test_matches_transformers_warpers(temperature: float, top_k: int, top_p: float) -> None:
    rng = np.random.default_rng(6)
    logits = rng.normal(scale=2.0, size=(64, 50))
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    want = _hf_probs(logits, params)
    got = warp(logits, params)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got > 0, want > 0)


# --------------------------------------------------------------------------- sample


def test_sample_frequencies_match_probs() -> None:
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.ones(10))
    probs[3] = 0.0
    probs /= probs.sum()
    n = 200_000
    tokens = sample(np.broadcast_to(probs, (n, probs.size)), np.random.default_rng(8))
    assert tokens.dtype == np.int64 and tokens.shape == (n,)
    counts = np.bincount(tokens, minlength=probs.size)
    assert counts[3] == 0
    keep = probs > 0
    res = stats.chisquare(counts[keep], n * probs[keep])
    assert res.pvalue > 1e-3, res
    assert np.max(np.abs(counts / n - probs)) < 0.01


def test_sample_rows_are_independent_distributions() -> None:
    probs = np.eye(5)[[4, 0, 2, 2, 1]]
    np.testing.assert_array_equal(sample(probs, np.random.default_rng(0)), [4, 0, 2, 2, 1])


def test_sample_never_returns_zero_mass_tokens() -> None:
    probs = np.array([[0.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5, 0.0]])
    tokens = sample(np.broadcast_to(probs, (5000, 2, 5)), np.random.default_rng(9))
    assert tokens.shape == (5000, 2)
    assert np.all(tokens[:, 0] == 2)
    assert set(np.unique(tokens[:, 1])) == {1, 3}


def test_sample_handles_unnormalised_rows() -> None:
    probs = np.array([2.0, 6.0])  # 1:3
    tokens = sample(np.broadcast_to(probs, (40_000, 2)), np.random.default_rng(10))
    assert abs(tokens.mean() - 0.75) < 0.01


def test_sample_one_draw_per_row() -> None:
    """The rng stream advances by exactly one uniform per row, which keeps runs reproducible."""
    probs = np.full((3, 4, 6), 1 / 6)
    a, b = np.random.default_rng(11), np.random.default_rng(11)
    sample(probs, a)
    b.random(12)
    assert a.random() == b.random()


def test_sample_scalar_row() -> None:
    tok = sample(np.array([0.0, 1.0, 0.0]), np.random.default_rng(0))
    assert tok.shape == () and int(tok) == 1


def test_same_seed_same_samples() -> None:
    probs = np.random.default_rng(12).dirichlet(np.ones(30), size=1000)
    a = sample(probs, np.random.default_rng(13))
    b = sample(probs, np.random.default_rng(13))
    c = sample(probs, np.random.default_rng(14))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
