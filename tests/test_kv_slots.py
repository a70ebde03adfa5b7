"""KV capacity apart from context length: `kv_slots` cache slots shared by a server's requests, each
request still at most `context_length` positions long.

A larger cache changes no bits (batch-invariant attention sums only the keys a row sees), lets the
scheduler run requests together whose summed lengths pass the context length, and still refuses a
single request longer than the context length.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import runtime
from common.recipe import RecipeError, recipe_from_dict
from export.pipeline import build_artifact
from runtime.forest import CapacityError
from runtime.request import decoding
from serve.scheduler import Scheduler
from tests.conftest import recipe_file, tiny_recipe

CONTEXT, SLOTS = 48, 160


@pytest.fixture(scope="module")
def arts(checkpoints, tmp_path_factory):
    """The same TLM built with a cache sized for one sequence and with a larger shared one."""
    out = tmp_path_factory.mktemp("slots")
    built = {}
    for slots in (0, SLOTS):
        recipe = replace(tiny_recipe(dlm=None), context_length=CONTEXT, max_prompt_length=CONTEXT - 1, kv_slots=slots)
        art = runtime.load_artifact(build_artifact(recipe, out / f"s{slots}", tlm=str(checkpoints["llama-gqa"]),
                                                   progress=False))
        art.eos_token_ids = frozenset()  # every request runs its whole max_new_tokens
        built[slots] = art
    return built


def test_recipes_check_kv_slots():
    base = {"name": "x", "tlm": {"model": "m"}, "speculative": False, "context_length": 64, "max_prompt_length": 32}
    assert recipe_from_dict(base).capacity == 64
    assert recipe_from_dict(base | {"kv_slots": 256}).capacity == 256
    with pytest.raises(RecipeError, match="kv_slots"):
        recipe_from_dict(base | {"kv_slots": 32})


def test_a_larger_cache_gives_the_same_bits_and_keeps_the_context_limit(arts):
    small, large = arts[0], arts[SLOTS]
    assert (small.manifest.capacity, large.manifest.capacity) == (CONTEXT, SLOTS)
    assert large.tlm.place.cache[0].shape[2] == SLOTS and large.tlm.max_length == CONTEXT
    prompt = [0, *range(40, 80)]  # 41 tokens: the context ends the generation, not max_new_tokens
    a = runtime.generate(small, prompt, max_new_tokens=30, speculative=False)
    b = runtime.generate(large, prompt, max_new_tokens=30, speculative=False)
    assert b.token_ids == a.token_ids and b.finish_reason == "length" and len(b.token_ids) == CONTEXT - len(prompt) + 1
    with pytest.raises(CapacityError, match="context length"):
        runtime.generate(large, [0, 5, 6], n=3, max_new_tokens=CONTEXT, do_sample=True)


def test_the_scheduler_shares_the_slots_beyond_one_context(arts):
    """Four requests of 39 positions each (156 in all) run together in 160 slots; with 48 slots they
    take turns. Outputs equal each request decoded alone, and one request past the context is refused."""
    prompts = [[0, *range(10 + 10 * i, 29 + 10 * i)] for i in range(4)]  # 20 tokens each
    steps = {}
    for slots, art in arts.items():
        scheduler = Scheduler(art)
        try:
            greedy = decoding(max_new_tokens=20, do_sample=False)
            reqs = [scheduler.submit(p, greedy) for p in prompts]
            out = [[e.token for e in r.events() if e.token is not None] for r in reqs]
            steps[slots] = scheduler.stats["steps"]
            with pytest.raises(CapacityError, match="past the context length"):
                scheduler.submit(prompts[0], decoding(max_new_tokens=CONTEXT, do_sample=False))
        finally:
            scheduler.close()
        for prompt, tokens in zip(prompts, out, strict=True):
            assert tokens == runtime.generate(arts[0], prompt, max_new_tokens=20, speculative=False).token_ids
    assert steps[SLOTS] < 2 * 20 <= 4 * 20 <= steps[0]  # together (whatever step each joins at), or in turn


def test_the_export_cli_sets_kv_slots_for_a_serving_build(checkpoints, tmp_path, capsys):
    from export.__main__ import main

    recipe = recipe_file(tmp_path / "r.toml", checkpoints["llama-gqa"], context=32)
    out = tmp_path / "art"
    assert main(["--recipe", str(recipe), "--kv-slots", "16", "--out", str(out), "--quiet"]) == 2
    assert "kv_slots (16) must hold at least one whole sequence" in capsys.readouterr().err and not out.exists()
    assert main(["--recipe", str(recipe), "--kv-slots", "96", "--out", str(out), "--quiet"]) == 0
    art = runtime.load_artifact(out)
    assert (art.manifest.kv_slots, art.manifest.context_length, art.tlm.place.cache[0].shape[2]) == (96, 32, 96)


@pytest.mark.parametrize("context, visible", [(2048, 128), (96, 48)])
def test_graphs_are_timed_with_a_short_visible_prefix_whatever_the_capacity(context, visible):
    """Attention's cost follows the keys a row sees: the compiler times every graph with at most 128
    of them (half the cache when smaller), so a large serving cache does not make a 9-row call look
    dearer than two 4-row calls, where the weights' cost is what differs."""
    from compiler.costs import visible_slots

    sees = visible_slots(context)
    assert sees.shape == (context,) and sees[:visible].all() and not sees[visible:].any()


def test_the_build_times_each_graph_through_the_runtimes_runner(artifact_dir, monkeypatch):
    """The compiler's costs are the runtime's own calls (ModelRunner.run_rows, its placement's binding), each
    graph's rows seeing the short visible prefix and each other causally."""
    from common.manifest import read_manifest
    from common.targets import get_target
    from compiler.costs import graph_costs_ms
    from runtime.model_runner import ModelRunner

    seen, real = [], ModelRunner.run_rows

    def spy(self, graph, tokens, cache_sees, sees, check=True, fetch=True, positions=None):
        causal = bool((sees == np.tri(len(tokens), dtype=bool)).all())
        seen.append((graph, len(tokens), int(cache_sees.sum()), causal))
        return real(self, graph, tokens, cache_sees, sees, check, fetch, positions)

    monkeypatch.setattr(ModelRunner, "run_rows", spy)
    manifest = read_manifest(artifact_dir)
    entry = manifest.models["tlm"]
    costs = graph_costs_ms(artifact_dir, entry, manifest.capacity, get_target(manifest.target), repeats=2)
    assert set(costs) == set(entry.graphs) and all(ms > 0 for ms in costs.values())
    c = manifest.capacity
    assert sorted(set(seen)) == sorted({(g, e.tokens, min(128, c // 2, c - e.tokens), True)
                                        for g, e in entry.graphs.items()})
    assert len(seen) == 3 * len(entry.graphs)  # a warm round, then two timed
