"""The engine step (runtime/engine.py): every way of generating through one step, against each sequence alone."""

from __future__ import annotations

import numpy as np
import pytest

import runtime
from runtime.draft_policy import DraftPolicy
from runtime.engine import Engine, engine_of, make_requests
from runtime.request import batched_speculation, decoding
from runtime.round_stats import RoundStats
from runtime.speculative import make_drafter
from tests.conftest import always_draft

N = 12
LONG = [0, *range(20, 60)]  # past several prefill chunks of the largest graph
REPEATS = [0, *range(40, 52), *range(40, 48)]  # prompt lookup finds matches


@pytest.fixture(scope="module")
def art(artifact_dir):
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    return art


def _run(engine: Engine) -> None:
    """Step until every request has finished."""
    while engine.busy:
        engine.admit()
        engine.step()


def _alone(art, prompt, **kw):
    return runtime.generate(art, prompt, max_new_tokens=N, **kw).token_ids


def test_a_mixed_batch_equals_each_sequence_alone(art, monkeypatch):
    """One engine, one batch: a long prompt prefilled in chunks while the others decode, a plain request,
    the server's prompt lookup and draft model (the batch's chains), and a generation's own lookahead drafter
    with its tree and window rows. Every greedy output equals that prompt decoded alone, and the rows of
    several requests shared calls."""
    monkeypatch.setattr(DraftPolicy, "choose", always_draft)
    greedy = decoding(max_new_tokens=N, do_sample=False)
    out: dict[int, list[int]] = {}

    def listen(i):
        return lambda e: out.setdefault(i, []).append(e.token) if e.token is not None else None

    engine = Engine(art, prefix_cache=False)
    specs = [None, None, batched_speculation(art, "prompt_lookup", 2), batched_speculation(art, "draft", 2), None,
             None]
    prompts = [LONG, [0, 77, 78], REPEATS, [0, 9, 8, 7, 6, 9, 8, 7], [0, *range(100, 110), 100, 101],
               [0, 5, 6, 7, 5, 6, 7]]
    reqs = [make_requests(art, p, [greedy], [listen(i)], spec)[0] for i, (p, spec) in enumerate(zip(prompts, specs,
                                                                                                    strict=True))]
    every_round = runtime.request.method_settings(art, "lookahead", {"adaptive": False}, None)  # no timed choice
    for r, method, settings, length in ((reqs[4], "lookahead", every_round, None), (reqs[5], "draft", None, 2)):
        # a generation's own drafters: lookahead's tree and window rows; a draft model drafting with its own
        # (fixed) policy, in the same DLM calls as the server's draft-model request
        r.drafter = make_drafter(art, method, settings, r.decoding.params, r.rng, engine.dlm, engine.stats)
        r.policy = engine.policy_for(method, settings, length, greedy=True)
        r.rounds = RoundStats()
    for r in reqs:
        engine.add([r])
    with art.exclusive():
        _run(engine)
    for i, prompt in enumerate(prompts):
        assert out[i] == _alone(art, prompt, speculative=False), i
    assert engine.stats["drafted"] > 0 and engine.stats["accepted"] > 0
    rounds = reqs[4].rounds  # every token after the first came from a round: its accepted drafts and one more
    assert rounds.delivered == N - 1 <= rounds.accepted + rounds.rounds + rounds.plain_steps and rounds.rounds > 0
    assert reqs[5].rounds.rounds > 0 and reqs[5].drafter.summary()["draft_lengths_used"] == {2: reqs[5].rounds.rounds}
    assert engine.stats["calls"] < engine.stats["steps"] * 2  # rows of every request in a call or two a step
    assert not engine.live and engine.forest.free_slots() == art.manifest.capacity  # all slots back


@pytest.mark.parametrize("method", [False, "prompt_lookup", "lookahead", "draft"])
def test_greedy_steps_without_logits_give_the_same_tokens(art, artifact_dir, method, monkeypatch):
    """A device target's graphs return each row's greedy token (the logits stay on the device): a step whose
    requests are all greedy reads those. Forced here on the CPU (the runner's argmax of its logits), every
    method gives the tokens it gives from the logits."""
    fresh = runtime.load_artifact(artifact_dir)
    fresh.eos_token_ids = frozenset()
    monkeypatch.setattr(fresh.tlm, "greedy_outputs", True)
    fetched = []
    real = fresh.tlm.run_rows

    def spy(graph, tokens, cache_sees, sees, check=True, fetch=True, positions=None):
        fetched.append(fetch)
        return real(graph, tokens, cache_sees, sees, check, fetch, positions)

    monkeypatch.setattr(fresh.tlm, "run_rows", spy)
    prompt = REPEATS
    assert _alone(fresh, prompt, speculative=method) == _alone(art, prompt, speculative=False)
    assert fetched and not any(fetched)  # no call brought logits to the host
    sampled = runtime.generate(fresh, prompt, max_new_tokens=N, do_sample=True, seed=4, speculative=False).token_ids
    assert fetched[-1] and sampled == runtime.generate(art, prompt, max_new_tokens=N, do_sample=True, seed=4,
                                                       speculative=False).token_ids


def test_the_prefix_cache_is_forgotten_when_something_else_writes_the_cache(art):
    """A generation's KV stays for the next (a chat's earlier turns); beam search, `forget()` or another
    writer of the runner's cache makes the engine forget it rather than attend to other tokens' KV."""
    prompt = [0, *range(30, 60)]
    first = runtime.generate(art, prompt, max_new_tokens=N, speculative=False)
    again = runtime.generate(art, prompt + first.token_ids, max_new_tokens=4, speculative=False)
    assert again.metrics.cached_prompt_tokens == len(prompt) + N - 1  # the control: the cache serves
    runtime.beam_search(art, [0, 5, 6], num_beams=2, max_new_tokens=4)  # its own forest over the same slots
    cold = runtime.generate(art, prompt + first.token_ids, max_new_tokens=4, speculative=False)
    assert cold.metrics.cached_prompt_tokens == 0 and cold.token_ids == again.token_ids
    art.tlm.forget()
    assert runtime.generate(art, prompt, max_new_tokens=2).metrics.cached_prompt_tokens == 0


def test_a_stream_closed_early_frees_its_slots(art):
    pieces = runtime.stream(art, [0, *range(60, 80)], max_new_tokens=N, speculative="prompt_lookup")
    next(pieces)
    pieces.close()
    engine = engine_of(art)
    assert not engine.live and not engine.waiting
    assert engine.forest.free_slots() == art.manifest.capacity
    assert np.array_equal(_alone(art, [0, *range(60, 80)], speculative=False),
                          _alone(art, [0, *range(60, 80)], speculative="prompt_lookup"))


def test_an_echo_whose_last_chunk_is_one_token_scores_the_whole_prompt(art):
    """Chunks of the largest graph's rows, then one: the last chunk has no next prompt token to score."""
    engine = Engine(art, prefix_cache=False)
    prompt = [0, *range(100, 100 + engine.forest.max_rows)]  # max_rows + 1 tokens
    req = make_requests(art, prompt, [decoding(max_new_tokens=1, do_sample=False)], [None], logprobs=1, echo=True)[0]
    req.max_new_tokens = 0  # score the prompt only
    engine.add([req])
    with art.exclusive():
        _run(engine)
    events = list(req.events())
    assert events[-1].finish == "length" and len(req.prompt_logprobs) == len(prompt) - 1
    assert [lp.token for lp in req.prompt_logprobs] == prompt[1:]


def test_a_draft_models_nan_ends_only_its_own_request(art, monkeypatch):
    monkeypatch.setattr(DraftPolicy, "choose", always_draft)
    good_prompt, bad_prompt = [0, 9, 8, 7, 6], [0, 201, 202, 203]
    good_out, bad_out = (_alone(art, p, speculative=False) for p in (good_prompt, bad_prompt))
    poison = next(t for t in bad_out[2:] if t not in good_out + good_prompt)  # fed to the DLM by the bad one only
    real = art.dlm.run_rows

    def poisoned(graph, tokens, cache_sees, sees, check=True, fetch=True, positions=None):  # as the draft model would
        logits = real(graph, tokens, cache_sees, sees, False, fetch, positions)
        logits[(np.asarray(tokens) == poison)[-len(logits):]] = np.nan
        return logits

    monkeypatch.setattr(art.dlm, "run_rows", poisoned)
    engine = Engine(art, prefix_cache=False)
    spec = batched_speculation(art, "draft", 2)
    greedy = decoding(max_new_tokens=N, do_sample=False)
    good, bad = (make_requests(art, p, [greedy], [None], spec)[0] for p in (good_prompt, bad_prompt))
    engine.add([good])
    engine.add([bad])
    with art.exclusive():
        _run(engine)
    *tokens, end = list(good.events())
    assert end.finish == "length" and [e.token for e in tokens] == good_out
    *tokens, end = list(bad.events())
    assert end.finish == "error" and "draft model" in end.error and [e.token for e in tokens][-1] == poison


def test_followers_of_a_leader_gone_before_its_prompt_was_in_follow_the_next(art):
    """Three choices of one prompt; the leader is cancelled after admission, before its prompt is in the
    cache: the second choice leads, the third forks its prefilled prompt (the prompt is prefilled once)."""
    engine = Engine(art, prefix_cache=False)
    prompt = [0, *range(60, 80)]
    sampled = [decoding(max_new_tokens=N, do_sample=True, seed=s) for s in (1, 2, 3)]
    reqs = make_requests(art, prompt, sampled, [None] * 3)
    engine.add(reqs)
    with art.exclusive():
        engine.admit()
        reqs[0].cancelled = True
        engine.step()
        assert reqs[2].leader is reqs[1] and reqs[1].leader is None
        while reqs[2].branch is None:
            engine.step()
        assert reqs[2].branch.order[: len(prompt)] == reqs[1].branch.order[: len(prompt)]  # its slots, forked
        _run(engine)
    for r, s in zip(reqs[1:], (2, 3), strict=True):
        assert [e.token for e in r.events() if e.token is not None] == runtime.generate(
            art, prompt, max_new_tokens=N, do_sample=True, seed=s, speculative=False).token_ids


def test_a_server_lookahead_step_runs_whole_when_the_policy_takes_it(art, monkeypatch):
    """A lookahead step is its window and candidates, not a chain of k drafts: its policy's one length (1)
    prices the whole step's rows and runs it whole, as far as the context allows, and its output is the
    prompt's decoded alone."""
    monkeypatch.setattr(DraftPolicy, "choose", always_draft)
    spec = batched_speculation(art, "lookahead")
    engine = Engine(art, prefix_cache=False)
    policy = engine.policy_for(spec.method, spec.settings, spec.fixed, greedy=True)
    assert policy.lengths == [1] and policy.window == spec.k  # a step's rows beyond its root
    out = []
    req = make_requests(art, REPEATS, [decoding(max_new_tokens=N, do_sample=False)],
                        [lambda e: out.append(e.token) if e.token is not None else None], spec)[0]
    engine.add([req])
    with art.exclusive():
        _run(engine)
    assert out == _alone(art, REPEATS, speculative=False)
    assert req.drafter.windows > 0  # window steps ran (before the fix: a length of 1 made every step plain)


def test_the_shared_policy_is_told_how_many_live_requests_share_it(art, monkeypatch):
    """Greedy prompt-lookup requests admitted together (short: the cache holds them all) share one policy; each
    admission is told of those already live (0, 1, 2), so a busy server fades what it learned by turnover
    (test_draft_policy.py)."""
    told: list[int] = []
    monkeypatch.setattr(DraftPolicy, "new_generation", lambda self, others=0: told.append(others))
    greedy = decoding(max_new_tokens=N, do_sample=False)
    engine = Engine(art, prefix_cache=False)
    spec = batched_speculation(art, "prompt_lookup")  # no fixed length: the policy chooses
    prompts = (REPEATS, [0, 9, 8, 7, 9, 8, 7], [0, 5, 6, 5, 6])
    reqs = [make_requests(art, p, [greedy], [lambda e: None], spec)[0] for p in prompts]
    for r in reqs:
        engine.add([r])
    with art.exclusive():
        _run(engine)
    assert told == [0, 1, 2] and len({id(r.policy) for r in reqs}) == 1


def test_only_verified_rounds_teach_the_draft_policy(art, monkeypatch):
    """A drafting request that ends before its round is verified (its target row is NaN) tells the shared
    policy nothing of that round: what the policy learned is what the engine verified, round for round."""
    monkeypatch.setattr(DraftPolicy, "choose", always_draft)
    spec = batched_speculation(art, "draft")  # no fixed length: the shared policy chooses, and learns
    greedy = decoding(max_new_tokens=N, do_sample=False)
    good_prompt, bad_prompt = [0, 9, 8, 7, 6], [0, 201, 202, 203]

    def engine_feeding(fed: set[int], poison: int | None = None) -> Engine:
        """An engine whose target calls add their tokens to `fed`; a row fed `poison` gives NaN logits."""
        engine = Engine(art, prefix_cache=False)
        real = engine.forest._run

        def run(graph, tokens, cache_sees, sees, check, fetch, positions=None):
            fed.update(np.asarray(tokens).tolist())
            out = real(graph, tokens, cache_sees, sees, check, fetch, positions)
            out[(np.asarray(tokens) == poison)[-len(out):]] = np.nan if fetch else -1
            return out

        monkeypatch.setattr(engine.forest, "_run", run)
        return engine

    good_fed: set[int] = set()  # the good request's tokens and drafts, alone (the same in a batch: batch invariance)
    alone = engine_feeding(good_fed)
    alone.add(make_requests(art, good_prompt, [greedy], [None], spec))
    with art.exclusive():
        _run(alone)
    fed_by_bad = _alone(art, bad_prompt, speculative=False)[2:-1]  # its output tokens that it feeds back
    poison = next((t for t in fed_by_bad if t not in good_fed and t not in bad_prompt), None)
    assert poison is not None, "no token the bad request alone feeds the target: choose other prompts"
    engine = engine_feeding(set(), poison)
    good, bad = (make_requests(art, p, [greedy], [None], spec)[0] for p in (good_prompt, bad_prompt))
    learned: list[tuple[int, int, int]] = []
    observe = DraftPolicy.observe
    monkeypatch.setattr(DraftPolicy, "observe",
                        lambda self, rounds, ms: (learned.extend(rounds), observe(self, rounds, ms))[1])
    engine.add([good])
    engine.add([bad])
    with art.exclusive():
        _run(engine)
    assert good.policy is bad.policy  # one shared policy learned every round below
    assert [e.finish for e in good.events() if e.finish] == ["length"]
    (end,) = [e for e in bad.events() if e.finish]
    assert end.finish == "error" and "draft model" not in end.error  # the target's row, mid-generation
    assert sum(d for _, d, _ in learned) == engine.stats["drafted"] > 0
    assert sum(a for _, _, a in learned) == engine.stats["accepted"]
