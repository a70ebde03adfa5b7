"""95% t intervals for ratios measured on a noisy box or on one finite text, shared by the reports.

A ratio is judged against a gate (0.97x its baseline's speed, 1.01x float32's perplexity) only where
its whole interval lies past the gate: one run's point figure on this 2-core box, or one text's, moves
by more than the margins the gates ask about. The t quantile is a Cornish-Fisher expansion, so the
reports need no scipy.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

MIN_SAMPLES = 4  # under this many, a t interval says nothing useful


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile, by its Cornish-Fisher expansion in 1/df: within 0.2% of the exact value
    from df = 3 on (tests check it against scipy)."""
    z = NormalDist().inv_cdf(p)
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96, (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
             (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return z + sum(t / df ** (i + 1) for i, t in enumerate(terms))


def _interval(centre: float, samples: Sequence[float]) -> dict | None:
    """exp(centre) with the 95% t interval of a mean of `samples` (None under MIN_SAMPLES)."""
    if len(samples) < MIN_SAMPLES:
        return None
    half = t_quantile(0.975, len(samples) - 1) * float(np.std(samples, ddof=1)) / len(samples) ** 0.5
    return {"ratio": float(np.exp(centre)), "low": float(np.exp(centre - half)), "high": float(np.exp(centre + half)),
            "samples": len(samples)}


def geometric_mean_interval(logs: Sequence[float]) -> dict | None:
    """The geometric mean of ratios given as their logs, with its 95% t interval (None under 4)."""
    return _interval(float(np.mean(logs)), logs) if len(logs) else None


def perplexity_ratio_interval(nll: np.ndarray, base_nll: np.ndarray, block: int) -> dict | None:
    """Perplexity over the baseline's on the same tokens (exactly their ratio), with a 95% batch-means
    interval: the per-token log-likelihood differences averaged over consecutive blocks of `block`
    tokens (whole blocks only), whose spread says how far another stretch of such text could move the
    ratio. Per-token differences are correlated (a text repeats its phrases), so blocks must span that
    correlation; tests show per-token 'blocks' give too narrow an interval on correlated differences."""
    diff = np.asarray(nll, dtype=np.float64) - np.asarray(base_nll, dtype=np.float64)
    whole = len(diff) // block * block
    return _interval(float(diff.mean()), diff[:whole].reshape(-1, block).mean(1).tolist()) if whole else None
