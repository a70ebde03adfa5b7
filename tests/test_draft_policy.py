"""The per-round draft-length policy: speculate as much as pays off, and not at all when it does not."""

from __future__ import annotations

from dataclasses import replace

import pytest

import runtime
from export.pipeline import build_artifact
from runtime import speculative
from runtime.draft_policy import DraftPolicy
from tests.conftest import set_costs, tiny_recipe

SCORES = {1: 11.0, 2: 11.5, 3: 12.0, 4: 12.5}  # ms: scoring k+1 tokens costs about one decode step


def policy(**kw) -> DraftPolicy:
    args = dict(score_ms=SCORES, decode_ms=10.0, dlm_step_ms=1.0) | kw
    return DraftPolicy(**args)


def feed(p: DraftPolicy, accepted_fraction: float, rounds: int = 50, k: int = 4) -> None:
    """Three plain steps (the first of a generation is cold, not measured; two are measured before
    drafting), then rounds with this acceptance, each costing what the policy expects."""
    for _ in range(3):
        p.observe(0, 0, p.cost[0])
    for i in range(rounds):
        n = round(accepted_fraction * k) if i % 2 else int(accepted_fraction * k)
        p.observe(k, n, p.cost[k])


def test_expected_tokens_is_the_closed_form():
    p = policy()
    feed(p, 0.5)
    a = p.acceptance
    for k in range(5):
        assert p.expected_tokens(k) == pytest.approx(sum(a**i for i in range(k + 1)))


def test_high_acceptance_drafts_the_most_low_acceptance_decodes_plainly():
    good, bad = policy(), policy()
    feed(good, 1.0)
    feed(bad, 0.0)
    assert good.choose(limit=100) == 4
    assert bad.choose(limit=100) == 0


def test_the_first_round_measures_a_plain_step_when_costs_adapt():
    fresh, frozen = policy(), policy(adapt_costs=False)
    assert fresh.choose(100) == 0 and frozen.choose(100) > 0
    fresh.observe(0, 0, 10.0)  # cold: measured again
    assert fresh.choose(100) == 0
    fresh.observe(0, 0, 12.0)
    assert fresh.choose(100) == 0  # two warm plain steps before the first draft
    fresh.observe(0, 0, 10.0)
    assert fresh.cost[0] == 10.0  # a faster plain step counts at once
    assert fresh.choose(100) > 0  # prior acceptance 0.5 and cheap scoring: drafting pays


def test_a_costly_scoring_call_or_draft_model_turns_drafting_off():
    pricey = policy(score_ms={k: 10.0 * (k + 1) for k in SCORES})  # scoring costs k+1 decode steps
    feed(pricey, 0.75)
    assert pricey.choose(100) == 0
    slow_dlm = policy(dlm_step_ms=9.0)
    feed(slow_dlm, 0.5)
    assert slow_dlm.choose(100) == 0


def test_the_choice_maximises_the_rate_and_respects_the_limit():
    p = policy()
    feed(p, 0.6)
    best = p.choose(100)
    assert p.rate(best) == max(p.rate(k) for k in (0, *SCORES))
    assert p.choose(limit=2) <= 2 and p.choose(limit=0) == 0


def test_each_kind_of_draft_has_its_own_acceptance():
    """Prompt lookup's 1-token matches fail where its 3-token matches hold: estimated apart, the policy
    drafts the good kind and not the poor one; estimated together (one kind), it drafts on both."""
    # free drafts, as a lookup's; no plain steps re-measured in between
    apart, together = (policy(independent=False, dlm_step_ms=0.0, remeasure_every=1000) for _ in range(2))
    for p in apart, together:
        for _ in range(3):
            p.observe(0, 0, p.cost[0])
    for i in range(60):
        kind, accepted = (1, 0) if i % 2 else (3, 4)
        for p, as_kind in ((apart, kind), (together, 0)):
            p.choose(4, kind=as_kind)  # names the round's kind; it drafts 4 whatever the choice, to feed
            p.observe(4, accepted, p.cost[4])  # both estimates alike
    assert apart.choose(4, kind=1) == 0 and apart.choose(4, kind=3) > 0
    assert together.choose(4) > 0  # one estimate (0.5): it drafts on every match, the poor ones too
    apart.new_generation()
    assert apart.choose(4, kind=1) == 0 and apart.choose(4, kind=3) > 0  # kept, halved, across generations


def test_a_slow_plain_step_after_drafting_spaces_the_probes_out():
    """The plain step after a drafting round runs a session that sat idle: its extra time is part of
    what a probe costs, so probes grow further apart (here 5 ms over a 10 ms step: twice the gap)."""
    p = policy()
    feed(p, 0.0)  # drafting hopeless: only probes draft
    gap = p._probe_gap(1)
    for _ in range(20):
        p.observe(1, 0, p.cost[1])
        p.observe(0, 0, p.cost[0] + 5.0)  # cold: not a measurement of plain decoding
        p.observe(0, 0, p.cost[0])
    assert p.rewarm == pytest.approx(5.0, rel=0.05) and p.cost[0] == 10.0
    assert p._probe_gap(1) > 1.5 * gap


def test_acceptance_counts_the_drafts_the_target_judged():
    """i.i.d. acceptance a: a round stops at its first rejection, so the drafts after it say nothing.
    Estimated over tested drafts it converges to a; over drafted ones it would read ~0.59 for 0.8."""
    import numpy as np

    rng = np.random.default_rng(0)
    p, lookup = policy(prior_weight=1e-9), policy(prior_weight=1e-9, independent=False)
    for _ in range(4000):
        n = 0
        while n < 4 and rng.random() < 0.8:
            n += 1
        p.observe(4, n, p.cost[4])
        lookup.observe(4, n, lookup.cost[4])
    assert p.acceptance == pytest.approx(0.8, abs=0.015)
    # a lookup's untested drafts count as rejected (its drafts are right or wrong together)
    assert lookup.acceptance == pytest.approx(0.59, abs=0.02)


def test_a_probe_near_break_even_drafts_the_length_that_settles_it():
    """Scoring calls dear enough that the prior (0.5) does not draft: the probe takes the best-rate k,
    and one fully accepted probe makes drafting pay; where drafting looks hopeless it probes 1 token."""
    scores = {1: 18.0, 2: 21.0, 3: 21.0, 4: 25.0}  # ms, against a 10 ms plain step

    def first_probe(p: DraftPolicy) -> int:
        for _ in range(3):
            p.observe(0, 0, p.cost[0])
        for _ in range(5):
            if k := p.choose(100):
                return k
            p.observe(0, 0, p.cost[0])
        raise AssertionError("no probe")

    p = policy(score_ms=scores, dlm_step_ms=0.3, probe_every=2, probe_share=1.0)
    k = first_probe(p)
    assert k == max((1, 2, 3, 4), key=p.rate) > 1
    p.observe(k, k, p.cost[k])  # every draft accepted
    assert p.choose(100) > 0
    # a lookup's drafts stand or fall together: its probe stays one token long
    assert first_probe(policy(score_ms=scores, dlm_step_ms=0.0, probe_every=2, probe_share=1.0, independent=False)) == 1
    hopeless = policy(score_ms={k: 10.0 * (k + 1) for k in SCORES}, probe_every=2, probe_share=1.0)
    feed(hopeless, 0.0)
    assert [hopeless.choose(100) for _ in range(3)] == [0, 0, 1]


def test_plain_rounds_are_followed_by_probes_that_back_off():
    p = policy(probe_every=3, probe_share=1.0)  # probes cheap enough for the count alone to decide
    feed(p, 0.0)
    picks = [p.choose(100) for _ in range(11)]
    assert picks == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1]
    p.new_generation()
    assert p.wait == 3  # a new text gets probed as soon as the first one was


@pytest.mark.parametrize("share", [0.02, 0.1])
def test_probes_cost_a_bounded_share_of_the_time_when_drafting_never_pays(share):
    """Short generations reset the back-off; without the share bound, probes every 1, 2, 4, ...
    plain rounds would cost ~8% here."""
    p = policy(score_ms={k: 10.0 * (k + 1) for k in SCORES}, probe_every=1, probe_share=share)
    feed(p, 0.0)
    spent, probes, rounds = 0.0, 0, 3000
    for i in range(rounds):
        if i % 100 == 0:
            p.new_generation()
        k = p.choose(100)
        probes += k > 0
        spent += p.cost[k]
        p.observe(k, 0, p.cost[k])
    assert probes >= 20  # it keeps looking, every generation
    # A plain decode step per token is the baseline. The bound holds for the policy's acceptance
    # estimate, which each new generation pulls back toward the prior (it halves the evidence).
    assert spent / (rounds * p.cost[0]) - 1 <= 1.25 * share


def test_a_plain_step_measured_in_a_slow_spell_is_measured_again():
    p = policy(score_ms={k: 10.0 * (k + 1) for k in SCORES})  # drafting never pays at true costs
    feed(p, 0.0)
    p.observe(0, 0, 1000.0)  # the machine stalled during a plain step: plain now looks 50x dearer
    p.observe(0, 0, 1000.0)
    picks = []
    for _ in range(100):
        k = p.choose(100)
        picks.append(k)
        p.observe(k, 0, 10.0 if k == 0 else p.cost[k])
    assert picks[0] > 0 and picks[-50:].count(0) >= 48  # it drafted a while, measured again (probes aside)
    stuck = policy(score_ms={k: 10.0 * (k + 1) for k in SCORES}, remeasure_every=10**9)
    feed(stuck, 0.0)
    stuck.observe(0, 0, 1000.0)
    stuck.observe(0, 0, 1000.0)
    assert all(stuck.choose(100) > 0 for _ in range(100))  # the control: never re-measured


def test_drafting_must_be_predicted_clearly_faster():
    p, eager = policy(), policy(margin=0.0)
    for q in (p, eager):
        feed(q, 0.5)
        q.cost[0] = 1.03 / q.rate(4)  # drafting 4 tokens is predicted 3% faster than plain decoding
        q.cost.update({k: 1e9 for k in (1, 2, 3)})
    assert eager.choose(100) == 4 and p.choose(100) == 0
    p.cost[0] *= 1.1
    assert p.choose(100) == 4


def test_cold_plain_steps_are_not_measured():
    """The first plain step of a generation, and one right after drafting, ran an idle decode session."""
    p = policy()
    assert p.choose(100) == 0
    p.observe(0, 0, 50.0)  # cold: first of the generation
    assert 0 not in p.measured and p.choose(100) == 0  # so it measures again
    p.observe(0, 0, 10.0)
    assert p.cost[0] == 10.0
    p.observe(0, 0, 10.0)
    p.observe(4, 4, p.cost[4])
    p.observe(0, 0, 50.0)  # right after drafting: cold again
    assert p.cost[0] == 10.0
    p.observe(0, 0, 20.0)  # a plain step after a plain step counts
    assert p.cost[0] == pytest.approx(10.0 + p.smoothing * 10.0)


def test_a_probe_is_charged_its_drafters_catch_up():
    """A DLM that must prefill every plain step's token before a probe makes probes rarer."""
    def probes(catch_up_ms: float) -> int:
        p = policy(score_ms={k: 10.0 * (k + 1) for k in SCORES}, probe_every=1)  # drafting never pays
        feed(p, 0.0)
        n = 0
        for _ in range(3000):
            k = p.choose(100)
            n += k > 0
            p.observe(k, 0, p.cost[k], catch_up_ms if k else 0.0)
        return n
    assert probes(0.0) >= 2 * probes(200.0) >= 4  # the first probe's catch-up is cold: not charged


def test_a_cold_rounds_catch_up_does_not_price_probes():
    """The first drafting round's catch-up opens the drafter's sessions (a first DLM prefill): charged
    to every later probe, it spaced them so far apart that a good draft model went unused."""
    def gap_after(catch_ups: list[float]) -> float:
        p = policy(score_ms={k: 10.0 * (k + 1) for k in SCORES})
        feed(p, 0.0, rounds=0)
        for catch_up in catch_ups:  # rounds of k = 1, each after a catch-up
            p.observe(1, 0, p.cost[1], catch_up)
        return p._probe_gap(1)
    assert gap_after([500.0]) == gap_after([0.0])  # cold: not charged
    assert gap_after([500.0, 500.0]) > gap_after([500.0, 0.0]) + 100  # the control: a warm one is


def test_a_first_measurement_rescales_the_unmeasured_estimates():
    p = policy()
    p.observe(0, 0, 10.0)
    before = dict(p.cost)
    p.observe(4, 2, 30 * before[4])  # the first round of a draft length is cold: not measured
    assert p.cost == before
    p.observe(4, 2, 3 * before[4])  # drafting costs three times what the manifest suggested
    assert p.cost == before  # one round can be a spike: it waits for a second
    p.observe(4, 2, 3.2 * before[4])
    assert p.cost[4] == pytest.approx(3 * before[4])  # the faster of the two
    assert p.cost[1] == pytest.approx(3 * before[1]) and p.cost[0] == 10.0


def test_one_slow_round_does_not_stop_a_draft_that_pays():
    """A draft length's first warm round took 4x the others once (stdlib-wide-spd: 7.6 ms against
    ~1.9): taken as its cost, drafting stopped for the rest of the generation."""
    def drafting_rounds(slow: int) -> int:
        p = policy(score_ms={k: 11.0 for k in SCORES})
        for _ in range(3):
            p.observe(0, 0, 10.0)
        p.observe(1, 1, 11.0)  # cold: the first round of k = 1
        times = iter([44.0] * slow + [11.0] * 200)
        n = 0
        for _ in range(100):
            k = p.choose(1)
            n += k > 0
            p.observe(k, k, next(times) if k else 10.0)
        return n
    assert drafting_rounds(1) >= 90 and drafting_rounds(2) < 20  # the control: two slow rounds are believed


def test_the_adaptive_policy_is_kept_on_the_artifact(artifact_dir):
    art = runtime.load_artifact(artifact_dir)
    runtime.generate(art, [0, 5, 6], max_new_tokens=10, speculative=True)
    kept = art.policies[("draft",)]
    assert 0 in kept.measured
    tested = kept.tested
    runtime.generate(art, [0, 5, 6], max_new_tokens=10, speculative=True)
    assert art.policies[("draft",)] is kept and kept.tested >= tested // 2
    runtime.generate(art, [0, 5, 6], max_new_tokens=10, speculative=True, draft_length=2, do_sample=True, seed=1)
    assert art.policies == {("draft",): kept}  # fixed or sampled runs get their own


def test_fixed_draft_length_and_costs_that_follow_measurements():
    p = policy(fixed=3)
    feed(p, 0.0)
    assert p.choose(100) == 3 and p.choose(2) == 2
    with pytest.raises(ValueError, match="not compiled"):
        policy(fixed=5)
    adapting, frozen = policy(), policy(adapt_costs=False)
    expected = frozen.cost[4]
    assert expected == SCORES[4] + 5 * 1.0  # scoring plus k drafting steps and a catch-up step
    for q in (adapting, frozen):
        q.observe(4, 4, 500.0)  # cold: not measured
        q.observe(4, 4, 50.0)
        q.observe(4, 4, 60.0)
    # a first measurement (the faster of two rounds) replaces the estimate
    assert adapting.cost[4] == 50.0 and frozen.cost[4] == expected
    adapting.observe(4, 4, 40.0)
    assert adapting.cost[4] == pytest.approx(48.0)  # later ones are averaged in (smoothing 0.2)


def test_unmeasured_costs_fall_back_to_the_usual_assumption():
    p = DraftPolicy({1: 0.0, 3: 0.0}, decode_ms=0.0, dlm_step_ms=None)
    assert p.cost == pytest.approx({0: 1.0, 1: 1.2, 3: 1.4})  # score = one decode step, DLM step = 0.1


def test_cli_fixes_the_draft_length(artifact_dir):
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "runtime", str(artifact_dir), "--prompt", "def", "--max-new-tokens",
                           "12", "--speculative", "--draft-length", "2"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "draft lengths {2:" in proc.stdout


class StillCosts(DraftPolicy):
    """The policy with the manifest's costs only: tiny models' wall times are all overhead and noise
    (on a busy machine a plain step can time slower than a drafting round), which is not what is
    tested here."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.adapt_costs = False


def test_a_useless_draft_model_falls_back_to_plain_decoding(checkpoints, tmp_path, monkeypatch):
    """A draft model unrelated to the target: the policy stops drafting, output stays the TLM's. Costs
    under which drafting pays at the prior acceptance (a DLM step a tenth of a decode step, scoring as
    dear as decoding), so that only the acceptance it measures can stop it."""
    path = build_artifact(replace(tiny_recipe(k=4), speculative=True), tmp_path / "art",
                          tlm=str(checkpoints["llama-gqa"]), dlm=str(checkpoints["qwen2"]), progress=False)
    art = runtime.load_artifact(path)
    set_costs(art, "tlm", lambda t: 1.0)
    set_costs(art, "dlm", lambda t: 0.1)
    monkeypatch.setattr(speculative, "DraftPolicy", StillCosts)
    assert StillCosts({1: 1.0}, 1.0, 0.1).choose(1) == 1  # drafting pays before anything is measured
    prompt = [0, 21, 22, 23]
    sd = runtime.generate(art, prompt, max_new_tokens=60)  # the recipe's default: speculative
    ar = runtime.generate(art, prompt, max_new_tokens=60, speculative=False)
    s = sd.metrics.speculative
    assert sd.token_ids == ar.token_ids
    assert s["acceptance_rate"] < 0.2
    assert 0 < s["rounds"] and s["plain_decode_steps"] > 3 * s["rounds"], s  # it drafted, then stopped
