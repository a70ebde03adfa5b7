"""Modified rejection sampling (MRS) for speculative decoding, batched over rounds.

The whole exactness argument of speculative decoding lives in these few lines, so they are kept
in one small, heavily tested place (as vLLM does) and the decode loop only calls them. See
shared/notes/spd-math.md and Leviathan et al. 2023 (arXiv 2211.17192).
"""

from __future__ import annotations

import numpy as np

from runtime.sampling import sample

__all__ = ["rejection_sample"]


def rejection_sample(
    draft: np.ndarray, q: np.ndarray, p: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Decide N speculative rounds at once; returns (n_accepted [N] in 0..K, next_token [N]).

    draft [N, K]: the DLM's tokens; q [N, K, V]: the distributions the DLM *actually* sampled them
    from (one-hot when it was greedy; anything else breaks exactness); p [N, K+1, V]: the warped
    TLM distributions for the K+1 scored positions.

    Draft i is accepted iff r_i * q_i(t_i) < p_i(t_i), r_i ~ U[0, 1): the same test as r < p/q
    but with no division, so q_i(t_i) = 0 or p_i(t_i) = 0 need no special case, and one-hot
    p and q reduce it exactly to "accept while draft == argmax p". At the first rejection j the
    next token comes from norm(max(0, p_j - q_j)) (falling back to p_j if float rounding leaves
    that empty); after K acceptances it is the bonus token from p_K.

    Always consumes N*K + N uniforms from rng (all K acceptance draws, then one per row for the
    next token), whatever is accepted, so runs are reproducible from the seed.
    """
    draft = np.asarray(draft)
    q = np.asarray(q, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    if draft.ndim != 2 or not np.issubdtype(draft.dtype, np.integer):
        raise ValueError(f"draft must be an integer array [N, K], got {draft.dtype} {draft.shape}")
    n_rows, k = draft.shape
    if p.ndim != 3 or p.shape[:2] != (n_rows, k + 1) or p.shape[2] == 0:
        raise ValueError(f"p must have shape [N, K+1, V] = [{n_rows}, {k + 1}, V], got {p.shape}")
    v = p.shape[2]
    if q.shape != (n_rows, k, v):
        raise ValueError(f"q must have shape [N, K, V] = [{n_rows}, {k}, {v}], got {q.shape}")
    if draft.size and (draft.min() < 0 or draft.max() >= v):
        raise ValueError(f"draft token ids must be in [0, {v}), got {draft.min()}..{draft.max()}")

    rows = np.arange(n_rows)
    r = rng.random(size=(n_rows, k))
    q_t = np.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    p_t = np.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]
    accepted = r * q_t < p_t
    # Length of the all-accepted prefix: acceptance stops at the first rejection.
    n_acc = np.cumprod(accepted, axis=1).sum(axis=1).astype(np.int64)

    p_sel = p[rows, n_acc]  # p_j at the rejection, or p_K (bonus row) after a full accept
    if k > 0:
        rejected = (n_acc < k)[:, None]
        q_sel = np.where(rejected, q[rows, np.minimum(n_acc, k - 1)], 0.0)
    else:
        q_sel = np.zeros_like(p_sel)
    residual = np.maximum(p_sel - q_sel, 0.0)
    empty = ~(residual.sum(axis=1) > 0)
    residual[empty] = p_sel[empty]
    return n_acc, sample(residual, rng)
