"""Beam search on one KV cache: all beams advance in one call per step and share their prefixes.

The selection follows transformers' `generate(num_beams=B, do_sample=False)` step by step
(GenerationMixin._beam_search, transformers 5.x), in float32 as it computes: per beam log-softmax
plus the running score; the top K = max(2, 1 + #EOS) * B continuations over all beams; the best B
that did not stop keep running; those of the first B that stopped (EOS or the length limit) join
the finished hypotheses, scored sum / generated_length ** length_penalty; the search ends when no
running beam can beat the worst finished one (the same heuristic, per `early_stopping`), when all
continuations stop, or, with early_stopping=True, when B hypotheses are finished. A new beam forks
its parent's branch of the forest (a copy of C mask bits, never of KV); beams no longer followed
free their slots (runtime/forest.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from pathlib import Path

import numpy as np

from runtime.artifact import Artifact
from runtime.engine import check_fits, make_requests
from runtime.forest import Forest
from runtime.load import artifact_of
from runtime.multi import MultiMetrics
from runtime.request import check_int, check_optional_bool, decoding, encode_prompt

NEG = np.float32(-1e9)  # transformers' "never choose this" score


@dataclass
class BeamSequence:
    token_ids: list[int]
    text: str
    score: float  # sum of token log-probs / generated length ** length_penalty (transformers' sequences_scores)
    finish_reason: str  # "eos" or "length"


@dataclass
class BeamSearchResult:
    sequences: list[BeamSequence]  # best first
    metrics: MultiMetrics


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first (ties: lower index first)."""
    return np.argsort(-x, kind="stable")[:k]


def _search(forest: Forest, prompt: np.ndarray, beams: int, max_new: int, eos: frozenset[int],
            length_penalty: float, early_stopping: bool | str) -> tuple[list[list[int]], np.ndarray, int]:
    """Run the search; return the finished hypotheses (best first), their scores, and the steps."""
    root, first = forest.root(prompt)
    branches = [root] * beams
    logits = np.repeat(first[None], beams, axis=0)
    vocab = logits.shape[-1]
    keep = max(2, 1 + len(eos)) * beams
    running: list[list[int]] = [[] for _ in range(beams)]
    run_scores = np.full(beams, NEG, np.float32)
    run_scores[0] = 0.0  # the beams start identical: only the first one's continuations count
    done, done_scores = [[] for _ in range(beams)], np.full(beams, NEG, np.float32)
    done_flags = np.zeros(beams, bool)
    eos_ids = np.array(sorted(eos), dtype=np.int64)
    improvable, steps = True, 0
    for cur in range(max_new):
        scores = (_log_softmax(logits) + run_scores[:, None]).reshape(-1)
        top = _top(scores, keep)
        top_scores, parent, token = scores[top], top // vocab, top % vocab
        candidates = [running[p] + [int(t)] for p, t in zip(parent, token, strict=True)]
        stops = np.isin(token, eos_ids) | (cur + 1 >= max_new)
        # The best B continuations that did not stop keep running.
        running_scores = top_scores + stops.astype(np.float32) * NEG
        follow = _top(running_scores, beams)
        # Those of the first B that stopped become finished hypotheses if they beat the kept ones.
        scored = top_scores / np.float32((cur + 1) ** length_penalty)
        scored += np.float32(done_flags.all() and early_stopping is True) * NEG
        scored += np.float32(not improvable) * NEG
        scored += (~(stops & (np.arange(keep) < beams))).astype(np.float32) * NEG
        merged = np.concatenate([done_scores, scored])
        best = _top(merged, beams)
        pool, flags = done + candidates, np.concatenate([done_flags, stops & (np.arange(keep) < beams)])
        done, done_scores, done_flags = [pool[i] for i in best], merged[best], flags[best]
        running, run_scores = [candidates[i] for i in follow], running_scores[follow]
        # Can a running beam still beat the worst finished hypothesis?
        length = max_new if early_stopping == "never" and length_penalty > 0 else cur + 1
        worst = np.where(done_flags, done_scores.min(), NEG)
        improvable = improvable and bool((run_scores[0] / np.float32(length**length_penalty) > worst).any())
        if not improvable or (done_flags.all() and early_stopping is True) or stops.all():
            break
        children = [forest.fork(branches[p]) for p in parent[follow]]
        for b in {id(b): b for b in branches}.values():
            forest.release(b)
        branches = children
        logits = forest.extend(branches, [[seq[-1]] for seq in running])
        steps += 1
    return done, done_scores, steps


def beam_search(
    artifact: str | Path | Artifact,
    prompt: str | Sequence[int],
    num_beams: int = 4,
    max_new_tokens: int | None = None,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
    chat: bool | None = None,
    rows_per_call: int | None = None,
) -> BeamSearchResult:
    """The num_return_sequences best sequences by beam search, as transformers' generate(num_beams=B,
    do_sample=False) finds them (num_beams=1 is a one-beam search, not transformers' greedy path).

    early_stopping: False (transformers' default heuristic), True (stop at B finished hypotheses)
    or "never". The cache must hold the prompt plus num_beams x (max_new_tokens - 1) tokens.
    rows_per_call caps the beams per call (default: the largest graph's T; 1 runs them one by one,
    the sequential baseline of benchmarks/multidecode.py).
    """
    check_int("num_beams", num_beams, 1)
    check_int("num_return_sequences", num_return_sequences, 1)
    if num_return_sequences > num_beams:
        raise ValueError(f"num_return_sequences ({num_return_sequences}) cannot exceed num_beams ({num_beams})")
    d = decoding(max_new_tokens=max_new_tokens)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, Real) or not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    check_optional_bool("chat", chat)
    if rows_per_call is not None:
        check_int("rows_per_call", rows_per_call, 1)
    art = artifact_of(artifact)
    ids = encode_prompt(art, prompt, chat)
    max_new = d.new_tokens(art)
    check_fits(art, make_requests(art, ids, [d] * num_beams, [None] * num_beams), "beams")  # as n choices
    start = time.perf_counter()
    with art.exclusive():
        calls = art.tlm.calls
        forest = Forest(art.tlm, rows_per_call)
        done, scores, steps = _search(forest, np.asarray(ids, dtype=np.int64), num_beams, max_new,
                                      art.eos_token_ids, float(length_penalty), early_stopping)
        calls = art.tlm.calls - calls
    total = time.perf_counter() - start
    tok = art.tokenizer
    sequences = [
        BeamSequence(seq, tok.decode(seq, skip_special_tokens=True), float(score),
                     "eos" if seq and seq[-1] in art.eos_token_ids else "length")
        for seq, score in zip(done[:num_return_sequences], scores[:num_return_sequences], strict=True)
    ]
    new = len(sequences[0].token_ids)
    metrics = MultiMetrics(prompt_tokens=len(ids), new_tokens=new, steps=steps, tlm_calls=calls, ttft_s=total,
                           total_s=total, tokens_per_s=new / total if total > 0 else 0.0, load_s=art.load_seconds)
    return BeamSearchResult(sequences, metrics)
