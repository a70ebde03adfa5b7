"""Batch invariance of compiled artifacts (compiler/invariance.py): a token's logits and new KV are the same
bits whichever graph runs it, whatever other rows share its call, and whether the keys it attends to
are cache slots or new rows of the call. Then speculation, MultiDecode and batching equal
autoregressive decoding token for token, on float32 and MXFP6 alike.

The negative control is the same property on artifacts built with `batch_invariant = false`
(ONNX Runtime's MatMul and attention in standard ops): they differ, on either CPU, because their
attention sums past and new keys in two parts whose split follows where a key is stored.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import runtime
from common import graph_io
from common.targets import TARGETS, compiled_session_options, get_target
from tests.conftest import FORMATS, always_draft, artifact

CPU, CUDA = TARGETS["ort-cpu"], TARGETS["ort-cuda"]


class Graphs:
    """The TLM's compiled graphs, run directly: feeds built here, the cache held as arrays."""

    def __init__(self, art) -> None:
        entry = art.manifest.models["tlm"]
        self.dims, self.c = entry.dims, art.manifest.context_length
        self.tokens = {g: e.tokens for g, e in entry.graphs.items()}
        so = compiled_session_options(get_target(art.manifest.target), threads=2)
        self.sessions = {g: ort.InferenceSession(str(art.path / e.file), so, providers=["CPUExecutionProvider"])
                         for g, e in entry.graphs.items()}

    def run(self, graph: str, ids, positions, mask, cache: list[np.ndarray]) -> list[np.ndarray]:
        """Rows beyond len(ids) are filler: random tokens that see only themselves and the cache."""
        t, n = self.tokens[graph], len(ids)
        full = np.zeros((1, t, self.c + t), dtype=bool)
        full[0, :n, : self.c + n] = mask
        full[0, n:, : self.c] = mask[0, : self.c]
        full[0, np.arange(n, t), self.c + np.arange(n, t)] = True
        rng = np.random.default_rng(t)
        feeds = {graph_io.INPUT_IDS: np.concatenate([ids, rng.integers(4, 260, t - n)])[None],
                 graph_io.POSITION_IDS: np.concatenate([positions, np.full(t - n, positions.max() + 1)])[None],
                 graph_io.ATTENTION_MASK: full}
        names = graph_io.input_names(self.dims)[3:]
        feeds |= dict(zip(names, cache, strict=True))
        return self.sessions[graph].run(None, feeds)


def _random_cache(g: Graphs, rng: np.random.Generator, filled: int) -> tuple[list[np.ndarray], np.ndarray]:
    """A cache whose `filled` visible slots hold random KV at random slots; the other slots hold garbage."""
    shape = (1, g.dims.n_kv_heads, g.c, g.dims.head_dim)
    cache = [rng.standard_normal(shape).astype(np.float32) for _ in graph_io.input_names(g.dims)[3:]]
    visible = np.zeros(g.c, dtype=bool)
    visible[rng.choice(g.c, filled, replace=False)] = True
    return cache, visible


def _row_alone(g: Graphs, outs, cache, visible, ids, positions, sees, row, rng) -> list[np.ndarray]:
    """Row `row` of a tree call run again by the decode graph, its ancestors' new KV moved into free slots."""
    cache = [c.copy() for c in cache]
    vis = visible.copy()
    free = rng.permutation(np.flatnonzero(~visible))
    for slot, anc in zip(free, [a for a in np.flatnonzero(sees[row]) if a != row], strict=False):
        for i, c in enumerate(cache):
            c[0, :, slot] = outs[1 + i][0, :, anc]
        vis[slot] = True
    mask = np.concatenate([vis, [True]])[None]
    return g.run(graph_io.DECODE, ids[row:row + 1], positions[row:row + 1], mask, cache)


def _row(outs: list[np.ndarray], r: int) -> list[np.ndarray]:
    """Row r's logits and new keys and values."""
    return [outs[0][0, r]] + [o[0, :, r] for o in outs[1:]]


def mismatches(art, seed: int, trials: int = 4) -> list[str]:
    """Rows whose logits or new KV differ (bitwise) between their tree call, every larger graph (score,
    prefill, lookahead: other filler rows beside them) and decode (ancestors moved into cache slots)."""
    g, rng, out = Graphs(art), np.random.default_rng(seed), []
    scores = sorted((t, name) for name, t in g.tokens.items() if name.startswith("score"))
    t_small, small = scores[len(scores) // 2]
    others = [name for name, t in g.tokens.items()  # prefill, lookahead too; PREFILL_LAST below
              if t >= t_small and name != small and graph_io.logit_rows(name, t) == t]
    for trial in range(trials):
        n = t_small
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        sees = graph_io.tree_sees(parents)
        cache, visible = _random_cache(g, rng, filled=int(rng.integers(1, g.c - n)))
        positions = graph_io.row_positions(int(visible.sum()), sees)
        ids = rng.integers(4, 260, n)
        mask = np.concatenate([np.repeat(visible[None], n, 0), sees], axis=1)
        outs = g.run(small, ids, positions, mask, cache)
        larger = {name: g.run(name, ids, positions, mask, cache) for name in others}
        last = g.run(graph_io.PREFILL_LAST, ids, positions, mask, cache)  # its one row: prefill's last (filler)
        every = larger[graph_io.PREFILL]
        if not (np.array_equal(last[0][0, 0], every[0][0, -1])
                and all(np.array_equal(x, y) for x, y in zip(last[1:], every[1:], strict=True))):
            out.append(f"trial {trial}: prefill_last")
        for row in range(n):
            alone = _row_alone(g, outs, cache, visible, ids, positions, sees, row, rng)
            for what, other, r in [*((name, o, row) for name, o in larger.items()), ("decode", alone, 0)]:
                if any(not np.array_equal(x, y) for x, y in zip(_row(outs, row), _row(other, r), strict=True)):
                    out.append(f"trial {trial} row {row}: {what}")
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rows_are_the_same_bits_in_every_graph_and_placement(flat, checkpoints, tmp_path_factory, fmt):
    art = artifact(flat, checkpoints, tmp_path_factory, fmt)
    assert art.manifest.models["tlm"].batch_invariant
    assert mismatches(art, seed=len(fmt)) == []


@pytest.mark.parametrize("fmt", ["float32", "mx-fused"])
def test_negative_control_plain_graphs_differ(flat, checkpoints, tmp_path_factory, fmt):
    art = artifact(flat, checkpoints, tmp_path_factory, fmt, invariant=False)
    assert not art.manifest.models["tlm"].batch_invariant
    assert len(mismatches(art, seed=len(fmt))) > 0


PROMPTS = [[0, 40, 41], [0] + [50, 51, 52, 53] * 6, list(range(4, 30)), [0, 7] * 12, [0, 99]]


@pytest.mark.parametrize("fmt", ["float32", "mx-fused", "mx-native", "mx-native8"])
def test_every_method_equals_autoregressive_token_for_token(flat, checkpoints, tmp_path_factory, fmt):
    """Greedy draft SpD, prompt lookup and lookahead on the near-tie model, several prompts (repeats make
    prompt lookup propose); sampled branches equal standalone runs with seed + i; several questions
    decoded together equal each question alone."""
    art = artifact(flat, checkpoints, tmp_path_factory, fmt, dlm=True)
    for prompt in PROMPTS:
        ar = runtime.generate(art, prompt, max_new_tokens=40, speculative=False).token_ids
        for method in ("draft", "prompt_lookup", "lookahead"):
            assert runtime.generate(art, prompt, max_new_tokens=40, speculative=method).token_ids == ar, method
    kw = dict(max_new_tokens=24, do_sample=True, temperature=1.0, seed=5)
    multi = runtime.generate(art, PROMPTS[0], n=4, **kw)
    for i, branch in enumerate(multi.branches):
        alone = runtime.generate(art, PROMPTS[0], speculative=False, **(kw | {"seed": 5 + i}))
        assert branch.token_ids == alone.token_ids, i
    context, questions = [0, 40, 41], [[50, 51], [60, 61, 62], [7]]
    answers = runtime.generate_multi(art, context, questions, max_new_tokens=16)
    for q, answer in zip(questions, answers.branches, strict=True):
        assert answer.token_ids == runtime.generate(art, context + q, max_new_tokens=16, speculative=False).token_ids


@pytest.mark.parametrize("fmt", ["mx-fused", "mx-native", "mx-native8"])
def test_concurrent_server_requests_equal_autoregressive_on_mxfp6(flat, checkpoints, tmp_path_factory, fmt,
                                                                  monkeypatch):
    """The scheduler (the server's engine): speculating and plain greedy requests in shared calls."""
    from runtime.draft_policy import DraftPolicy
    from runtime.request import batched_speculation, decoding
    from serve.scheduler import Scheduler

    monkeypatch.setattr(DraftPolicy, "choose", always_draft)
    art = artifact(flat, checkpoints, tmp_path_factory, fmt, dlm=True)
    prompts = PROMPTS[:4]
    for method in ("draft", "prompt_lookup", "lookahead"):
        scheduler = Scheduler(art)
        try:
            greedy = decoding(max_new_tokens=12, do_sample=False)
            spec = batched_speculation(art, method, None if method == "lookahead" else 2)
            reqs = [scheduler.submit(p, greedy, spec=spec if i % 2 else None) for i, p in enumerate(prompts)]
            out = [[e.token for e in r.events() if e.token is not None] for r in reqs]
        finally:
            scheduler.close()
        assert scheduler.stats["drafted"] > 0, method
        for prompt, tokens in zip(prompts, out, strict=True):
            ar = runtime.generate(art, prompt, max_new_tokens=12, speculative=False).token_ids
            assert tokens == ar, method


def test_without_the_kernels_the_compiler_says_the_artifact_is_not_invariant(monkeypatch):
    import warnings

    from compiler import build

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build.effective_invariance(False, CPU) is False  # asked off: no warning
    with pytest.warns(UserWarning, match="CPU only"):
        assert build.effective_invariance(True, CUDA) is False
    monkeypatch.setattr(build, "library_path", lambda: None)
    with pytest.warns(UserWarning, match="not built"):
        assert build.effective_invariance(True, CPU) is False
