"""GPTQ-style MX quantization: round one input row at a time, pushing each row's error onto the rows
not yet rounded, weighted by the calibration inputs' second moments (Frantar et al., 2022).

Round-to-nearest makes each weight as close as it can; this makes the layer's output on typical
inputs close instead: with H = X^T X over calibration inputs, the output error of W[K, N] is
tr(E^T H E), and after rounding row k the optimal change to the rows after it is -e_k H^-1[k, k:]
/ H^-1[k, k] (via the Cholesky factor of H^-1, as GPTQ). MX blocks run along K, the same direction:
each block's shared exponent is chosen (by the recipe's rule, quant.mx.SCALE_CHOICES) from the block's
values as updated when its first row comes up, and its 32 rows are then rounded on that grid.

Rows are taken in GPTQ's "act order", kept to MX blocks (`act_order`): the blocks whose inputs carry
most energy (H's diagonal) first, and within a block its rows likewise, so that the rows that matter
most are rounded while many rows remain free to absorb their error. On SmolLM2 it lowered the mean KL
divergence from float32 by 12-15% on every held-out text against the rows' own order (docs/benchmarks.md).

The result is float32 whose every block is exactly representable in the format, so the quant pass
stores it with the standard quantizer unchanged (re-quantizing reproduces every value: tested) and
the artifact's encoding, kernels and batch invariance are untouched.
"""

from __future__ import annotations

import numpy as np

from common.graph_io import MX_BLOCK as BLOCK
from quant.mx import quantize, round_to_grid

# Added to H's diagonal, times its mean: keeps H^-1 well conditioned, and tempers how far the
# calibration text's particulars steer the rounding. GPTQ's default is 0.01; on SmolLM2 the mean KL
# divergence from float32 on two held-out texts was flat from 0.1 to 1.0 and lowest at 0.3, 5% above
# it at 0.01 (docs/benchmarks-history.md, Accuracy).
DAMP = 0.3


def upper_inverse_factor(hessian: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """U, upper triangular, with U^T U = (H + damp * mean(diag H) * I)^-1. Inputs never seen (zero
    diagonal) get a unit diagonal, so their rows are rounded to nearest and push no error onward."""
    h = np.array(hessian, dtype=np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
    inverse = np.linalg.inv(np.linalg.cholesky(h))  # L^-1, with H = L L^T: H^-1 = L^-T L^-1
    return np.linalg.cholesky(inverse.T @ inverse).T


def act_order(hessian: np.ndarray) -> np.ndarray:
    """The order in which to round a weight's K rows: whole MX blocks by decreasing sum of H's diagonal
    (a short last block stays last), and each block's rows by decreasing diagonal. A block's rows stay
    together, so every block still shares one exponent."""
    energy = np.diag(hessian)
    k = len(energy)
    starts = sorted(range(0, k - k % BLOCK, BLOCK), key=lambda b0: -energy[b0 : b0 + BLOCK].sum())
    starts += [k - k % BLOCK] if k % BLOCK else []
    return np.concatenate([b0 + np.argsort(-energy[b0 : b0 + BLOCK], kind="stable") for b0 in starts])


def feedback_factor(hessian: np.ndarray, damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """(order, u): act_order of the inputs' statistics and upper_inverse_factor of them in that order,
    what quantize_with_feedback needs (computed once for weights that read one input)."""
    order = act_order(hessian)
    return order, upper_inverse_factor(hessian[np.ix_(order, order)], damp)


def quantize_with_feedback(w: np.ndarray, u: np.ndarray, fmt: str, scale: str = "spec",
                           rounding: str = "even", order: np.ndarray | None = None) -> np.ndarray:
    """W[K, N] (blocks of BLOCK along K) -> float32 values of the same shape on the MX grid of `fmt`;
    `u` is upper_inverse_factor of the inputs' statistics (shared by weights that read one input),
    taken in `order` where one is given (feedback_factor), else in the rows' own order."""
    k, n = w.shape
    if u.shape != (k, k):
        raise ValueError(f"input statistics {u.shape} do not match a weight with {k} inputs")
    if order is not None:
        out = np.empty((k, n), dtype=np.float32)
        out[order] = quantize_with_feedback(w[order], u, fmt, scale, rounding)
        return out
    work = np.array(w, dtype=np.float64)  # rows not yet rounded carry the feedback
    out = np.empty((k, n), dtype=np.float32)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        block = work[b0:b1]
        exponents = quantize(block, fmt, axis=0, block_size=BLOCK, rounding=rounding, scale=scale).scales[:, 0]
        shared = exponents.astype(np.int32) - 127  # E8M0 bias
        errors = np.empty((b1 - b0, n))
        for i in range(b1 - b0):
            q = round_to_grid(block[i], shared, fmt, rounding)
            out[b0 + i] = q
            errors[i] = (block[i] - q) / u[b0 + i, b0 + i]
            block[i + 1 :] -= np.outer(u[b0 + i, b0 + i + 1 : b1], errors[i])
        work[b1:] -= u[b0:b1, b1:].T @ errors
    return out
