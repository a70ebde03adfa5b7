"""Speculation in the scheduler and the server: concurrent requests' rounds share the scoring call."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import runtime
from export.pipeline import build_artifact
from runtime.draft_policy import DraftPolicy
from runtime.engine import Engine
from runtime.forest import CapacityError, Forest
from runtime.request import batched_speculation, decoding
from serve.app import create_app
from serve.scheduler import Scheduler
from tests.conftest import always_draft, set_costs, tiny_recipe

# Repeating prompts, so prompt lookup finds matches; one plain request rides along in every batch.
PROMPTS = [[0, *range(40, 52), *range(40, 48)], [0, 9, 8, 7, 6, 9, 8, 7], [0, *range(100, 110), 100, 101]]
PLAIN = [0, 77, 78]
N = 10  # all four requests fit the cache (96 slots) at once


@pytest.fixture(scope="module")
def reference(artifact_dir):
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    return art


def _run(art, spec, decodings, prompts):
    """Submit every prompt at once (the plain one without speculation); return each one's tokens and the stats."""
    scheduler = Scheduler(art)
    try:
        with scheduler._wake:  # all arrive before the first step (its call counts are asserted)
            reqs = [scheduler.submit(p, d, spec=spec) for p, d in zip(prompts, decodings, strict=True)]
            reqs.append(scheduler.submit(PLAIN, decoding(max_new_tokens=N, do_sample=False)))
        out = [[e.token for e in r.events() if e.token is not None] for r in reqs]
    finally:
        scheduler.close()
    return out, scheduler.stats


@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
def test_greedy_speculating_requests_share_calls_and_equal_autoregressive(artifact_dir, reference, method,
                                                                        monkeypatch, fewest_calls):
    monkeypatch.setattr(DraftPolicy, "choose", always_draft)  # the policy is tested below
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    spec = batched_speculation(art, method, 2)
    out, stats = _run(art, spec, [decoding(max_new_tokens=N, do_sample=False)] * len(PROMPTS), PROMPTS)
    for prompt, tokens in zip([*PROMPTS, PLAIN], out, strict=True):
        assert tokens == runtime.generate(reference, prompt, max_new_tokens=N, speculative=False).token_ids
    assert stats["drafted"] > 0 and stats["tokens"] == len(out) * N
    # 3 x (1 + 2 drafts) + 1 rows fit the largest graph: one call per step once the prompts are in
    largest = max(g.tokens for g in art.tlm.graphs.values())
    assert largest >= 10
    prefill = -(-sum(map(len, [*PROMPTS, PLAIN])) // largest)
    assert stats["calls"] <= stats["steps"] - 1 + prefill
    if method == "prompt_lookup":  # greedy tiny models repeat themselves: matches get accepted
        assert stats["accepted"] > 0


@pytest.mark.parametrize("length", [2, None])
@pytest.mark.parametrize("method", ["draft", "prompt_lookup"])
def test_a_sampled_speculating_request_equals_its_single_generation(artifact_dir, method, length):
    """Same seed, same draft length (or both chosen per round, by the compiler's costs and the request's own
    acceptance alone): the same random draws in the same order, so the same tokens as generate(speculative=
    method) alone, while other requests share its calls. Costs under which drafting pays at the prior."""
    art, alone_art = runtime.load_artifact(artifact_dir), runtime.load_artifact(artifact_dir)
    for a in (art, alone_art):
        a.eos_token_ids = frozenset()
        set_costs(a, "tlm", lambda t: 1.0)
        set_costs(a, "dlm", lambda t: 0.1)
    spec = batched_speculation(art, method, length)
    kw = dict(do_sample=True, temperature=0.9, top_k=40)
    out, stats = _run(art, spec, [decoding(max_new_tokens=N, seed=5 + i, **kw) for i in range(len(PROMPTS))],
                      PROMPTS)
    extra = dict(prompt_lookup=dict(max_draft=2)) if method == "prompt_lookup" and length else {}
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, out[:-1], strict=True)):
        alone = runtime.generate(alone_art, prompt, max_new_tokens=N, seed=5 + i, speculative=method,
                                 draft_length=length, **kw, **extra)
        assert tokens == alone.token_ids
        assert alone.metrics.speculative["drafted"] > 0
    assert stats["drafted"] > 0


def test_the_cache_reserves_room_for_drafts(artifact_dir):
    art = runtime.load_artifact(artifact_dir)
    c = art.manifest.context_length
    scheduler = Scheduler(art)
    try:
        prompt = list(range(10))
        fits = decoding(max_new_tokens=c - len(prompt))  # exactly the cache without speculation
        scheduler.submit(prompt, fits).events().__next__()
        with pytest.raises(CapacityError, match="3 drafts"):
            scheduler.submit(prompt, fits, spec=batched_speculation(art, "draft", 3))
    finally:
        scheduler.close()


@pytest.mark.parametrize("kw, word", [
    (dict(speculative="lookahead", draft_length=2), "draft_length applies"),
    (dict(speculative="draft", draft_length=5), "not compiled"),
    (dict(speculative="bogus"), "is not one of"),
    (dict(speculative="prompt_lookup", draft_length=13), "largest is T = 13"),
    (dict(speculative=False, draft_length=2), "not autoregressive"),
])
def test_bad_speculation_is_refused_clearly(reference, kw, word):
    with pytest.raises(ValueError, match=word):
        batched_speculation(reference, kw["speculative"], kw.get("draft_length"))


def test_the_server_speculates_on_request_and_reports_acceptance(artifact_dir, reference, monkeypatch):
    monkeypatch.setattr(DraftPolicy, "choose", always_draft)  # measured costs vary by machine
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    with TestClient(create_app(art, name="tiny")) as client:
        for method in ("prompt_lookup", "draft", "none"):
            r = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": N, "temperature": 0,
                                                     "speculation": method, "draft_length": 2})
            if method == "none":  # a draft length without a method is a contradiction, not ignored
                assert r.status_code == 400 and "draft_length" in r.json()["error"]["message"]
                continue
            assert r.status_code == 200
            want = runtime.generate(reference, PROMPTS[1], max_new_tokens=N, speculative=False).text
            assert r.json()["choices"][0]["text"] == want
        r = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": N, "temperature": 0,
                                                 "speculation": "lookahead"})  # its own window per request
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        metrics = client.get("/metrics").text
    drafted = float(next(x for x in metrics.splitlines() if x.startswith("mxspd_drafted_tokens_total")).split()[1])
    rate = float(next(x for x in metrics.splitlines() if x.startswith("mxspd_acceptance_rate")).split()[1])
    assert drafted > 0 and 0 < rate <= 1


def test_a_server_without_a_draft_model_refuses_draft_speculation(checkpoints, tmp_path):
    path = build_artifact(tiny_recipe(dlm=None), tmp_path / "tlm-only", tlm=str(checkpoints["llama-gqa"]),
                          progress=False)
    art = runtime.load_artifact(path)
    with pytest.raises(Exception, match="no draft model"):
        create_app(art, speculation="draft")
    with TestClient(create_app(art)) as client:
        r = client.post("/v1/completions", json={"prompt": [0, 5], "max_tokens": 3, "speculation": "draft"})
        assert r.status_code == 400 and "no draft model" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"prompt": [0, 5, 0, 5], "max_tokens": 3,
                                                 "speculation": "prompt_lookup", "draft_length": 2})
        assert r.status_code == 200


def test_a_failing_step_fails_its_requests_and_the_scheduler_keeps_serving(artifact_dir, reference, monkeypatch):
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    real, failures = Forest.extend_rows, []

    def flaky(self, *args, **kwargs):
        if self.runner is art.dlm and not failures:  # the first drafting call breaks
            failures.append(1)
            raise RuntimeError("injected")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Forest, "extend_rows", flaky)
    monkeypatch.setattr(DraftPolicy, "choose", always_draft)
    scheduler = Scheduler(art)
    try:
        req = scheduler.submit(PROMPTS[1], decoding(max_new_tokens=N, do_sample=False),
                               spec=batched_speculation(art, "draft", 2))
        events = [req.queue.get(timeout=60)]  # a timeout fails the test (a dead thread would hang it)
        while events[-1].finish is None:
            events.append(req.queue.get(timeout=60))
        assert events[-1].finish == "error" and "injected" in events[-1].error
        after = scheduler.submit(PROMPTS[1], decoding(max_new_tokens=N, do_sample=False),
                                 spec=batched_speculation(art, "draft", 2))
        tokens = [e.token for e in after.events() if e.token is not None]
    finally:
        scheduler.close()
    assert tokens == runtime.generate(reference, PROMPTS[1], max_new_tokens=N, speculative=False).token_ids


@pytest.mark.parametrize("scoring_is_cheap", [True, False])
def test_greedy_requests_draft_only_when_the_costs_say_it_pays(artifact_dir, reference, scoring_is_cheap,
                                                             monkeypatch):
    """Cheap scoring rows and draft steps: greedy requests draft. Rows that cost like whole calls: they
    step plainly, while a sampled request with a fixed draft length keeps it (its tokens must not depend
    on the batch). The output is the same either way. Priced by the compiler's costs alone: a tiny
    model's timed calls are overhead and noise, which is not what is tested here."""
    monkeypatch.setattr(Engine, "price", Engine.compiler_price)
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    set_costs(art, "tlm", (lambda t: 1000.0) if scoring_is_cheap else (lambda t: 1000.0 * t))
    set_costs(art, "dlm", (lambda t: 1.0) if scoring_is_cheap else (lambda t: 1000.0))
    out, stats = _run(art, batched_speculation(art, "draft"), [decoding(max_new_tokens=N, do_sample=False)] * 2,
                      PROMPTS[:2])
    for prompt, tokens in zip([*PROMPTS[:2], PLAIN], out, strict=True):
        assert tokens == runtime.generate(reference, prompt, max_new_tokens=N, speculative=False).token_ids
    assert (stats["drafted"] > 0) == scoring_is_cheap
    spec = batched_speculation(art, "draft", 2)
    _, stats = _run(art, spec, [decoding(max_new_tokens=N, do_sample=True, seed=1)], PROMPTS[:1])
    assert stats["drafted"] > 0


def test_draft_model_rounds_teach_the_policy_only_their_judged_drafts(artifact_dir, monkeypatch):
    """A draft-model round stops at its first rejection: the drafts after it are not evidence."""
    from runtime.draft_policy import judged

    monkeypatch.setattr(DraftPolicy, "choose", always_draft)
    seen = []
    observe = DraftPolicy.observe
    monkeypatch.setattr(DraftPolicy, "observe", lambda self, rounds, step_ms: (
        seen.extend((judged(d, a, self.independent), a) for _, d, a in rounds), observe(self, rounds, step_ms)))
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    _, stats = _run(art, batched_speculation(art, "draft"), [decoding(max_new_tokens=N, do_sample=False)] * 2,
                    PROMPTS[:2])
    tested = sum(t for t, _ in seen)
    assert sum(a for _, a in seen) == stats["accepted"] and stats["accepted"] <= tested <= stats["drafted"]
    assert tested < stats["drafted"] or stats["accepted"] == stats["drafted"]  # rejections left drafts unjudged


@pytest.mark.parametrize("module, args, word", [
    ("serve.app", ["--threads", "0"], "--threads: must be >= 1"),
    ("serve.app", ["--max-queue", "-3"], "--max-queue: must be >= 1"),
    ("serve.ray_serve", ["--replicas", "0"], "--replicas: must be >= 1"),
])
def test_server_clis_refuse_bad_numbers(artifact_dir, module, args, word, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main([str(artifact_dir), *args])
    assert exit_info.value.code == 2 and word in capsys.readouterr().err


def test_the_server_cli_refuses_draft_speculation_without_a_draft_model(checkpoints, tmp_path, capsys):
    from serve.app import main

    path = build_artifact(tiny_recipe(dlm=None), tmp_path / "tlm-only", tlm=str(checkpoints["llama-gqa"]),
                          progress=False)
    with pytest.raises(SystemExit) as exit_info:
        main([str(path), "--speculation", "draft"])
    assert exit_info.value.code == 2 and "no draft model" in capsys.readouterr().err
