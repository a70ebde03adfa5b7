"""Tests for runtime.rejection: MRS is exact for the warped TLM; its failure modes get caught.

The distribution tests simulate whole SpD rounds on synthetic bigram models, where the exact TLM
marginal of every output position is a vector-matrix product, and compare by chi-square. The same
simulator and checker run with deliberately wrong accept rules (negative controls) to prove the
test has the power to catch the classic bugs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from runtime.rejection import rejection_sample, verify_candidates, verify_greedy, verify_tree
from runtime.sampling import SamplingParams, argmax_rows, sample, softmax, warp

AcceptFn = Callable[
    [np.ndarray, np.ndarray, np.ndarray, np.random.Generator], tuple[np.ndarray, np.ndarray]
]

V = 8
START = 3  # a high-entropy TLM row, so position 1 is a real test under top-k/top-p too
N_POS = 3
M = 100_000
P_ACCEPT = 1e-3  # a correct sampler must not be rejected at this level
P_CONTROL = 1e-6  # a broken sampler must be rejected at this level
MAX_ABS_ERR = 0.01

GREEDY = SamplingParams()
T1 = SamplingParams(do_sample=True)
T07 = SamplingParams(do_sample=True, temperature=0.7)
TOPK3 = SamplingParams(do_sample=True, top_k=3)
TOPP08 = SamplingParams(do_sample=True, top_p=0.8)


def _logit_tables() -> tuple[np.ndarray, np.ndarray]:
    """Bigram logits [prev, next]; the DLM is correlated with the TLM but clearly different."""
    rng = np.random.default_rng(1234)
    tlm = rng.normal(scale=1.0, size=(V, V))
    dlm = 0.5 * tlm + rng.normal(scale=1.2, size=(V, V))
    return tlm, dlm


TLM_LOGITS, DLM_LOGITS = _logit_tables()


def test_fixture_is_not_degenerate() -> None:
    """Guard the test's power: every warping leaves several tokens possible at each position."""
    for params in (T1, T07, TOPK3, TOPP08):
        assert np.all(np.count_nonzero(exact_marginals(warp(TLM_LOGITS, params)), axis=1) >= 3)


# --------------------------------------------------------------------------- simulator & checker


def simulate(
    p_table: np.ndarray,
    q_table: np.ndarray,
    k: int,
    accept: AcceptFn = rejection_sample,
    q_reported: np.ndarray | None = None,
    m: int = M,
    n_pos: int = N_POS,
    seed: int = 0,
) -> tuple[np.ndarray, float]:
    """Run m independent SpD sequences for n_pos rounds; return their first n_pos tokens [m, n_pos]
    and the acceptance rate.

    The DLM samples from q_table (rows = previous token); accept() is told q_reported, which is
    q_table unless a test wants to lie about what the DLM sampled from.
    """
    q_reported = q_table if q_reported is None else q_reported
    rng = np.random.default_rng(seed)
    out = np.full((m, n_pos * (k + 1)), -1, dtype=np.int64)
    count = np.zeros(m, dtype=np.int64)
    last = np.full(m, START, dtype=np.int64)
    offsets = np.arange(k + 1)
    accepted_total = 0
    for _ in range(n_pos):  # every round emits >= 1 token
        prev, drafts = last, []
        for _ in range(k):
            prev = sample(q_table[prev], rng)
            drafts.append(prev)
        draft = np.stack(drafts, axis=1) if k else np.zeros((m, 0), dtype=np.int64)
        contexts = np.concatenate([last[:, None], draft], axis=1)  # [m, k+1]
        n_acc, nxt = accept(draft, q_reported[contexts[:, :k]], p_table[contexts], rng)
        emitted = np.concatenate([draft, nxt[:, None]], axis=1)
        emitted[np.arange(m), n_acc] = nxt  # drafts before n_acc, then the correction/bonus
        r_idx, j_idx = np.nonzero(offsets[None, :] <= n_acc[:, None])
        out[r_idx, count[r_idx] + j_idx] = emitted[r_idx, j_idx]
        count += n_acc + 1
        last = nxt
        accepted_total += int(n_acc.sum())
    assert np.all(count >= n_pos)
    return out[:, :n_pos], accepted_total / (m * n_pos * k) if k else 1.0


def exact_marginals(p_table: np.ndarray, n_pos: int = N_POS) -> np.ndarray:
    """TLM-only marginal of output positions 1..n_pos: pi_i = pi_{i-1} @ P, independent of MRS."""
    pi = np.zeros(p_table.shape[0])
    pi[START] = 1.0
    rows = []
    for _ in range(n_pos):
        pi = pi @ p_table
        rows.append(pi)
    return np.stack(rows)


@dataclass
class Fit:
    pvalues: list[float]
    max_abs_err: float

    def ok(self) -> bool:
        return min(self.pvalues) >= P_ACCEPT and self.max_abs_err < MAX_ABS_ERR


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value; zero-mass bins must be empty and sparse bins are pooled (n*p < 5)."""
    n = counts.sum()
    if np.any(counts[probs == 0] > 0):
        return 0.0
    expected = n * probs
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    small = (~big) & (probs > 0)
    if expected[small].sum() > 0:
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    if len(obs) < 2:
        return 1.0
    exp_arr = np.array(exp) * (sum(obs) / sum(exp))  # guard float drift in sum(probs)
    return float(stats.chisquare(np.array(obs), exp_arr).pvalue)


def check(tokens: np.ndarray, marginals: np.ndarray) -> Fit:
    pvalues, err = [], 0.0
    for pos in range(marginals.shape[0]):
        counts = np.bincount(tokens[:, pos], minlength=marginals.shape[1])
        pvalues.append(chi2_pvalue(counts, marginals[pos]))
        err = max(err, float(np.max(np.abs(counts / counts.sum() - marginals[pos]))))
    return Fit(pvalues, err)


# ------------------------------------------------------------------ (1) greedy by construction


def _one_hot(idx: np.ndarray, v: int) -> np.ndarray:
    return np.eye(v)[idx]


def test_greedy_all_match_accepts_all_and_emits_bonus_argmax() -> None:
    draft = np.array([[1, 2, 3]])
    q = _one_hot(draft, 5)
    p = _one_hot(np.array([[1, 2, 3, 4]]), 5)
    n, nxt = rejection_sample(draft, q, p, np.random.default_rng(0))
    assert n.tolist() == [3] and nxt.tolist() == [4]


def test_greedy_first_mismatch_emits_tlm_argmax() -> None:
    draft = np.array([[1, 2, 3], [0, 2, 3], [1, 2, 0], [4, 4, 4]])
    tlm = np.array([[1, 2, 4, 0], [1, 2, 4, 0], [1, 2, 3, 0], [4, 4, 4, 2]])
    n, nxt = rejection_sample(draft, _one_hot(draft, 5), _one_hot(tlm, 5), np.random.default_rng(1))
    assert n.tolist() == [2, 0, 2, 3]
    assert nxt.tolist() == [4, 1, 3, 2]


def test_k0_samples_from_p0() -> None:
    p = _one_hot(np.array([[3], [1]]), 4)
    n, nxt = rejection_sample(
        np.zeros((2, 0), dtype=np.int64), np.zeros((2, 0, 4)), p, np.random.default_rng(0)
    )
    assert n.tolist() == [0, 0] and nxt.tolist() == [3, 1]


def test_dlm_equal_to_tlm_accepts_everything() -> None:
    rng = np.random.default_rng(2)
    probs = rng.dirichlet(np.ones(V), size=(5000, 4))
    draft = sample(probs[:, :3], rng)
    n, _ = rejection_sample(draft, probs[:, :3], probs, rng)
    assert np.all(n == 3)


def test_greedy_simulation_equals_tlm_greedy_chain() -> None:
    p_table = warp(TLM_LOGITS, GREEDY)
    tokens, _ = simulate(p_table, warp(DLM_LOGITS, GREEDY), k=3, m=50, n_pos=6)
    chain, tok = [], START
    for _ in range(6):
        tok = int(np.argmax(TLM_LOGITS[tok]))
        chain.append(tok)
    assert np.all(tokens == np.array(chain))


def test_residual_fallback_to_p_when_it_rounds_to_zero() -> None:
    # p <= q everywhere (as after float rounding): max(0, p - q) is all zero, so emit from p.
    draft = np.zeros((1000, 1), dtype=np.int64)
    q = np.broadcast_to([0.5, 0.5, 0.0], (1000, 1, 3))
    p = np.broadcast_to([[0.0, 0.5, 0.0], [0.0, 0.0, 1.0]], (1000, 2, 3))
    n, nxt = rejection_sample(draft, q, p, np.random.default_rng(3))
    assert np.all(n == 0) and np.all(nxt == 1)


def test_same_seed_same_result() -> None:
    rng = np.random.default_rng(4)
    p = rng.dirichlet(np.ones(V), size=(200, 4))
    q = rng.dirichlet(np.ones(V), size=(200, 3))
    draft = sample(q, rng)
    a = rejection_sample(draft, q, p, np.random.default_rng(5))
    b = rejection_sample(draft, q, p, np.random.default_rng(5))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize(
    ("draft_shape", "q_shape", "p_shape"),
    [
        ((2, 3), (2, 3, 5), (2, 3, 5)),  # p needs K+1 rows
        ((2, 3), (2, 3, 4), (2, 4, 5)),  # V mismatch
        ((2, 3), (1, 3, 5), (2, 4, 5)),  # N mismatch
        ((6,), (2, 3, 5), (2, 4, 5)),  # draft not 2-D
    ],
)
def test_shape_errors(draft_shape: tuple, q_shape: tuple, p_shape: tuple) -> None:
    with pytest.raises(ValueError):
        rejection_sample(
            np.zeros(draft_shape, dtype=np.int64),
            np.full(q_shape, 0.2),
            np.full(p_shape, 0.2),
            np.random.default_rng(0),
        )


def test_out_of_range_draft_rejected() -> None:
    with pytest.raises(ValueError, match="draft"):
        rejection_sample(
            np.array([[5]]),
            np.full((1, 1, 5), 0.2),
            np.full((1, 2, 5), 0.2),
            np.random.default_rng(0),
        )


# --------------------------------------------------------------------------- (2) distribution


@pytest.mark.parametrize(
    ("tlm_params", "dlm_params", "k"),
    [
        pytest.param(T1, T1, 1, id="t1-k1"),
        pytest.param(T1, T1, 3, id="t1-k3"),
        pytest.param(T07, T07, 3, id="t0.7-k3"),
        pytest.param(T07, T1, 1, id="tlm-t0.7-dlm-t1-k1"),
        pytest.param(TOPK3, TOPK3, 3, id="topk3-k3"),
        pytest.param(TOPP08, TOPP08, 3, id="topp0.8-k3"),
        pytest.param(T1, GREEDY, 1, id="dlm-greedy-k1"),
        pytest.param(T1, GREEDY, 3, id="dlm-greedy-k3"),
        pytest.param(T07, TOPK3, 3, id="tlm-t0.7-dlm-topk3-k3"),
        pytest.param(
            TOPP08, SamplingParams(do_sample=True, temperature=1.5), 3, id="tlm-topp-dlm-t1.5-k3"
        ),
        pytest.param(GREEDY, T1, 3, id="tlm-greedy-dlm-sampling-k3"),
    ],
)
def test_spd_output_matches_tlm_marginals(
    tlm_params: SamplingParams, dlm_params: SamplingParams, k: int
) -> None:
    p_table = warp(TLM_LOGITS, tlm_params)
    q_table = warp(DLM_LOGITS, dlm_params)
    tokens, alpha = simulate(p_table, q_table, k, seed=k)
    fit = check(tokens, exact_marginals(p_table))
    assert fit.ok(), fit
    assert 0.0 < alpha < 1.0  # the DLM really differs, so both MRS branches were exercised


def test_dlm_equal_tlm_simulation_matches_and_accepts_all() -> None:
    p_table = warp(TLM_LOGITS, T07)
    tokens, alpha = simulate(p_table, p_table, k=3, seed=7)
    assert alpha == 1.0
    assert check(tokens, exact_marginals(p_table)).ok()


# --------------------------------------------------------------------------- (3) negative controls


def always_accept(
    draft: np.ndarray, q: np.ndarray, p: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Bug: take every draft, then a bonus token."""
    n_rows, k = draft.shape
    return np.full(n_rows, k, dtype=np.int64), sample(p[:, k], rng)


def resample_from_p(
    draft: np.ndarray, q: np.ndarray, p: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Bug: correct accept test, but on rejection draw from p instead of norm(max(0, p - q))."""
    n_acc, _ = rejection_sample(draft, q, p, rng)
    return n_acc, sample(p[np.arange(draft.shape[0]), n_acc], rng)


def test_negative_control_always_accept_fails() -> None:
    p_table, q_table = warp(TLM_LOGITS, T1), warp(DLM_LOGITS, T1)
    tokens, _ = simulate(p_table, q_table, k=3, accept=always_accept, seed=11)
    fit = check(tokens, exact_marginals(p_table))
    assert min(fit.pvalues) < P_CONTROL, fit


@pytest.mark.parametrize("k", [1, 3])
def test_negative_control_resample_from_p_fails(k: int) -> None:
    p_table, q_table = warp(TLM_LOGITS, T1), warp(DLM_LOGITS, T1)
    tokens, _ = simulate(p_table, q_table, k=k, accept=resample_from_p, seed=12)
    fit = check(tokens, exact_marginals(p_table))
    assert min(fit.pvalues) < P_CONTROL, fit


@pytest.mark.parametrize(
    "dlm_params",
    [GREEDY, TOPK3, SamplingParams(do_sample=True, temperature=0.5)],
    ids=["greedy", "topk3", "t0.5"],
)
def test_negative_control_unwarped_q_fails(dlm_params: SamplingParams) -> None:
    """Bug (transformers #32867): DLM samples from a warped q, MRS is given softmax(logits)."""
    p_table = warp(TLM_LOGITS, T1)
    q_sampled = warp(DLM_LOGITS, dlm_params)
    tokens, _ = simulate(p_table, q_sampled, k=3, q_reported=softmax(DLM_LOGITS), seed=13)
    fit = check(tokens, exact_marginals(p_table))
    assert min(fit.pvalues) < P_CONTROL, fit


# --------------------------------------------------------------------------- (4) accepted count


@pytest.mark.parametrize("k", [1, 4])
def test_accepted_count_is_truncated_geometric(k: int) -> None:
    """With context-free p and q, per-draft acceptance is i.i.d. with alpha = 1 - TV(p, q)."""
    rng = np.random.default_rng(20 + k)
    p1 = rng.dirichlet(np.ones(V))
    q1 = rng.dirichlet(np.ones(V))
    alpha = float(np.minimum(p1, q1).sum())
    assert 0.3 < alpha < 0.9
    n_rows = 100_000
    q = np.broadcast_to(q1, (n_rows, k, V))
    p = np.broadcast_to(p1, (n_rows, k + 1, V))
    draft = sample(q, rng)
    n_acc, nxt = rejection_sample(draft, q, p, rng)
    want = np.array([alpha**n * (1 - alpha) for n in range(k)] + [alpha**k])
    counts = np.bincount(n_acc, minlength=k + 1)
    assert counts.size == k + 1
    assert stats.chisquare(counts, n_rows * want).pvalue > P_ACCEPT
    assert np.max(np.abs(counts / n_rows - want)) < MAX_ABS_ERR
    # Every round's first emitted token is TLM-distributed: the draft if accepted, else nxt.
    first = np.where(n_acc > 0, draft[:, 0], nxt)
    assert chi2_pvalue(np.bincount(first, minlength=V), p1) > P_ACCEPT
    # Tokens per TLM call: (1 - alpha^(K+1)) / (1 - alpha).
    tau = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert abs((n_acc + 1).mean() - tau) < 0.02


# --------------------------------------------------------------------------- (5) properties


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_rows=st.integers(1, 6),
    k=st.integers(0, 5),
    v=st.integers(1, 7),
    sparsity=st.floats(0.0, 0.9),
)
def test_outputs_in_range_and_supported(
    seed: int, n_rows: int, k: int, v: int, sparsity: float
) -> None:
    rng = np.random.default_rng(seed)
    weights = rng.random((n_rows, 2 * k + 1, v)) * (rng.random((n_rows, 2 * k + 1, v)) > sparsity)
    weights[..., rng.integers(v)] += 0.1  # every row keeps some mass
    probs = weights / weights.sum(-1, keepdims=True)
    q, p = probs[:, :k], probs[:, k:]
    draft = sample(q, rng) if k else np.zeros((n_rows, 0), dtype=np.int64)
    n_acc, nxt = rejection_sample(draft, q, p, rng)
    assert n_acc.shape == nxt.shape == (n_rows,)
    assert n_acc.dtype == nxt.dtype == np.int64
    assert np.all((0 <= n_acc) & (n_acc <= k))
    assert np.all((0 <= nxt) & (nxt < v))
    rows = np.arange(n_rows)
    # Accepted drafts have TLM support; the emitted token has TLM support too.
    for i in range(k):
        took = n_acc > i
        assert np.all(p[rows[took], i, draft[took, i]] > 0)
    assert np.all(p[rows, n_acc, nxt] > 0)
    # A rejected draft token can never be the correction (its residual mass is 0).
    rej = n_acc < k
    if k:
        assert np.all(nxt[rej] != draft[rej, n_acc[rej]])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_rows=st.integers(1, 8),
    k=st.integers(0, 5),
    v=st.integers(1, 6),
    agree=st.floats(0.0, 1.0),
)
def test_greedy_equivalence(seed: int, n_rows: int, k: int, v: int, agree: float) -> None:
    """One-hot p and q must reduce MRS to: accept while draft == argmax p, then emit argmax p."""
    rng = np.random.default_rng(seed)
    tlm_logits = rng.normal(size=(n_rows, k + 1, v)).round(1)  # rounding makes ties common
    dlm_logits = np.where(
        rng.random((n_rows, k, v)) < agree, tlm_logits[:, :k], rng.normal(size=(n_rows, k, v))
    )
    p, q = warp(tlm_logits, GREEDY), warp(dlm_logits, GREEDY)
    draft = np.argmax(dlm_logits, axis=-1)
    n_acc, nxt = rejection_sample(draft, q, p, rng)
    target = np.argmax(tlm_logits, axis=-1)  # [n_rows, k+1]
    match = draft == target[:, :k]
    want_n = np.where(match.all(axis=1), k, np.argmin(match, axis=1)) if k else np.zeros(n_rows)
    np.testing.assert_array_equal(n_acc, want_n)
    np.testing.assert_array_equal(nxt, target[np.arange(n_rows), n_acc])


# ---------------------------------------------- (6) deterministic candidate trees (one-hot q)

TRIE_TOKENS = np.array([-1, 2, 5, 1, 4, 6])  # row 0 is the root; rows 1.. are candidates
TRIE_PARENTS = np.array([-1, 0, 0, 1, 1, 2])  # 2 -> {1, 4}, 5 -> {6}: a trie of three 2-grams
M_TREE = 20_000


def candidates_for(last: int) -> np.ndarray:
    """Deterministic candidates that depend on the context (as prompt lookup's and lookahead's do)."""
    tokens = TRIE_TOKENS.copy()
    tokens[1:] = (tokens[1:] + last) % V
    return tokens


def _broken_accept_first(tokens, parents, target, rng):
    """Bug: the first child is accepted with probability 1 (a candidate taken on trust)."""
    path, node = [], 0
    while (kids := [i for i in range(1, len(tokens)) if parents[i] == node]):
        path.append(kids[0])
        node = kids[0]
    return path, int(sample(target(node), rng))


def _broken_resample_from_p(tokens, parents, target, rng):
    """Bug: the acceptance test is right, but a rejected candidate keeps its mass in r."""
    node, path = 0, []
    while True:
        p = np.array(target(node))
        kids = [i for i in range(1, len(tokens)) if parents[i] == node]
        for child in kids:
            if rng.random() < p[tokens[child]]:
                path.append(child)
                node = child
                break
        else:
            return path, int(sample(p, rng))


def simulate_trees(p_table: np.ndarray, verify=verify_candidates, seed: int = 0) -> np.ndarray:
    """M_TREE sequences of N_POS tokens, each round verifying the trie of its context."""
    rng = np.random.default_rng(seed)
    out = np.zeros((M_TREE, N_POS), np.int64)
    for m in range(M_TREE):
        seq = [START]
        while len(seq) <= N_POS:
            tokens = candidates_for(seq[-1])
            ctx = {0: seq[-1]}

            def target(i: int, ctx=ctx, tokens=tokens) -> np.ndarray:
                return p_table[ctx.setdefault(i, int(tokens[i]))]

            path, nxt = verify(tokens, TRIE_PARENTS, target, rng)
            seq += [int(tokens[i]) for i in path] + [nxt]
        out[m] = seq[1 : N_POS + 1]
    return out


@pytest.mark.parametrize("params", [T1, TOPK3, TOPP08], ids=["t1", "topk3", "topp0.8"])
def test_candidate_tree_output_matches_tlm_marginals(params: SamplingParams) -> None:
    p_table = warp(TLM_LOGITS, params)
    tokens = simulate_trees(p_table, seed=31)
    assert check(tokens, exact_marginals(p_table)).ok()


def test_candidate_tree_greedy_follows_the_argmax_chain() -> None:
    p_table = warp(TLM_LOGITS, GREEDY)
    chain = [START]
    for _ in range(N_POS):
        chain.append(int(np.argmax(p_table[chain[-1]])))
    rng = np.random.default_rng(0)
    seq = [START]
    while len(seq) <= N_POS:
        tokens = candidates_for(seq[-1])
        path, nxt = verify_candidates(tokens, TRIE_PARENTS, lambda i, t=tokens, s=seq[-1]: p_table[
            s if i == 0 else t[i]], rng)
        seq += [int(tokens[i]) for i in path] + [nxt]
    assert seq[: N_POS + 1] == chain


@pytest.mark.parametrize("broken", [_broken_accept_first, _broken_resample_from_p],
                         ids=["accept-with-probability-1", "resample-from-p"])
def test_negative_control_candidate_tree_fails(broken) -> None:
    p_table = warp(TLM_LOGITS, T1)
    tokens = simulate_trees(p_table, verify=broken, seed=32)
    fit = check(tokens, exact_marginals(p_table))
    assert min(fit.pvalues) < P_CONTROL, fit


def test_verify_tree_refuses_a_sampled_tree_and_dispatches_chains_to_mrs() -> None:
    p = warp(TLM_LOGITS, T1)
    with pytest.raises(ValueError, match="chain"):
        verify_tree(np.array([0, 1, 2]), np.array([-1, 0, 0]), p[:2], lambda i: p[i], np.random.default_rng(0))
    tokens, q = np.array([START, 1, 2]), p[[START, 1]]
    a = verify_tree(tokens, np.array([-1, 0, 1]), q, lambda i: p[tokens[i]], np.random.default_rng(4))
    n, nxt = rejection_sample(tokens[None, 1:], q[None], p[tokens][None], np.random.default_rng(4))
    assert a == (list(range(1, int(n[0]) + 1)), int(nxt[0]))


def random_trie(rng: np.random.Generator, vocab: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A root and `size` nodes, each under a random earlier node, siblings distinct."""
    tokens, parents, seen = [int(rng.integers(vocab))], [-1], set()
    while len(tokens) <= size:
        parent, token = int(rng.integers(len(tokens))), int(rng.integers(vocab))
        if (parent, token) not in seen:
            seen.add((parent, token))
            tokens.append(token)
            parents.append(parent)
    return np.array(tokens), np.array(parents)


def test_verify_greedy_equals_the_one_hot_rules_on_random_trees() -> None:
    """The direct greedy walk must give what MRS (chains) and the candidate rule (trees) give with
    one-hot targets, ties included (few distinct logit values make ties common)."""
    rng = np.random.default_rng(7)
    vocab, accepted = 5, 0
    for trial in range(400):
        size = int(rng.integers(0, 9))
        chain = trial % 2 == 0
        if chain:
            tokens, parents = rng.integers(vocab, size=size + 1), np.arange(-1, size)
        else:
            tokens, parents = random_trie(rng, vocab, size)
        logits = rng.integers(0, 3, size=(len(tokens), vocab)).astype(np.float32)
        # Make the argmax walk go deep often: each node's child token becomes its parent's argmax.
        for i in range(1, len(tokens)):
            if rng.random() < 0.7:
                logits[parents[i], tokens[i]] = 5.0
        p = warp(logits, GREEDY)
        q = np.eye(vocab)[tokens[1:]] if chain else None
        want = verify_tree(tokens, parents, q, lambda i, p=p: p[i], np.random.default_rng(trial))
        got = verify_greedy(tokens, parents, argmax_rows(logits))
        assert got == want, (trial, tokens, parents)
        assert verify_greedy(tokens, parents, np.argmax(logits, axis=-1).__getitem__) == want  # a device's tokens
        accepted += len(got[0])
    assert accepted > 400  # deep walks were exercised, not only immediate rejections
