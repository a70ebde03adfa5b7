"""The one draft policy and its cost model: speculate as much as pays off, and not at all when it does not."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import runtime
from export.pipeline import build_artifact
from runtime.call_costs import GraphCosts
from runtime.draft_policy import DraftPolicy, judged
from runtime.engine import Engine, engine_of
from tests.conftest import set_costs, tiny_recipe

TLM = {1: 10.0, 2: 11.0, 3: 11.5, 4: 12.0, 5: 12.5}  # ms of a call of that many rows: scoring k+1 ~ a decode step


class Prices:
    """price(role, rows) for a policy: the TLM's calls by rows (past 5 rows, 0.5 ms a row more), the DLM's
    `dlm(rows)` (default 1 ms a call)."""

    def __init__(self, tlm: dict[int, float] | None = None, dlm=lambda rows: 1.0) -> None:
        self.tlm, self.dlm = dict(TLM if tlm is None else tlm), dlm

    def __call__(self, role: str, rows: int, warm: bool = True) -> float:
        if role == "dlm":
            return self.dlm(rows)
        top = max(self.tlm)
        return self.tlm[rows] if rows <= top else self.tlm[top] + 0.5 * (rows - top)


def policy(method: str = "draft", tlm: dict[int, float] | None = None, dlm=lambda rows: 1.0, **kw) -> DraftPolicy:
    return DraftPolicy(method, Prices(tlm, dlm), [1, 2, 3, 4], **kw)


def single(p: DraftPolicy, k: int) -> float:
    """ms of a step of one request drafting k."""
    return p.cost(k, k, 1 if k else 0)


def judged_so_far(p: DraftPolicy) -> float:
    """The drafts judged so far, over every kind."""
    return sum(t for t, _ in p.counts.values())


def rate(p: DraftPolicy, k: int, kind: int = 0) -> float:
    return p.expected_tokens(k, kind) / single(p, k)


def feed(p: DraftPolicy, accepted_fraction: float, rounds: int = 50, k: int = 4) -> None:
    """Three plain steps (the first is cold; two warm ones are measured before drafting), then rounds
    of k drafts with this acceptance."""
    for _ in range(3):
        p.observe([(0, 0, 0)], single(p, 0))
    for i in range(rounds):
        n = round(accepted_fraction * k) if i % 2 else int(accepted_fraction * k)
        p.observe([(0, k, n)], single(p, k))


def test_expected_tokens_is_the_closed_form():
    p = policy()
    feed(p, 0.5)
    a = p.acceptance()
    for k in range(5):
        assert p.expected_tokens(k) == pytest.approx(sum(a**i for i in range(k + 1)))
    look = policy("lookahead", window=8)
    assert look.expected_tokens(1) == 1 + look.acceptance() and look.expected_tokens(0) == 1


def test_high_acceptance_drafts_the_most_low_acceptance_decodes_plainly():
    good, bad = policy(), policy()
    feed(good, 1.0)
    feed(bad, 0.0)
    assert good.choose([(0, 100)]) == [4]
    assert bad.choose([(0, 100)]) == [0]


def test_the_first_steps_are_plain_when_costs_adapt():
    fresh, frozen = policy(), policy(adapt=False)
    assert fresh.choose([(0, 100)]) == [0] and frozen.choose([(0, 100)])[0] > 0
    fresh.observe([(0, 0, 0)], 10.0)  # cold (the first): measured again
    assert fresh.choose([(0, 100)]) == [0]
    fresh.observe([(0, 0, 0)], 10.0)
    assert fresh.choose([(0, 100)]) == [0]  # two warm plain steps before the first draft
    fresh.observe([(0, 0, 0)], 10.0)
    assert fresh.choose([(0, 100)])[0] > 0  # prior acceptance 0.5 and cheap scoring: drafting pays


def test_a_sampled_requests_policy_learns_nothing_from_time():
    """Its choices may depend on its seeded acceptances alone: no step's wall time enters (the server's
    steps carry other requests' rows)."""
    frozen, adapting = policy(adapt=False), policy()
    for p in frozen, adapting:
        feed(p, 0.0)
        p.observe([(0, 1, 0)], 12.0)
        p.observe([(0, 0, 0)], 999.0)  # a slow plain step right after drafting
    assert frozen.rewarm == 0.0 and adapting.rewarm > 100.0  # the control: a greedy one prices its probes so


def test_a_costly_scoring_call_or_draft_model_turns_drafting_off():
    pricey = policy(tlm={r: 10.0 * r for r in TLM})  # scoring k+1 rows costs k+1 decode steps
    feed(pricey, 0.75)
    assert pricey.choose([(0, 100)]) == [0]
    slow_dlm = policy(dlm=lambda rows: 9.0)
    feed(slow_dlm, 0.5)
    assert slow_dlm.choose([(0, 100)]) == [0]


def test_the_choice_maximises_the_rate_and_respects_what_is_offered():
    p = policy()
    feed(p, 0.6)
    (best,) = p.choose([(0, 100)])
    assert rate(p, best) == max(rate(p, k) for k in (0, 1, 2, 3, 4))
    assert p.choose([(0, 2)])[0] <= 2 and p.choose([(0, 0)]) == [0]
    assert policy(fixed=3).choose([(0, 100)]) == [3] and policy(fixed=3).choose([(0, 2)]) == [2]
    with pytest.raises(ValueError, match="not compiled"):
        policy(fixed=5)


def test_each_kind_of_draft_has_its_own_acceptance():
    """Prompt lookup's 1-token matches fail where its 3-token matches hold: estimated apart, the policy
    drafts the good kind and not the poor one; estimated together (one kind), it drafts on both."""
    apart, together = (policy("prompt_lookup", dlm=lambda rows: 0.0, remeasure_every=1000) for _ in range(2))
    for p in apart, together:
        feed(p, 0.0, rounds=0)
    for i in range(60):
        kind, accepted = (1, 0) if i % 2 else (3, 4)
        apart.observe([(kind, 4, accepted)], single(apart, 4))
        together.observe([(0, 4, accepted)], single(together, 4))
    assert apart.choose([(1, 4)]) == [0] and apart.choose([(3, 4)])[0] > 0
    assert together.choose([(0, 4)])[0] > 0  # one estimate (0.5): it drafts on every match, the poor ones too
    apart.new_generation()
    assert apart.choose([(1, 4)]) == [0] and apart.choose([(3, 4)])[0] > 0  # kept, halved, across requests


def test_in_a_batch_the_likely_kinds_draft_and_the_poor_ones_step_plainly():
    """One step, two requests: a sure table guess drafts, a 1-token match (right 10% of the time) does not,
    where pooling them would have drafted both or neither."""
    p = policy("prompt_lookup", dlm=lambda rows: 0.0, priors={1: 0.1, 109: 0.9})
    feed(p, 0.0, rounds=0)
    assert p.choose([(1, 4), (109, 4)], rows=2, live=2) == [0, 4]
    assert p.choose([(1, 4)]) == [0] and p.choose([(109, 4)]) == [4]


def test_alone_it_drafts_and_in_a_full_batch_it_steps_plainly():
    """Weight-bound calls (extra rows nearly free) with 16 rows a call: one request drafts; sixteen
    would need a second call for their drafts, which their expected tokens do not pay for."""
    sublinear = {r: 3.0 + 0.3 * r for r in range(1, 17)}

    def per_call(rows: int) -> float:  # 16 rows a call
        return sum(sublinear[min(16, rows - 16 * i)] for i in range(-(-rows // 16)))

    p = DraftPolicy("draft", lambda role, rows, warm: per_call(rows) if role == "tlm" else 0.1, [1, 2, 3, 4])
    p.plain_wanted = 0
    p.counts[0] = [40, 30]  # acceptance 0.73
    assert p.choose([(0, 4)])[0] >= 3
    assert p.choose([(0, 4)] * 16, rows=16, live=16) == [0] * 16
    linear = DraftPolicy("draft", lambda role, rows, warm: 1.0 * rows if role == "tlm" else 0.1, [1, 2, 3, 4])
    linear.plain_wanted = 0
    linear.counts[0] = [40, 30]
    assert linear.choose([(0, 4)]) == [0]  # compute-bound: a row costs a step


def test_a_slow_plain_step_after_drafting_spaces_the_probes_out():
    """The plain step after a drafting round runs a session that sat idle: its extra time is part of
    what a probe costs, so probes grow further apart (here 5 ms over a 10 ms step: twice the gap)."""
    p = policy()
    feed(p, 0.0)  # drafting hopeless: only probes draft
    gap = p._probe_gap(1, p._likeliest([(0, 4)]), 1, single(p, 0))
    for _ in range(20):
        p.observe([(0, 1, 0)], single(p, 1))
        p.observe([(0, 0, 0)], single(p, 0) + 5.0)  # right after drafting
        p.observe([(0, 0, 0)], single(p, 0))
    assert p.rewarm == pytest.approx(5.0, rel=0.05)
    assert p._probe_gap(1, p._likeliest([(0, 4)]), 1, single(p, 0)) > 1.5 * gap


def test_acceptance_counts_the_drafts_the_target_judged():
    """i.i.d. acceptance a: a round stops at its first rejection, so the drafts after it say nothing.
    Estimated over tested drafts it converges to a; over drafted ones it would read ~0.59 for 0.8."""
    assert judged(4, 1, True) == 2 and judged(4, 4, True) == 4 and judged(4, 1, False) == 4
    rng = np.random.default_rng(0)
    p, lookup = policy(prior_weight=1e-9), policy("prompt_lookup", prior_weight=1e-9)
    for _ in range(4000):
        n = 0
        while n < 4 and rng.random() < 0.8:
            n += 1
        p.observe([(0, 4, n)], 0.0)
        lookup.observe([(0, 4, n)], 0.0)
    assert p.acceptance() == pytest.approx(0.8, abs=0.015)
    # a lookup's untested drafts count as rejected (its drafts are right or wrong together)
    assert lookup.acceptance() == pytest.approx(0.59, abs=0.02)


def test_a_probe_near_break_even_drafts_the_length_that_settles_it():
    """Scoring calls dear enough that the prior (0.5) does not draft: the probe takes the best-rate k,
    and one fully accepted probe makes drafting pay; where drafting looks hopeless it probes 1 token."""
    dear = {1: 10.0, 2: 18.0, 3: 21.0, 4: 21.0, 5: 25.0}  # ms, against a 10 ms plain step

    def first_probe(p: DraftPolicy) -> int:
        feed(p, 0.0, rounds=0)
        for _ in range(5):
            if k := p.choose([(0, 100)])[0]:
                return k
            p.observe([(0, 0, 0)], single(p, 0))
        raise AssertionError("no probe")

    p = policy(tlm=dear, dlm=lambda rows: 0.3, probe_every=2, probe_share=1.0)
    k = first_probe(p)
    assert k == max((1, 2, 3, 4), key=lambda j: rate(p, j)) > 1
    p.observe([(0, k, k)], single(p, k))  # every draft accepted
    assert p.choose([(0, 100)])[0] > 0
    # a lookup's drafts stand or fall together: its probe stays one token long
    lookup = policy("prompt_lookup", tlm=dear, dlm=lambda rows: 0.0, probe_every=2, probe_share=1.0)
    assert first_probe(lookup) == 1
    hopeless = policy(tlm={r: 10.0 * r for r in TLM}, probe_every=2, probe_share=1.0)
    feed(hopeless, 0.0)
    assert [hopeless.choose([(0, 100)])[0] for _ in range(3)] == [0, 0, 1]


def test_plain_rounds_are_followed_by_probes_that_back_off():
    p = policy(probe_every=3, probe_share=1.0)  # probes cheap enough for the count alone to decide
    feed(p, 0.0)
    picks = [p.choose([(0, 100)])[0] for _ in range(11)]
    assert picks == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1]
    p.new_generation()
    assert p.wait == 3  # a new text gets probed as soon as the first one was


def test_a_busy_batch_forgets_by_turnover_not_by_admission():
    """Alone, a new request halves the evidence and restarts probing; beside 63 live sharers it fades it by
    1/128 and leaves the batch's probing as it was, so 64 admissions (one batch's worth) leave about 0.61 of
    it, where halving at each would have left nothing (2^-64)."""
    p = policy(probe_every=3, probe_share=1.0)
    feed(p, 0.75)
    counted = judged_so_far(p)
    p.wait = 12
    p.new_generation(63)
    assert judged_so_far(p) == pytest.approx(counted * (1 - 1 / 128)) and p.wait == 12
    for _ in range(63):
        p.new_generation(63)
    assert judged_so_far(p) == pytest.approx(counted * (1 - 1 / 128) ** 64) and 0.6 < judged_so_far(p) / counted < 0.61
    before = p.acceptance()
    p.new_generation()
    assert judged_so_far(p) == pytest.approx(counted * (1 - 1 / 128) ** 64 / 2) and p.wait == 3
    assert p.acceptance() == pytest.approx(before, abs=0.05)  # the ratio kept, the weight halved


@pytest.mark.parametrize("share", [0.02, 0.1])
def test_probes_cost_a_bounded_share_of_the_time_when_drafting_never_pays(share):
    """Short generations reset the back-off; without the share bound, probes every 1, 2, 4, ...
    plain rounds would cost ~8% here."""
    p = policy(tlm={r: 10.0 * r for r in TLM}, probe_every=1, probe_share=share)
    feed(p, 0.0)
    spent, probes, rounds = 0.0, 0, 3000
    for i in range(rounds):
        if i % 100 == 0:
            p.new_generation()
        (k,) = p.choose([(0, 100)])
        probes += k > 0
        spent += single(p, k)
        p.observe([(0, k, 0)], single(p, k))
    assert probes >= 20  # it keeps looking, every generation
    # A plain decode step per token is the baseline. The bound holds for the policy's acceptance
    # estimate, which each new generation pulls back toward the prior (it halves the evidence).
    assert spent / (rounds * single(p, 0)) - 1 <= 1.25 * share


def test_drafting_steps_in_a_row_measure_plain_steps_again():
    """A plain step's cost goes stale while drafting (one slow spell would keep plain decoding rated
    dear): after remeasure_every drafting steps, two warm plain steps are measured."""
    p, stuck = policy(remeasure_every=10), policy(remeasure_every=10**9)
    for q in (p, stuck):
        feed(q, 1.0, rounds=0)
        q.counts[0] = [100, 100]
    picks = []
    for _ in range(15):
        (k,) = p.choose([(0, 100)])
        picks.append(k)
        p.observe([(0, k, k)], single(p, k))
    assert picks[:10] == [4] * 10 and picks[10:13] == [0, 0, 0] and picks[13] == 4  # the first after drafting: cold
    assert all(stuck.choose([(0, 100)]) == [4] for _ in range(100))  # the control: never re-measured


def test_drafting_must_be_predicted_clearly_faster():
    p, eager = policy(), policy(margin=0.0)
    for q in (p, eager):
        feed(q, 0.5)
    plain = 1.03 / rate(p, 4)  # drafting 4 tokens predicted 3% faster than plain decoding
    for q in (p, eager):
        q.price.tlm = {1: plain, 2: 1e9, 3: 1e9, 4: 1e9, 5: TLM[5]}
    assert eager.choose([(0, 100)]) == [4] and p.choose([(0, 100)]) == [0]
    p.price.tlm[1] *= 1.1
    assert p.choose([(0, 100)]) == [4]


def test_a_probe_is_charged_its_draft_models_catch_up():
    """A DLM that must prefill every plain step's token before a probe makes probes rarer."""
    def probes(per_row_ms: float) -> int:
        p = policy(tlm={r: 10.0 * r for r in TLM}, dlm=lambda rows: 1.0 + per_row_ms * rows, probe_every=1)
        feed(p, 0.0)
        n = 0
        for _ in range(3000):
            (k,) = p.choose([(0, 100)])
            n += k > 0
            p.observe([(0, k, 0)], single(p, k))
        return n
    assert probes(0.0) >= 2 * probes(20.0) >= 4


def test_sampled_and_fixed_requests_have_their_own_policy_on_compiler_costs(artifact_dir):
    """Greedy requests share the engine's policy, kept across requests; a sampled one prices by the
    compiler's costs alone (nothing timed may steer it: a seed reproduces a run)."""
    art = runtime.load_artifact(artifact_dir)
    runtime.generate(art, [0, 5, 6], max_new_tokens=10, speculative=True)
    engine = engine_of(art)
    (kept,) = engine.policies.values()
    before = judged_so_far(kept)
    runtime.generate(art, [0, 5, 6], max_new_tokens=10, speculative=True)
    assert list(engine.policies.values()) == [kept] and judged_so_far(kept) >= before // 2
    runtime.generate(art, [0, 5, 6], max_new_tokens=10, speculative=True, draft_length=2, do_sample=True, seed=1)
    assert list(engine.policies.values()) == [kept]  # fixed or sampled runs get their own
    own = engine.policy_for("draft", None, None, greedy=False)
    assert not own.adapt and own.price == engine.compiler_price
    tlm = art.tlm
    tlm.costs.warm = {g: 1000.0 for g in tlm.graphs}  # whatever this process timed
    engine.host_ms = 50.0
    decode = tlm.plan(1)[0][0]
    assert engine.compiler_price("tlm", 1) == (tlm.entries[decode].cost_ms or 1.0)
    calls = len(tlm.plan(2 * engine.forest.max_rows))  # the rows of two of the largest calls
    assert engine.price("tlm", 1) == 1050.0 and calls >= 2 and engine.price("tlm", 2 * engine.forest.max_rows) == \
        calls * 1050.0  # each call as timed, plus the host time per call


def test_the_engine_learns_its_host_time_per_call(artifact_dir):
    art = runtime.load_artifact(artifact_dir)
    engine = engine_of(art)
    runtime.generate(art, [0, 5, 6], max_new_tokens=20, speculative=False)
    # an average of steps' host time per call: above 0 (Python runs around every call), and no step's
    # share can exceed the whole run's busy time (a unit slip of seconds for ms would)
    assert 0 < engine.host_ms < engine.stats["busy_s"] * 1e3


def test_a_graph_is_timed_warm_and_untimed_graphs_follow_the_timed_ones():
    """A call is timed warm when its graph ran in the last step or earlier in this one: the first run and
    one after the graph sat idle are not its steady cost (but count in the typical one, drafting's). A
    first time waits for a second (the faster counts), later ones are averaged in, a faster warm one at
    once; graphs not timed yet are scaled by the last warm-timed one's ratio to its seed; the compiler's
    own costs stay apart."""
    seeds = {"decode": 10.0, "score4": 12.0, "prefill": 0.0}
    c = GraphCosts(lambda g: seeds[g] or 1.0)
    c.new_step()
    c.record("decode", 50.0)  # first: cold
    assert c.ms("decode") == 10.0
    c.new_step()
    c.record("decode", 30.0)  # warm, but one run can be a spike
    c.new_step()
    c.record("decode", 20.0)
    assert c.ms("decode") == 20.0 and c.ms("score4") == pytest.approx(24.0) and c.ms("prefill") == 2.0
    c.new_step()
    c.record("decode", 40.0)
    assert c.ms("decode") == pytest.approx(24.0)  # averaged in (smoothing 0.2)
    c.new_step()
    c.record("decode", 15.0)
    assert c.ms("decode") == 15.0  # a faster one counts at once
    c.new_step()
    c.record("score4", 100.0)  # decode sat idle this step
    c.new_step()
    c.record("decode", 90.0)  # and is cold now
    assert c.ms("decode") == 15.0
    assert c.ms("decode", adapt=False) == 10.0 and c.ms("prefill", adapt=False) == 1.0
    c.record("decode", 19.0)  # a second call in the same step is warm
    assert c.ms("decode") == pytest.approx(15.8)
    # drafting is priced by every call but a graph's first, idle ones too (30, 20: 20; 40, 15, 90, 19 averaged)
    assert c.ms("decode", warm=False) == pytest.approx(32.408)
    assert c.ms("score4", warm=False) == pytest.approx(24.0)  # its one call was its first: the warm estimate's
    for ms in (50.0, 60.0):
        c.new_step()
        c.new_step()
        c.record("score4", ms)  # after sitting idle
    assert c.ms("score4", warm=False) == 50.0 == c.ms("score4")  # never warm: the typical time stands in


def test_cli_fixes_the_draft_length(artifact_dir):
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "runtime", str(artifact_dir), "--prompt", "def", "--max-new-tokens",
                           "12", "--speculative", "--draft-length", "2"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "draft lengths {2:" in proc.stdout


def test_a_useless_draft_model_falls_back_to_plain_decoding(checkpoints, tmp_path, monkeypatch):
    """A draft model unrelated to the target: the policy stops drafting, output stays the TLM's. Costs
    under which drafting pays at the prior acceptance (a DLM step a tenth of a decode step, scoring as
    dear as decoding), so that only the acceptance it measures can stop it; the compiler's costs only
    (tiny models' wall times are all overhead and noise, which is not what is tested here)."""
    path = build_artifact(replace(tiny_recipe(k=4), speculative=True), tmp_path / "art",
                          tlm=str(checkpoints["llama-gqa"]), dlm=str(checkpoints["qwen2"]), progress=False)
    art = runtime.load_artifact(path)
    set_costs(art, "tlm", lambda t: 1.0)
    set_costs(art, "dlm", lambda t: 0.1)
    monkeypatch.setattr(Engine, "price", Engine.compiler_price)
    fresh = DraftPolicy("draft", Engine(art).compiler_price, [1, 2, 3, 4], adapt=False)
    assert fresh.choose([(0, 4)])[0] > 0  # drafting pays before anything is measured
    prompt = [0, 21, 22, 23]
    sd = runtime.generate(art, prompt, max_new_tokens=60)  # the recipe's default: speculative
    ar = runtime.generate(art, prompt, max_new_tokens=60, speculative=False)
    s = sd.metrics.speculative
    assert sd.token_ids == ar.token_ids
    assert s["acceptance_rate"] < 0.2
    assert 0 < s["rounds"] and s["plain_decode_steps"] > 3 * s["rounds"], s  # it drafted, then stopped
