"""The OpenAI-compatible server: routes, streaming, the openai client, batching, bad input."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi.testclient import TestClient

import runtime
from common import graph_io
from export.pipeline import build_artifact
from recipes.default_pair import byte_tokenizer
from runtime import ArtifactBusyError, NonFiniteLogitsError
from runtime.request import decoding
from serve.app import _Output, _stream, create_app
from serve.scheduler import Event, QueueFullError, Scheduler
from tests.conftest import live_server, tiny_recipe

PROMPTS = [[0, 5, 6, 7], [0, *range(40, 60)], [0, 9], [0, *range(100, 130)], [0, 77, 78], [0, 200, 201, 202]]


@pytest.fixture(scope="module")
def reference(artifact_dir):
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    return art


@pytest.fixture(scope="module")
def served(artifact_dir):
    art = runtime.load_artifact(artifact_dir)  # the server's own: its scheduler holds the runners
    art.eos_token_ids = frozenset()
    art.tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    app = create_app(art, name="tiny")
    with TestClient(app) as client:
        yield art, client


def _greedy(reference, prompt, n):
    return runtime.generate(reference, prompt, max_new_tokens=n, speculative=False)


def test_routes_and_a_greedy_completion_equal_to_generate(served, reference):
    art, client = served
    assert client.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 12,
                                             "temperature": 0}).json()
    assert r["object"] == "text_completion" and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["text"] == _greedy(reference, PROMPTS[1], 12).text
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert r["usage"] == {"prompt_tokens": len(PROMPTS[1]), "completion_tokens": 12, "total_tokens": 33,
                          "prompt_tokens_details": {"cached_tokens": cached}}
    metrics = client.get("/metrics").text
    assert "mxspd_generated_tokens_total" in metrics and "mxspd_queue_depth 0" in metrics


def test_streaming_sends_the_same_text_and_ends_with_done(served, reference):
    _, client = served
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 15, "temperature": 0,
                                                        "stream": True, "stream_options": {"include_usage": True}},
                       ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    *chunks, usage = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == _greedy(reference, PROMPTS[0], 15).text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 15


def test_stop_strings_are_cut_from_the_text(served, reference):
    _, client = served
    full = _greedy(reference, PROMPTS[3], 20).text
    stop = full[8:10]
    for stream in (False, True):
        body = {"prompt": PROMPTS[3], "max_tokens": 20, "temperature": 0, "stop": [stop], "stream": stream}
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as r:
                chunks = [json.loads(x[6:]) for x in r.iter_lines() if x and x != "data: [DONE]"]
            text, finish = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
        assert text == full[: full.index(stop)] and finish == "stop"


def test_concurrent_requests_equal_sequential_runs(served, reference):
    _, client = served

    def post(prompt):
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        return client.post("/v1/completions", json=body).json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(post, PROMPTS))
    assert texts == [_greedy(reference, p, 16).text for p in PROMPTS]


@pytest.mark.parametrize("max_batch", [None, 1])
def test_requests_queued_together_share_calls(artifact_dir, reference, max_batch):
    """Whether concurrent HTTP requests overlap depends on timing (under load they may not); queued while
    the scheduler is held, they run in shared calls: fewer calls than tokens (one request at a time, the
    negative control, takes a call per token at least)."""
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    scheduler = Scheduler(art, max_batch=max_batch)
    try:
        with scheduler._wake:
            requests = [scheduler.submit(list(p), decoding(max_new_tokens=16)) for p in PROMPTS]
        tokens = [[e.token for e in r.events() if e.token is not None] for r in requests]
    finally:
        scheduler.close()
    assert tokens == [_greedy(reference, p, 16).token_ids for p in PROMPTS]
    assert (scheduler.stats["calls"] < len(PROMPTS) * 16) == (max_batch is None)


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_running_streams(artifact_dir, reference, fewest_calls):
    """Chunked prefill: every step is one call (the running requests' rows, then as much of the long
    prompt as the largest graph has room for), so the short requests' first tokens come at the first
    step, and every output equals the request run alone. Negative control: the long prompt fed whole in
    one step (as before chunking) takes several calls in that step."""
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    long_prompt = [0, *range(10, 49)]  # 40 tokens: 5 of the largest graph's 9 rows at once
    jobs = [([0, 5, 6], 12), ([0, 9, 10], 12), (long_prompt, 11)]
    scheduler = Scheduler(art)
    try:
        with scheduler._wake:
            requests = [scheduler.submit(p, decoding(max_new_tokens=n)) for p, n in jobs]
        tokens = [[e.token for e in r.events() if e.token is not None] for r in requests]
    finally:
        scheduler.close()
    assert tokens == [_greedy(reference, p, n).token_ids for p, n in jobs]
    largest = max(g.tokens for g in art.tlm.graphs.values())
    assert largest < len(long_prompt) and scheduler.stats["calls"] == scheduler.stats["steps"]
    assert requests[0].first_token < requests[2].first_token  # a short request did not wait for the long prefill
    assert len(art.tlm.plan(2 + len(long_prompt), largest)) > 1  # unchunked, that step needs several calls


def test_sampled_choices_follow_their_seeds(served, reference):
    _, client = served
    r = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0.8,
                                             "top_k": 50, "seed": 3, "n": 2}).json()
    for i, choice in enumerate(r["choices"]):
        alone = runtime.generate(reference, PROMPTS[2], max_new_tokens=10, do_sample=True, temperature=0.8,
                                 top_k=50, seed=3 + i, speculative=False)
        assert choice["index"] == i and choice["text"] == alone.text


def test_choices_of_one_prompt_share_its_prefill(artifact_dir, reference, fewest_calls):
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    scheduler = Scheduler(art)
    try:
        prompt = PROMPTS[3]  # 31 tokens: several calls of the largest graph if prefilled once per choice
        choices = scheduler.submit_choices(prompt, [decoding(max_new_tokens=6, do_sample=True, seed=9 + i)
                                                    for i in range(3)], [None] * 3)
        texts = [[e.token for e in r.events() if e.token is not None] for r in choices]
    finally:
        scheduler.close()
    for i, tokens in enumerate(texts):
        alone = runtime.generate(reference, prompt, max_new_tokens=6, do_sample=True, seed=9 + i, speculative=False)
        assert tokens == alone.token_ids
    largest = max(g.tokens for g in art.tlm.graphs.values())
    assert scheduler.stats["calls"] == -(-len(prompt) // largest) + 5  # one prefill, then one call per step


def test_a_choice_whose_leader_is_cancelled_first_goes_on_alone(artifact_dir, reference):
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    scheduler = Scheduler(art)
    try:
        with scheduler._wake:  # hold the scheduler: the leader is cancelled before the group is admitted
            leader, follower = scheduler.submit_choices(
                PROMPTS[1], [decoding(max_new_tokens=6, do_sample=True, seed=s) for s in (1, 2)], [None, None])
            scheduler.cancel(leader)
        assert [e.finish for e in leader.events()] == ["cancelled"]
        tokens = [e.token for e in follower.events() if e.token is not None]
    finally:
        scheduler.close()
    alone = runtime.generate(reference, PROMPTS[1], max_new_tokens=6, do_sample=True, seed=2, speculative=False)
    assert tokens == alone.token_ids


def test_chat_completions_use_the_chat_template(served, reference):
    _, client = served
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "abc"}],
                                                  "max_tokens": 8, "temperature": 0}).json()
    ids = reference.tokenizer("abc")["input_ids"]
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    assert r["choices"][0]["message"]["content"] == _greedy(reference, ids, 8).text
    with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "abc"}],
                                                             "max_tokens": 8, "temperature": 0, "stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert chunks[0]["object"] == "chat.completion.chunk" and deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:]) and "".join(d["content"] for d in deltas) == \
        r["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body, word", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "model": "gpt-4"}, "unknown model"),
    ({"prompt": [0] * 200}, "context length"),
    ({"prompt": [0, 5], "max_tokens": 500}, "past the context length"),
    ({"prompt": [0, 5], "max_tokens": 60, "n": 4}, "cache holds"),  # each fits its context, not all 4 the slots
    ({"prompt": [0, 99999]}, "token ids must lie"),
    ({"prompt": ""}, "empty"),
    ({"prompt": "x", "stop": [""]}, "empty stop string"),
    ({}, "prompt"),
    ({"prompt": "x", "presence_penalty": 1.0}, "presence_penalty"),  # unsupported: refused, never ignored
])
def test_bad_requests_get_a_400_with_an_openai_error_body(served, body, word):
    _, client = served
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and word in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert client.get("/health").status_code == 200  # still serving


def test_malformed_json_is_a_400(served):
    r = served[1].post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_a_full_queue_is_a_429_with_retry_after(artifact_dir):
    app = create_app(runtime.load_artifact(artifact_dir), max_queue=0)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"


def test_a_serving_build_gets_step_graphs_below_its_prefill_chunk():
    """kv_slots for two sequences or more: graphs of 16 and 32 rows, so 10-40 running requests' step is not
    padded to the 64-row prefill chunk; a build for one sequence at a time gets none."""
    from dataclasses import replace

    from export.pipeline import graph_plan
    from recipes import get_recipe

    recipe = get_recipe("smollm2-135m-chat")
    assert not any(name.startswith("batch") for name in graph_plan(recipe, "tlm"))
    plan = graph_plan(replace(recipe, kv_slots=8192), "tlm")
    assert (plan["batch16"], plan["batch32"], plan["prefill"]) == (16, 32, 64)
    every_row = [t for name, t in plan.items() if graph_io.logit_rows(name, t) == t]  # not PREFILL_LAST
    assert sorted(every_row) == sorted(set(every_row))  # no two graphs of one size


@pytest.fixture(scope="module")
def serving_dir(tmp_path_factory, checkpoints):
    """A serving build: the tiny TLM with room for many requests at once (kv_slots 512), and so step graphs
    of 16 and 32 rows below its 48-row prefill chunk."""
    return build_artifact(tiny_recipe(dlm=None, kv_slots=512, prefill_chunk=48), tmp_path_factory.mktemp("serving")
                          / "art", tlm=str(checkpoints["llama-gqa"]), progress=False)


def test_nothing_is_lost_under_load(serving_dir):
    """48 requests at once on a cache that holds about a third of them: a third are cancelled after their
    first token, the prefix cache fills and evicts, and every completed greedy answer equals the same
    request run alone; a full queue refuses at once (QueueFullError: 429 with Retry-After), and the next
    request is served normally."""
    reference = runtime.load_artifact(serving_dir)
    art = runtime.load_artifact(serving_dir)
    for a in (reference, art):
        a.eos_token_ids = frozenset()
    prompts = [[0, *range(3 + 7 * (i % 12), 9 + 7 * (i % 12) + i % 5)] for i in range(48)]
    scheduler = Scheduler(art, max_queue=48)
    events: dict[int, list[Event]] = {i: [] for i in range(48)}
    requests = []

    def listener(i: int):
        def on(event: Event) -> None:
            events[i].append(event)
            if i % 3 == 0 and len(events[i]) == 1:
                scheduler.cancel(requests[i])
        return on

    try:
        with scheduler._wake:
            requests += [scheduler.submit(p, decoding(max_new_tokens=20 + i % 7), listener(i))
                         for i, p in enumerate(prompts)]
            with pytest.raises(QueueFullError, match="retry later"):
                scheduler.submit([0, 1, 2], decoding(max_new_tokens=4))
        deadline = time.time() + 120
        while any(not e or e[-1].finish is None for e in events.values()) and time.time() < deadline:
            time.sleep(0.05)
        after = [e.token for e in scheduler.submit([0, 3, 4], decoding(max_new_tokens=5)).events() if e.token]
    finally:
        scheduler.close()
    for i, prompt in enumerate(prompts):
        finish = events[i][-1].finish
        tokens = [e.token for e in events[i] if e.token is not None]
        if i % 3 == 0:
            assert finish == "cancelled" and len(tokens) == 1
        else:
            assert finish == "length" and tokens == _greedy(reference, prompt, 20 + i % 7).token_ids, i
    assert scheduler.stats["prefix_cache_evicted"] > 0 and scheduler.stats["rejected"] == 1
    assert {"batch16": 16, "batch32": 32}.items() <= {g: e.tokens for g, e in art.tlm.entries.items()}.items()
    assert after == _greedy(reference, [0, 3, 4], 5).token_ids


def test_a_served_artifact_refuses_direct_generation(served):
    art, _ = served
    with pytest.raises(ArtifactBusyError, match="served by a scheduler"):
        runtime.generate(art, [0, 5], max_new_tokens=2)


def test_the_openai_client_works_unchanged(artifact_dir, reference):
    openai = pytest.importorskip("openai")
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    with live_server(create_app(art, name="tiny", api_key="s3cret")) as url:
        client = openai.OpenAI(base_url=url, api_key="s3cret")
        r = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0)
        expected = _greedy(reference, reference.tokenizer("abc")["input_ids"], 10).text
        assert r.choices[0].text == expected and r.usage.completion_tokens == 10
        pieces = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0, stream=True)
        assert "".join(p.choices[0].text for p in pieces) == expected
        with pytest.raises(openai.BadRequestError, match="unknown model"):
            client.completions.create(model="nope", prompt="abc", max_tokens=2)
        stranger = openai.OpenAI(base_url=url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            stranger.completions.create(model="tiny", prompt="abc", max_tokens=2)


def test_a_cancelled_request_frees_its_slots_at_the_next_step(artifact_dir):
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    scheduler = Scheduler(art)
    try:
        events, submitted = [], threading.Event()

        def hang_up_after_the_first_token(event):
            events.append(event)
            if len(events) == 1:
                submitted.wait()
                scheduler.cancel(req)

        req = scheduler.submit([0, 5, 6], decoding(max_new_tokens=80), hang_up_after_the_first_token)
        submitted.set()
        deadline = time.time() + 10
        while (not events or events[-1].finish is None) and time.time() < deadline:
            time.sleep(0.01)
        assert [e.finish for e in events] == [None, "cancelled"]  # not one token more
        assert not scheduler.engine.live and scheduler.stats["cancelled"] == 1
        assert len(list(scheduler.submit([0, 7], decoding(max_new_tokens=5)).events())) == 6  # slots came back
    finally:
        scheduler.close()


def test_a_stream_closed_by_its_client_cancels_its_requests():
    """The SSE generator's cleanup (what runs when a client hangs up) cancels every unfinished choice."""
    cancelled = []

    class Recorder:
        def cancel(self, req):
            cancelled.append(req)

    outputs = [_Output(SimpleNamespace(tokenizer=byte_tokenizer()), []) for _ in range(2)]

    async def scenario():
        events = asyncio.Queue()
        stream = _stream(Recorder(), ["a", "b"], events, outputs, "text_completion", {}, None)
        events.put_nowait((0, Event(token=65)))
        first = await stream.__anext__()
        await stream.aclose()
        return first

    assert asyncio.run(scenario()).startswith("data: {")
    assert cancelled == ["a", "b"]


def test_nan_logits_fail_only_their_own_request(artifact_dir, reference, monkeypatch):
    """A row with NaN logits ends its request with an error; the requests batched beside it are unharmed."""
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    good_prompt, bad_prompt = PROMPTS[1], PROMPTS[0]
    good = _greedy(reference, good_prompt, 30).token_ids
    bad = _greedy(reference, bad_prompt, 12).token_ids
    poison = next(t for t in bad[4:] if t not in good + good_prompt)  # only the bad request ever feeds it
    real = art.tlm.run_rows

    def poisoned(graph, tokens, cache_sees, sees, check=True, fetch=True, positions=None):  # as the model would
        logits = real(graph, tokens, cache_sees, sees, False, fetch, positions)
        logits[(np.asarray(tokens) == poison)[-len(logits):]] = np.nan  # a prompt chunk's call: its last row's
        if check and not np.isfinite(logits).all():
            raise NonFiniteLogitsError("NaN")
        return logits

    monkeypatch.setattr(art.tlm, "run_rows", poisoned)
    scheduler = Scheduler(art)
    try:
        requests = [scheduler.submit(p, decoding(max_new_tokens=n)) for p, n in ((good_prompt, 30), (bad_prompt, 12))]
        (*good_tokens, good_end), (*bad_tokens, bad_end) = [list(r.events()) for r in requests]
    finally:
        scheduler.close()
    assert [e.token for e in good_tokens] == good and good_end.finish == "length"
    assert bad_end.finish == "error" and "NaN" in bad_end.error and len(bad_tokens) < 12
    assert bad_tokens[-1].token == poison  # it failed on the step that fed the poisoned token


def test_the_recipes_sampling_table_is_the_default_everywhere(checkpoints, tmp_path):
    from common.recipe import SamplingDefaults
    from export.pipeline import build_artifact
    from tests.conftest import tiny_recipe

    recipe = tiny_recipe(dlm=None, sampling=SamplingDefaults(do_sample=True, temperature=0.7, top_k=20))
    art = runtime.load_artifact(build_artifact(recipe, tmp_path / "art", tlm=str(checkpoints["llama-gqa"]),
                                               progress=False))
    art.eos_token_ids = frozenset()
    explicit = runtime.generate(art, PROMPTS[2], max_new_tokens=12, seed=4, do_sample=True, temperature=0.7,
                                top_k=20).token_ids
    assert runtime.generate(art, PROMPTS[2], max_new_tokens=12, seed=4).token_ids == explicit
    greedy = runtime.generate(art, PROMPTS[2], max_new_tokens=12, do_sample=False).token_ids
    assert greedy != explicit  # the table really changed the default, and an explicit value wins
    branches = runtime.generate(art, PROMPTS[2], n=2, max_new_tokens=12, seed=4)  # sampling by default: n > 1 ok
    assert branches.branches[0].token_ids == explicit
    served = runtime.load_artifact(art.path)
    served.eos_token_ids = frozenset()
    with TestClient(create_app(served, name="tiny")) as client:
        body = {"prompt": PROMPTS[2], "max_tokens": 12, "seed": 4}
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == \
            art.tokenizer.decode(explicit, skip_special_tokens=True)
        greedy_text = client.post("/v1/completions", json=body | {"temperature": 0}).json()["choices"][0]["text"]
        assert greedy_text == art.tokenizer.decode(greedy, skip_special_tokens=True)


def test_an_api_key_guards_the_v1_routes(artifact_dir):
    from serve.app import check_exposure

    with TestClient(create_app(runtime.load_artifact(artifact_dir), name="tiny", api_key="s3cret")) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = client.post("/v1/completions", json={"prompt": [0, 40], "max_tokens": 2}, headers=headers)
            assert r.status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "tiny"
        r = client.post("/v1/completions", json={"prompt": [0, 40], "max_tokens": 2}, headers=ok)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert client.get("/health").status_code == 200  # probes need no key
    with pytest.warns(UserWarning, match="without an API key"):
        check_exposure("0.0.0.0", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for host, key in (("127.0.0.1", None), ("localhost", None), ("::1", None), ("0.0.0.0", "k")):
            check_exposure(host, key)


def test_metrics_are_prometheus_with_latency_histograms(served):
    from prometheus_client.parser import text_string_to_metric_families

    _, client = served
    prompt = [0, 40, 41, 42, 43, 44, 45]
    cached = [client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}).json()["usage"]
              ["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
    assert cached[1] == len(prompt) - 1  # the second found all but the last prompt token in the prefix cache
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("request_queue_time_seconds", "time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds"):
        family = families[f"mxspd_{name}"]
        assert family.type == "histogram"
        count = next(s.value for s in family.samples if s.name.endswith("_count"))
        total = next(s.value for s in family.samples if s.name.endswith("_sum"))
        assert count >= 2 and total > 0
    def total(name: str) -> float:
        return next(s.value for s in families[name].samples if s.name.endswith("_sum"))

    assert total("mxspd_time_to_first_token_seconds") < total("mxspd_e2e_request_latency_seconds")
    assert families["mxspd_generated_tokens"].type == "counter"
    hits = families["mxspd_prefix_cache_hit_tokens"].samples[0].value
    assert hits >= len(prompt) - 1 and families["mxspd_prefix_cache_tokens"].samples[0].value > 0
