"""The OpenAI API as clients call it: content parts, roles, log probabilities, and bodies that must not hurt."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import runtime
from runtime.logprobs import log_softmax, token_logprob, token_logprobs
from serve.app import create_app
from tests.conftest import live_server

TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
PROMPT = [0, *range(40, 52)]


@pytest.fixture(scope="module")
def served(artifact_dir):
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    art.tokenizer.chat_template = TEMPLATE
    with TestClient(create_app(art, name="tiny", max_body_bytes=64 << 10)) as client:
        yield art, client


@pytest.fixture(scope="module")
def hf(checkpoints):
    """transformers' float32 TLM of the artifact's weights (the tiny artifact is float32)."""
    return AutoModelForCausalLM.from_pretrained(checkpoints["llama-gqa"], dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    """log p of every next token after each prefix of `ids`, by transformers [len(ids), V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def post(client, route: str, body: object):
    """POST `body` as JSON with non-ASCII escaped, as a client may send it: lone surrogates as \\ud800."""
    return client.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def chat(client, messages, **kw) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_content_parts_are_joined_as_openai_joins_them(served):
    _, client = served
    plain = chat(client, [{"role": "user", "content": "abcdef"}])
    two = [{"type": "text", "text": "abc"}, {"type": "text", "text": "def"}]
    parts = chat(client, [{"role": "user", "content": two}])
    assert parts["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert parts["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    # developer is OpenAI's newer name for system: the template sees "system"
    dev = chat(client, [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "abcdef"}])
    sys = chat(client, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abcdef"}])
    assert dev["choices"][0]["message"] == sys["choices"][0]["message"]
    assert dev["usage"]["prompt_tokens"] == sys["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


@pytest.mark.parametrize("messages, word", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_url"),
    ([{"role": "user", "content": [{"type": "text"}]}], "content[0]"),
    ([{"role": "wizard", "content": "hi"}], "wizard"),
    ([{"role": "tool", "content": "42"}], "tool"),  # this template has no tool turns
    ([{"role": "user", "content": "\ud800 hi"}], "surrogate"),
    ([{"role": "user", "content": 5}], "content"),
    ([], "messages"),
])
def test_bad_messages_get_a_400_naming_what_is_wrong(served, messages, word):
    _, client = served
    r = post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, word", [
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "echo"),
    ({"prompt": "\udfff"}, "surrogate"),
    ({"prompt": "x", "stop": ["\ud800"]}, "surrogate"),
])
def test_openai_ranges_are_enforced(served, body, word):
    r = post(served[1], "/v1/completions", body)
    assert r.status_code == 400 and word in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body", [{"\ud800": 1}, {"prompt": "x", "\ud800": "\udc00"},
                                  {"messages": [{"role": "user", "content": "x", "\ud800": "\udc00"}]}])
def test_a_surrogate_in_a_key_is_a_400_too(served, body):
    r = post(served[1], "/v1/chat/completions" if "messages" in body else "/v1/completions", body)
    assert r.status_code == 400 and "error" in r.json(), r.text


def test_an_echoed_prompt_with_nan_logits_fails_alone(artifact_dir, monkeypatch):
    """A non-finite row among an echoed prompt's (not only its last) ends that request with an error, not a
    NaN in the JSON."""
    art = runtime.load_artifact(artifact_dir)
    real = art.tlm.run_rows

    def poisoned(graph, tokens, cache_sees, sees, check=True, fetch=True, positions=None):
        logits = real(graph, tokens, cache_sees, sees, False, fetch, positions)
        logits[(np.asarray(tokens) == 47)[-len(logits):]] = np.nan  # a token early in the prompt below
        return logits

    monkeypatch.setattr(art.tlm, "run_rows", poisoned)
    with TestClient(create_app(art)) as client:
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 500 and "NaN" in r.json()["error"]["message"]
        ok = client.post("/v1/completions", json={"prompt": [0, 5, 6], "max_tokens": 0, "echo": True, "logprobs": 1})
        assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"]["token_logprobs"][1] < 0


def test_top_logprobs_needs_logprobs(served):
    r = served[1].post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                     "top_logprobs": 3})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def test_every_error_has_the_openai_shape(served):
    _, client = served
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    as_json = {"content-type": "application/json"}
    for r, status in [(client.post("/v1/completions", content=deep, headers=as_json), 400),
                      (client.get("/v1/nothing"), 404), (client.get("/v1/completions"), 405),
                      (client.post("/v1/completions", content=b"\xff\xfe{", headers=as_json), 400)]:
        assert r.status_code == status and set(r.json()["error"]) >= {"message", "type"}, r.text


def test_a_body_over_the_limit_is_a_413_unread(served):
    _, client = served
    big = json.dumps({"prompt": "a" * (70 << 10)}).encode()
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    chunked = client.post("/v1/completions", content=iter([big[:40 << 10], big[40 << 10:]]),
                          headers={"content-type": "application/json"})  # no Content-Length: counted as it comes
    assert chunked.status_code == 413
    small = client.post("/v1/completions", content=iter([b'{"prompt": [0, 5], ', b'"max_tokens": 2}']),
                        headers={"content-type": "application/json"})
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2


def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(served, monkeypatch):
    art, client = served
    monkeypatch.setattr(art.tokenizer.backend, "encode", lambda *a, **k: pytest.fail("tokenized"))
    r = client.post("/v1/completions", json={"prompt": "ab " * 20000})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab " * 20000}]})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]


def test_chat_logprobs_are_the_models_own(served, hf):
    art, client = served
    messages = [{"role": "user", "content": "hello there"}]
    r = chat(client, messages, logprobs=True, top_logprobs=5)
    content = r["choices"][0]["logprobs"]["content"]
    ids = list(art.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    generated = []  # transformers' greedy tokens (a float32 artifact picks the same: no near-ties here)
    for _ in range(6):
        generated.append(int(hf_logprobs(hf, ids + generated)[-1].argmax()))
    expected = hf_logprobs(hf, ids + generated)[len(ids) - 1 : -1]
    assert [c["token"] for c in content] == [art.tokenizer.decode([t]) for t in generated]
    for c, t, lp in zip(content, generated, expected, strict=True):
        assert abs(c["logprob"] - lp[t]) < 1e-4
        assert len(c["top_logprobs"]) == 5 and c["top_logprobs"][0]["token"] == c["token"]  # greedy: the top one
        tops = [x["logprob"] for x in c["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and abs(tops[1] - np.sort(lp)[-2]) < 1e-4
        assert bytes(c["bytes"]).decode() == c["token"]
    assert chat(client, messages)["choices"][0]["logprobs"] is None  # not asked: none


def test_streamed_chat_logprobs_equal_the_response(served):
    _, client = served
    body = {"messages": [{"role": "user", "content": "stream me"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == whole


def test_completion_echo_scores_the_prompt_as_transformers_does(served, hf):
    art, client = served
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 5})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    text = art.tokenizer.decode(PROMPT, skip_special_tokens=True)  # the prompt as sent: no BOS text
    assert r.json()["usage"]["completion_tokens"] == 0 and choice["text"] == text
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    expected = hf_logprobs(hf, PROMPT)
    for i in range(1, len(PROMPT)):
        assert abs(lp["token_logprobs"][i] - expected[i - 1, PROMPT[i]]) < 1e-4
        # the 5 likeliest and the chosen token, by text (byte tokens that decode alike share a key)
        assert lp["top_logprobs"][i][lp["tokens"][i]] == lp["token_logprobs"][i]
        assert 1 <= len(lp["top_logprobs"][i]) <= 6
    assert lp["text_offset"] == list(np.cumsum([0, *map(len, lp["tokens"][:-1])]))
    # with new tokens: the prompt's then the completion's, the text the prompt's then the answer's
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 1,
                                             "temperature": 0}).json()["choices"][0]
    assert len(r["logprobs"]["tokens"]) == len(PROMPT) + 4 and r["text"].startswith(text)
    assert r["logprobs"]["token_logprobs"][1 : len(PROMPT)] == lp["token_logprobs"][1:]


@pytest.mark.parametrize("method", ["prompt_lookup", "draft"])
def test_speculation_reports_the_logprobs_of_autoregressive_decoding(served, method):
    """With speculation each token's log probability comes from the verification call's row: on a
    batch-invariant artifact the same bits as a plain step's."""
    _, client = served
    body = {"prompt": [0, *range(40, 50), *range(40, 46)], "max_tokens": 12, "temperature": 0, "logprobs": 3}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    fast = client.post("/v1/completions", json=body | {"speculation": method}).json()["choices"][0]
    assert fast["text"] == plain["text"] and fast["logprobs"] == plain["logprobs"]


def test_token_logprob_is_log_softmax_with_its_alternatives():
    row = np.array([1.0, 3.0, 3.0, -2.0], np.float32)
    t = token_logprob(row, 0, top=3)
    rows = np.stack([row, row[::-1]])
    assert token_logprobs(rows, [0, 3], 2) == [token_logprob(rows[0], 0, 2), token_logprob(rows[1], 3, 2)]
    expected = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64)).sum())
    assert abs(t.logprob - expected[0]) < 1e-12 and [i for i, _ in t.top] == [1, 2, 0]  # ties: lower id first
    assert np.allclose(np.exp(log_softmax(row)).sum(), 1.0)
    with pytest.raises(ValueError, match="top"):
        token_logprob(row, 0, top=21)


SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)


def nested(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)


JSON = st.recursive(SCALARS, nested, max_leaves=20)
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "top_logprobs",
          "echo", "stream", "seed", "model", "role", "content", "speculation", "draft_length"]
BODIES = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=5) | JSON


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES, route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_generated_bodies_never_get_a_5xx(served, body, route):
    _, client = served
    r = post(client, route, body)
    assert r.status_code < 500, (body, r.text)
    assert set(r.json()) & {"error", "choices"}


def test_a_normal_request_answers_the_same_after_the_malformed_ones(served):
    _, client = served
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    before = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    for bad in (b"{", b"[]", b'{"prompt": null}', b'{"messages": [{"role": "user", "content": "\\ud800"}]}'):
        client.post("/v1/chat/completions", content=bad, headers={"content-type": "application/json"})
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == before


def test_the_openai_client_sends_parts_and_reads_logprobs(artifact_dir):
    openai = pytest.importorskip("openai")
    art = runtime.load_artifact(artifact_dir)
    art.eos_token_ids = frozenset()
    art.tokenizer.chat_template = TEMPLATE
    with live_server(create_app(art, name="tiny")) as url:
        client = openai.OpenAI(base_url=url, api_key="none")
        parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
        r = client.chat.completions.create(model="tiny", max_tokens=5, temperature=0, logprobs=True, top_logprobs=5,
                                           messages=[{"role": "user", "content": parts}])
        content = r.choices[0].logprobs.content
        assert len(content) == 5 and all(len(c.top_logprobs) == 5 and c.logprob <= 0 for c in content)
        assert "".join(c.token for c in content) == r.choices[0].message.content
        echo = client.completions.create(model="tiny", prompt="abc", max_tokens=0, echo=True, logprobs=5)
        assert echo.choices[0].text == "abc" and echo.choices[0].logprobs.token_logprobs[0] is None
