"""The t quantile, and the perplexity ratio's batch-means interval on correlated per-token differences."""

import numpy as np
import pytest
from scipy import signal, stats

from benchmarks import intervals


def test_t_quantile_matches_scipy():
    for df in range(3, 61):
        assert intervals.t_quantile(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), rel=2e-3)


def test_perplexity_ratio_is_exact_and_needs_four_whole_blocks():
    rng = np.random.default_rng(1)
    base = rng.gamma(2.0, 1.5, 1100)
    nll = base + rng.normal(0.01, 0.2, 1100)
    v = intervals.perplexity_ratio_interval(nll, base, 256)  # 4 whole blocks; the 76 tokens left count in the ratio
    assert v["ratio"] == pytest.approx(np.exp(nll.mean()) / np.exp(base.mean()), rel=1e-12)
    assert v["low"] < v["ratio"] < v["high"] and v["samples"] == 4
    assert intervals.perplexity_ratio_interval(nll[:1000], base[:1000], 256) is None  # 3 whole blocks
    assert intervals.perplexity_ratio_interval(nll[:100], base[:100], 256) is None


def _coverage(block: int, rng: np.random.Generator, runs: int = 2000, tokens: int = 2048, rho: float = 0.9) -> int:
    """How many of `runs` intervals hold the true log ratio 0.01, on AR(1)-correlated per-token differences
    (a text repeating itself for ~10 tokens at a time, as the licence does)."""
    noise = signal.lfilter([1.0], [1.0, -rho], rng.normal(0, 0.1, (runs, tokens + 200)), axis=1)[:, 200:]
    hits = 0
    for diff in 0.01 + noise:
        v = intervals.perplexity_ratio_interval(diff, np.zeros(tokens), block)
        hits += v["low"] <= np.exp(0.01) <= v["high"]
    return hits


def test_perplexity_interval_covers_95_percent_only_with_blocks_spanning_the_correlation():
    """Blocks of 256 tokens: 95% coverage (a binomial test over 2,000 simulated texts); per-token
    'blocks', which treat correlated differences as independent, fail the same test (negative control)."""
    rng = np.random.default_rng(0)
    assert stats.binomtest(_coverage(256, rng), 2000, 0.95).pvalue > 1e-3
    assert stats.binomtest(_coverage(1, rng), 2000, 0.95).pvalue < 1e-3
