"""Prefix caching: a prompt that starts with tokens whose KV is still in the cache prefills only the
rest, and the output is bit for bit a cold run's (it relies on batch-invariant graphs).

The radix tree alone (runtime/prefix_cache.py), repeated `generate` calls on one loaded artifact
(the runner keeps its committed tokens), and the server's scheduler (finished requests' KV kept in
the forest, evicted least recently used first when live requests need slots).
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime.forest import CapacityError, Forest
from runtime.prefix_cache import PrefixCache
from runtime.request import batched_speculation, decoding
from serve.scheduler import Scheduler
from tests.conftest import artifact


def _tree(*seqs: list[int], capacity: int = 64) -> PrefixCache:
    cache, next_slot = PrefixCache(capacity), 0
    for seq in seqs:
        cache.insert(np.array(seq), np.arange(next_slot, next_slot + len(seq)))
        next_slot += len(seq)
    return cache


def test_match_finds_the_longest_cached_prefix_with_its_slots():
    cache = _tree([1, 2, 3, 4], [1, 2, 9])  # the second shares [1, 2]: only its [9] gets a new slot
    assert cache.match(np.array([1, 2, 3, 4, 5])).tolist() == [0, 1, 2, 3]
    assert cache.match(np.array([1, 2, 3, 7])).tolist() == [0, 1, 2]  # diverges inside an edge
    assert cache.match(np.array([1, 2, 9])).tolist() == [0, 1, 6]
    assert cache.match(np.array([5, 1])).tolist() == []
    assert cache.tokens == 5 and cache.held[[0, 1, 2, 3, 6]].all() and not cache.held[[4, 5]].any()


def test_eviction_drops_least_recently_used_leaves_and_never_pinned_ones():
    cache = _tree([1, 2, 3], [1, 2, 4], [7, 8])  # slots: [1,2,3] 0-2, [4] 5, [7,8] 6-7
    cache.match(np.array([7, 8]))
    cache.match(np.array([1, 2, 3]))  # now [1,2,4] is the least recently used leaf
    none = np.zeros(64, dtype=bool)
    cache.evict(64 - 6 + 1, none)  # 6 slots held: one more free slot wanted
    assert cache.match(np.array([1, 2, 4])).tolist() == [0, 1]  # its own slot went, the shared prefix stays
    assert cache.tokens == 5 == cache.held.sum()  # the count a step reads, kept as slots come and go
    pinned = none.copy()
    pinned[[0, 1, 2]] = True  # a live request sees [1, 2, 3]
    cache.evict(64, pinned)  # wants every slot: everything unpinned goes, the pinned path stays
    assert cache.match(np.array([7, 8])).tolist() == []
    assert cache.match(np.array([1, 2, 3])).tolist() == [0, 1, 2]
    assert cache.tokens == 3 == cache.held.sum()


def test_repeated_generate_prefills_only_the_new_turn_and_equals_a_cold_run(flat, checkpoints, tmp_path_factory):
    art = artifact(flat, checkpoints, tmp_path_factory, "mx-native", dlm=True)
    system = [0] + list(range(30, 70))
    first = runtime.generate(art, system + [5, 6], max_new_tokens=12, speculative=False)
    conversation = system + [5, 6] + first.token_ids + [7, 8, 9]
    for method in (False, "prompt_lookup", "draft"):
        art.tlm.forget()  # cold
        cold = runtime.generate(art, conversation, max_new_tokens=16, speculative=False)
        assert cold.metrics.cached_prompt_tokens == 0
        art.tlm.forget()  # the cold run's KV is forgotten too
        runtime.generate(art, system + [5, 6], max_new_tokens=12, speculative=False)  # warm: the first turn
        warm = runtime.generate(art, conversation, max_new_tokens=16, speculative=method)
        assert warm.metrics.cached_prompt_tokens == len(system) + 2 + len(first.token_ids) - 1
        assert warm.token_ids == cold.token_ids, method


def test_plain_artifacts_never_reuse_a_prefix(flat, checkpoints, tmp_path_factory):
    art = artifact(flat, checkpoints, tmp_path_factory, "float32", invariant=False)
    prompt = [0] + list(range(30, 50))
    runtime.generate(art, prompt, max_new_tokens=4)
    assert runtime.generate(art, prompt + [9], max_new_tokens=4).metrics.cached_prompt_tokens == 0
    with pytest.raises(ValueError, match="batch-invariant"):
        Scheduler(art, prefix_cache=True)


def _serve(scheduler: Scheduler, prompts: list[list[int]], max_new: int, spec=None) -> list[list[int]]:
    """Submit every prompt at once; return each one's tokens."""
    reqs = [scheduler.submit(p, decoding(max_new_tokens=max_new, do_sample=False), spec=spec) for p in prompts]
    return [[e.token for e in r.events() if e.token is not None] for r in reqs]


@pytest.mark.parametrize("fmt", ["float32", "mx-native"])
def test_server_turns_reuse_cached_prefixes_and_equal_cold_runs(flat, checkpoints, tmp_path_factory, fmt):
    """A chat of three turns, then concurrent requests sharing the system prompt, with speculation,
    until the cache (96 slots) must evict: every output equals the request decoded alone, cold."""
    art = artifact(flat, checkpoints, tmp_path_factory, fmt, dlm=True)
    system = [0] + list(range(100, 120))

    scheduler, served = Scheduler(art), []  # (prompt, new tokens, answer)
    try:
        assert scheduler.engine.prefix_cache
        conversation = system
        for turn, spec in enumerate([None, batched_speculation(art, "prompt_lookup", 2),
                                     batched_speculation(art, "draft", 2)]):
            conversation = conversation + [4 + turn, 5 + turn]
            [answer] = _serve(scheduler, [conversation], 8, spec)
            served.append((conversation, 8, answer))
            conversation = conversation + answer
        assert scheduler.stats["cached_prompt_tokens"] >= 2 * len(system)
        questions = [system + [20 + i, 21 + i] for i in range(4)]
        served += [(q, 10, a) for q, a in zip(questions, _serve(scheduler, questions, 10), strict=True)]
        assert scheduler.stats["cached_prompt_tokens"] >= 6 * len(system)
        others = [[1] + list(range(130 + 7 * i, 150 + 7 * i)) for i in range(4)]  # unrelated: forces eviction
        served += [(q, 10, a) for q, a in zip(others, _serve(scheduler, others, 10), strict=True)]
        assert scheduler.stats["prefix_cache_evicted"] > 0
        again = conversation + [9]  # its prefix may be gone by now: cold or warm, the same bits
        served.append((again, 8, _serve(scheduler, [again], 8)[0]))
    finally:
        scheduler.close()
    for prompt, max_new, answer in served:
        art.tlm.forget()  # cold
        assert answer == runtime.generate(art, prompt, max_new_tokens=max_new, speculative=False).token_ids


def test_the_draft_models_cache_reuses_prefixes_too(flat, checkpoints, tmp_path_factory, monkeypatch):
    """Chat turns with draft-model speculation: from the second turn on the draft model is fed only
    what its cache lacks, and every answer equals the turn decoded alone, cold."""
    from runtime.draft_policy import DraftPolicy
    from tests.conftest import always_draft

    monkeypatch.setattr(DraftPolicy, "choose", always_draft)  # the tiny pair's timed policy may not draft
    art = artifact(flat, checkpoints, tmp_path_factory, "mx-native", dlm=True)
    spec = batched_speculation(art, "draft", 2)
    scheduler, served, fed = Scheduler(art), [], []
    try:
        conversation = [0] + list(range(100, 120))
        for turn in range(3):
            conversation = conversation + [4 + turn, 5 + turn]
            before = scheduler.stats["draft_cached_tokens"]
            [answer] = _serve(scheduler, [conversation], 8, spec)
            fed.append(scheduler.stats["draft_cached_tokens"] - before)
            served.append((conversation, answer))
            conversation = conversation + answer
        assert scheduler.stats["drafted"] > 0
    finally:
        scheduler.close()
    assert fed[0] == 0 and all(f >= 21 for f in fed[1:]), fed  # later turns: at least the first prompt cached
    for prompt, answer in served:
        art.tlm.forget()
        assert answer == runtime.generate(art, prompt, max_new_tokens=8, speculative=False).token_ids


GRAPHS = {"decode": (1, 15.7), "score4": (5, 30.4), "score8": (9, 42.5), "lookahead": (13, 56.2),
          "prefill": (64, 231.9)}  # (T, ms per call) as the compiler measured them for SmolLM2


@pytest.mark.parametrize("rows", [1, 2, 5, 9, 13, 20, 30, 46, 64, 65, 100, 300])
def test_call_plans_are_the_cheapest_cover(rows):
    """The plan's calls take every row once, and no cover of the rows by these graphs is cheaper
    (checked against every combination of call counts)."""
    from itertools import product

    from common.graph_io import plan_calls

    plan = plan_calls(GRAPHS, rows)
    assert sum(n for _, n in plan) == rows and all(0 < n <= GRAPHS[g][0] for g, n in plan)
    cost = sum(GRAPHS[g][1] for g, _ in plan)
    (_, one), *others = GRAPHS.values()  # decode (T = 1) takes whatever the other calls leave
    cheapest = min(sum(k * c for k, (_, c) in zip(ks, others, strict=True))
                   + one * max(0, rows - sum(k * t for k, (t, _) in zip(ks, others, strict=True)))
                   for ks in product(*(range(-(-rows // t) + 1) for t, _ in others)))
    assert cost == pytest.approx(cheapest)
    if rows == 20:
        assert sorted(g for g, _ in plan) == ["lookahead", "score8"]  # not one call of T = 64


def test_a_smaller_graph_measured_dearer_than_a_larger_one_still_runs_fewer_rows():
    """Noise in the build's timing (a busy machine) must not make every decode step run a bigger graph:
    a graph of fewer rows costs no more than one that could run its rows, and ties go to the smaller."""
    from common.graph_io import plan_calls

    noisy = GRAPHS | {"decode": (1, 33.0)}  # dearer than score4 (T = 5, 30.4 ms)
    assert plan_calls(noisy, 1) == [("decode", 1)]
    assert plan_calls(noisy, 2) == [("score4", 2)]  # two decode calls are dearer than one of T = 5
    assert plan_calls(GRAPHS | {"score4": (5, 15.7)}, 1) == [("decode", 1)]  # a tie


def test_call_plans_without_costs_take_the_fewest_calls_within_max_rows():
    from common.graph_io import plan_calls

    unmeasured = {g: (t, 0.0) for g, (t, _) in GRAPHS.items()}
    assert plan_calls(unmeasured, 70) == [("prefill", 64), ("score8", 6)]
    assert plan_calls(unmeasured, 7, max_rows=4) == [("score4", 4), ("score4", 3)]
    assert plan_calls(GRAPHS, 7, max_rows=4)[0][1] <= 4
    with pytest.raises(ValueError):
        plan_calls(GRAPHS, 0)


def test_new_tokens_take_the_lowest_free_slots_after_an_eviction_that_did_not_make_room(flat, checkpoints,
                                                                                       tmp_path_factory):
    """The forest searches for free slots from a low-water mark (every slot below it taken). An eviction frees
    slots below it, and the call that evicted can still fail for want of room: the next token must still get
    the lowest free slot, as a search of every slot gives."""
    art = artifact(flat, checkpoints, tmp_path_factory, "float32")
    forest = Forest(art.tlm, prefix_cache=True)
    kept = forest.attach([])
    forest.extend_rows([kept], [list(range(3, 7))], [1])  # slots 0-3, then kept by the prefix cache
    forest.keep(kept, list(range(3, 7)))
    branch, rest = forest.attach([]), art.tlm.context - 4 - 6
    forest.extend_rows([branch], [[5] * rest], [1])  # slots 4 .. C - 7: six are free, four cached
    with pytest.raises(CapacityError):
        forest.extend_rows([branch], [[5] * 13], [1])  # evicts the four, and still has only ten
    assert forest.cache.tokens == 0
    _, (slots,) = forest.extend_rows([branch], [[5]], [1])
    assert slots.tolist() == [0]
