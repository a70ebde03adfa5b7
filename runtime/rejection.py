"""Exact verification of drafted tokens: every accept/reject decision of every drafter.

- A chain sampled from a draft model (proposal distributions q): modified rejection sampling
  (MRS), batched over rounds (`rejection_sample`; Leviathan et al. 2023, shared/notes/spd-math.md).
- A tree of deterministic candidates (prompt lookup, lookahead n-grams; one-hot q): multi-candidate
  rejection sampling (`verify_candidates`; shared/notes/tree-decoding.md).
`verify_tree` picks the rule for a proposal. Greedy decoding is the one-hot special case of both
(accept the child equal to the TLM's argmax); `verify_greedy` is that case computed directly (no
V-sized float64 work per node: a plain step must cost what an autoregressive one does), and the
tests hold it equal to the one-hot rules. The whole exactness argument
lives in this one small, heavily tested file (as vLLM does); the decode loop only calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from runtime.sampling import sample


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


def verify_candidates(
    tokens: np.ndarray, parents: np.ndarray, target: Callable[[int], np.ndarray], rng: np.random.Generator
) -> tuple[list[int], int]:
    """Walk a tree of deterministic candidates; returns (accepted rows, root excluded; next token).

    tokens/parents [n]: row 0 is the root (parents[0] = -1), rows 1.. the candidates, each after
    its parent, siblings distinct (a trie). target(i): the warped TLM distribution after row i.
    At a node with distribution p and children c_1..c_m (in row order): r = p; for each c_j draw
    u ~ U[0, 1) and accept c_j iff u * sum(r) < r(c_j) (then continue from it), else r(c_j) = 0;
    when none is accepted the next token is drawn from r / sum(r). Each token x then comes out with
    probability p(x) exactly (by induction over j), so the output is the TLM's own distribution.
    Consumes one uniform per child tried and one for the next token.
    """
    children: dict[int, list[int]] = {}
    for i in range(1, len(tokens)):
        children.setdefault(int(parents[i]), []).append(i)
    node, path = 0, []
    while True:
        r = np.array(target(node), dtype=np.float64)
        for child in children.get(node, ()):
            t = int(tokens[child])
            if rng.random() * r.sum() < r[t]:
                path.append(child)
                node = child
                break
            r[t] = 0.0
        else:
            return path, int(sample(r, rng))


def verify_tree(
    tokens: np.ndarray,
    parents: np.ndarray,
    q: np.ndarray | None,
    target: Callable[[int], np.ndarray],
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """Verify one proposal: a draft model's chain (q [n-1, V]: the distribution rows 1.. were
    sampled from) by MRS, or deterministic candidates (q None) by `verify_candidates`.
    Returns the accepted rows (root excluded) and the next token (correction or bonus)."""
    if q is None:
        return verify_candidates(tokens, parents, target, rng)
    k = len(tokens) - 1
    if not np.array_equal(parents, np.arange(-1, k)):
        raise ValueError("sampled drafts (with q) must form a chain; exact multi-draft trees are not supported")
    p = np.stack([target(i) for i in range(k + 1)])
    n_acc, nxt = rejection_sample(np.asarray(tokens[1:])[None], q[None], p[None], rng)
    return list(range(1, int(n_acc[0]) + 1)), int(nxt[0])


def verify_greedy(tokens: np.ndarray, parents: np.ndarray, best: Callable[[int], np.ndarray]
                  ) -> tuple[list[int], int]:
    """Greedy verification of any tree: follow the child equal to the TLM's argmax (first index on
    ties, as `warp`) while there is one; returns (accepted rows, root excluded; next token).
    best(i): the TLM's greedy token after call row i (sampling.argmax_rows of the logits, or the
    tokens a device computed: ModelRunner.argmax)."""
    children: dict[tuple[int, int], int] = {(int(parents[i]), int(tokens[i])): i for i in range(1, len(tokens))}
    node, path = 0, []
    while True:
        best_token = int(best(node))
        child = children.get((node, best_token))
        if child is None:
            return path, best_token
        path.append(child)
        node = child
