"""Logit warpers and the categorical sampler shared by the TLM and the DLM.

Speculative decoding is exact only with respect to the distribution each model *really* samples
from, so `warp` returns that distribution as explicit float64 probabilities (greedy included, as a
one-hot) instead of leaving warping implicit inside the sampler. Everything is vectorised over the
last axis so the same code serves one row or a batch of rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings; validated eagerly so a bad recipe fails at load time, not mid-run."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, (bool, np.bool_)):
            raise ValueError(f"do_sample must be a bool (True or False), got {self.do_sample!r}")
        t = self.temperature
        # Checked even for greedy: harmless there, and catches the recipe before do_sample flips.
        if isinstance(t, bool) or not isinstance(t, Real) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature must be a finite number > 0, got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, Integral) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables top-k), got {k!r}")
        tp = self.top_p
        if isinstance(tp, bool) or not isinstance(tp, Real) or not (0.0 < tp <= 1.0):
            # NaN fails the range comparison, so it lands here too.
            raise ValueError(f"top_p must be in the range (0, 1] (1.0 disables top-p), got {tp!r}")


def softmax(x: np.ndarray) -> np.ndarray:
    """Stable softmax over the last axis in float64; -inf entries get exactly zero mass."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def _top_k_mask(x: np.ndarray, k: int) -> np.ndarray:
    """Keep-mask of tokens >= the k-th largest logit (ties at the boundary all kept, like HF)."""
    v = x.shape[-1]
    if k <= 0 or k >= v:
        return np.ones(x.shape, dtype=bool)
    kth = np.partition(x, v - k, axis=-1)[..., v - k : v - k + 1]
    return x >= kth


def _top_p_mask(x: np.ndarray, top_p: float) -> np.ndarray:
    """Keep-mask with Hugging Face TopPLogitsWarper semantics (min_tokens_to_keep=1)."""
    order = np.argsort(x, axis=-1, kind="stable")  # ascending, as HF sorts
    cum = np.cumsum(softmax(np.take_along_axis(x, order, axis=-1)), axis=-1)
    remove_sorted = cum <= (1.0 - top_p)
    remove_sorted[..., -1] = False  # the top token always survives
    remove = np.empty_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return ~remove


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Logits [..., V] -> the float64 probabilities [..., V] the sampler actually draws from.

    Greedy yields a one-hot at np.argmax (first index on ties), so MRS treats greedy as the
    degenerate case of sampling rather than a separate code path. Sampling applies temperature,
    then top-k, then top-p (Hugging Face's order), then a stable softmax.
    """
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {x.shape}")
    if not params.do_sample:
        out = np.zeros(x.shape, dtype=np.float64)
        np.put_along_axis(out, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return out
    # Shift before dividing: a tiny temperature then sends the others to -inf, never the top to +inf.
    with np.errstate(over="ignore"):
        x = (x - np.max(x, axis=-1, keepdims=True)) / float(params.temperature)
    if params.top_k > 0:
        x = np.where(_top_k_mask(x, int(params.top_k)), x, -np.inf)
    if params.top_p < 1.0:
        x = np.where(_top_p_mask(x, float(params.top_p)), x, -np.inf)
    return softmax(x)


def sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Draw one token per row of probs [..., V] by inverse CDF; returns int64 ids [...].

    Exactly one rng.random() per row (in C order), so the rng stream consumed is predictable and
    a fixed seed reproduces a run. Rows need not be normalised: u is scaled by the row total.
    Zero-probability tokens are never returned.
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim == 0 or p.shape[-1] == 0:
        raise ValueError(f"probs must have shape [..., V] with V >= 1, got {p.shape}")
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(size=p.shape[:-1]) * cdf[..., -1]
    # Token j is chosen iff cdf[j-1] <= u < cdf[j]; counting cdf <= u gives j and skips zero bins.
    idx = np.count_nonzero(cdf <= u[..., None], axis=-1)
    # u * total can round up to total; clamp to the last token with positive mass.
    last_pos = p.shape[-1] - 1 - np.argmax(p[..., ::-1] > 0, axis=-1)
    return np.minimum(idx, last_pos).astype(np.int64)


def argmax_rows(logits: np.ndarray) -> Callable[[int | slice], np.ndarray]:
    """rows -> those rows' greedy tokens, computed only for the rows asked for (a tree's walk reads a few)."""
    return lambda rows: np.argmax(logits[rows], axis=-1)


def warped_rows(logits: np.ndarray, params: SamplingParams) -> Callable[[int], np.ndarray]:
    """row -> its warped distribution (`warp`), computed only for the rows a verification reads."""
    return lambda row: warp(logits[row], params)


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from one row of logits: argmax when greedy (no warp needed), else warp + sample."""
    if not params.do_sample:
        return int(np.argmax(logits))
    return int(sample(warp(logits, params), rng))
