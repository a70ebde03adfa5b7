"""`python -m serve ARTIFACT`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Every request becomes one sequence of the scheduler's forest (serve/scheduler.py), so
concurrent requests share each TLM call (continuous batching). Routes: POST /v1/completions,
POST /v1/chat/completions (streaming as server-sent events ending in `data: [DONE]`, or not),
GET /v1/models, /health, /metrics (Prometheus, through prometheus_client: the scheduler's counters
and, as vLLM exposes them, histograms of queue time, time to first token, time per output token
and end-to-end latency). Chat messages take a string or a list of text parts; `logprobs` (chat:
with `top_logprobs`; completions: an int, with `echo` for the prompt's own) come from the float32
logits of the call that chose each token (runtime/logprobs.py). Every error is an OpenAI-style JSON
body: 400 for bad input (checked before any model work; a prompt far past the context is refused by
its length in characters before it is tokenized), 401 for a missing or wrong API key, 404 and 405
for unknown routes and methods, 413 for a body over the limit (before it is parsed), 429 with
Retry-After when the queue is full, 500 for a request the model failed.

With an API key (`--api-key`, or the MXSPD_API_KEY environment variable), every /v1/ route needs
`Authorization: Bearer KEY`, as OpenAI's API and vLLM's server do; /health and /metrics stay open.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import os
import time
import uuid
import warnings
from collections.abc import AsyncIterator
from dataclasses import replace
from itertools import accumulate

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

from common.manifest import ArtifactError
from runtime.artifact import Artifact
from runtime.forest import CapacityError
from runtime.load import load_artifact
from runtime.logprobs import MAX_TOP, TokenLogprob
from runtime.request import batched_speculation, decoding, encode_prompt
from runtime.results import TextPieces
from serve import scheduler as sched
from serve.scheduler import Event, QueueFullError, Scheduler

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's finish_reason
API_KEY_ENV = "MXSPD_API_KEY"
MAX_BODY_BYTES = 4 << 20  # a request body's default limit: a 4,096-token prompt is ~20 KB of text
ROLES = ("system", "developer", "user", "assistant")  # and "tool" where the chat template names it


def _surrogate_free(body: object) -> None:
    """Every string in a parsed body, keys included, must be encodable text: JSON may hold a lone UTF-16
    surrogate ("\\ud800"), which no tokenizer takes. Walked without recursion (bodies nest deep)."""
    todo = [("", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, dict):
            todo += [(f"{where}.{_printable(k)}" if where else _printable(k), k) for k in value]
            todo += [(f"{where}.{_printable(k)}" if where else _printable(k), v) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(f"{where}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, str) and _printable(value) != value:
            raise ValueError(f"{where or 'body'}: holds a lone UTF-16 surrogate (not valid Unicode text)")


def _printable(text: object) -> str:
    """Text safe to encode and send back: lone surrogates escaped (\\ud800)."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unsupported field (logit_bias, ...) is a 400, never ignored

    model: str | None = None
    user: str | None = None  # accepted, unused (an end-user id for abuse tracking in OpenAI's API)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # 0: greedy, as OpenAI's API means it
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # unset: the recipe's [sampling] values
    top_k: int | None = Field(default=None, ge=0)  # extension
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with usage, as OpenAI sends
    speculation: str | None = None  # extension: "draft", "prompt_lookup", "lookahead" or "none" (unset: server's)
    draft_length: int | None = Field(default=None, ge=1)  # extension: most tokens drafted per round

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: object) -> object:
        _surrogate_free(data)
        return data


class CompletionRequest(Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)  # each token's, and this many alternatives
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens') before the completion

    @model_validator(mode="after")
    def _nothing_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it needs echo (to score the prompt)")
        return self


class Part(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    role: str
    content: str | list[Part] | None = None  # None: an assistant turn that only called tools
    name: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class BadRequest(ValueError):
    pass


class Unauthorized(Exception):
    """No API key, or the wrong one, on a /v1/ route."""


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": _printable(message), "type": kind, "param": None, "code": code}},
                        status, headers)


COUNTERS = {  # metric (without the _total Prometheus adds) -> scheduler.stats key
    "requests": "requests", "requests_finished": "finished", "requests_cancelled": "cancelled",
    "requests_rejected": "rejected", "generated_tokens": "tokens", "steps": "steps", "tlm_calls": "calls",
    "drafted_tokens": "drafted", "accepted_tokens": "accepted", "prompt_tokens": "prompt_tokens",
    "prefix_cache_hit_tokens": "cached_prompt_tokens", "prefix_cache_evicted_tokens": "prefix_cache_evicted"}
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
HISTOGRAMS = {  # metric -> (Metrics.latencies key, help)
    "request_queue_time_seconds": ("queue_s", "time a request waited before it was admitted"),
    "time_to_first_token_seconds": ("ttft_s", "time from a request's arrival to its first token"),
    "time_per_output_token_seconds": ("tpot_s", "time per output token after the first"),
    "e2e_request_latency_seconds": ("e2e_s", "time from a request's arrival to its end"),
}


class Metrics:
    """The server's Prometheus registry: the scheduler's counters and gauges, read when scraped, and
    per-request latency histograms observed as each request ends."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.histograms = {key: Histogram(f"mxspd_{name}", text, registry=self.registry, buckets=LATENCY_BUCKETS)
                           for name, (key, text) in HISTOGRAMS.items()}

    def observe(self, req: sched.Request) -> None:
        for key, value in req.metrics().latencies().items():
            self.histograms[key].observe(value)

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        s, sch = self.scheduler.stats, self.scheduler
        for name, key in COUNTERS.items():
            yield CounterMetricFamily(f"mxspd_{name}", f"scheduler total: {key}", value=s[key])
        for name, value, text in [
            ("tokens_per_second", s["tokens"] / s["busy_s"] if s["busy_s"] else 0.0, "tokens per busy second"),
            ("acceptance_rate", s["accepted"] / s["drafted"] if s["drafted"] else 0.0, "accepted / drafted"),
            ("queue_depth", len(sch.engine.waiting), "requests waiting"),
            ("batch_occupancy", len(sch.engine.live), "live requests"),
            ("prefix_cache_tokens", s["prefix_cache_tokens"], "finished requests' tokens kept for reuse"),
        ]:
            yield GaugeMetricFamily(f"mxspd_{name}", text, value=value)


class BodyLimit:
    """A request body over `limit` bytes is answered 413 before anything reads it: by its Content-Length,
    or, sent in chunks without one, as soon as the chunks pass the limit. A plain ASGI wrapper of the
    request side only (an HTTP middleware class would pass every stream chunk through a task)."""

    def __init__(self, app, limit: int) -> None:  # noqa: ANN001 - an ASGI app
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI interface
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.limit:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        messages, size = [], 0  # no length given: read it here, up to the limit, then hand it on
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._refuse(send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        replay = iter(messages)

        async def again() -> dict:
            return next(replay, None) or await receive()

        return await self.app(scope, again, send)

    async def _refuse(self, send) -> None:  # noqa: ANN001
        await _error(413, f"the request body is over the server's limit of {self.limit} bytes")(
            {"type": "http"}, None, send)


def create_app(art: Artifact, name: str | None = None, max_queue: int = 64, speculation: str | None = None,
               api_key: str | None = None, prefix_cache: bool | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app serving `art`; `speculation` is the method a request that names none uses (None: off);
    with `api_key`, /v1/ routes need `Authorization: Bearer <api_key>`; `prefix_cache` (default: on
    for batch-invariant artifacts) reuses finished requests' KV for prompts that start the same;
    a request body over `max_body_bytes` is refused (413) unread."""
    name = name or art.manifest.name
    batched_speculation(art, speculation or False)  # a bad default fails at start, not per request
    scheduler = Scheduler(art, max_queue=max_queue, prefix_cache=prefix_cache)
    metrics = Metrics(scheduler)
    scheduler.engine.on_finish = metrics.observe
    app = FastAPI(title="mxspd", lifespan=None)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.state.scheduler = scheduler
    started = time.time()
    # a text over the context times the most characters one token stands for has more tokens than the context
    # (byte-level and SentencePiece vocabularies spell a token with at least as many characters as it decodes to)
    most_chars = (art.manifest.context_length - 1) * max(map(len, art.tokenizer.backend.get_vocab()))
    tool_role = "tool" in (art.tokenizer.chat_template or "")

    async def authorize(request: Request) -> None:
        """A dependency of the /v1/ routes, not an HTTP middleware: Starlette's middleware passes every
        stream chunk through a task and a memory stream of its own, on the thread the scheduler shares."""
        given = request.headers.get("authorization", "")
        if api_key and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise Unauthorized

    v1 = [Depends(authorize)]

    @app.exception_handler(Unauthorized)
    async def unauthorized(_: Request, __: Unauthorized) -> JSONResponse:
        return _error(401, "missing or incorrect API key: send the header 'Authorization: Bearer KEY'",
                      code="invalid_api_key")

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        return _error(400, f"{where}: {first.get('msg')}")

    @app.exception_handler(HTTPException)
    async def http(_: Request, exc: HTTPException) -> JSONResponse:  # 404, 405, a body that is not JSON
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), kind, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception) -> JSONResponse:  # a bug: still an OpenAI-shaped answer
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")

    @app.exception_handler(BadRequest)
    async def bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(QueueFullError)
    async def busy(_: Request, exc: QueueFullError) -> JSONResponse:
        return _error(429, str(exc), "rate_limit_error", {"Retry-After": "1"})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(started),
                                            "owned_by": "mxspd"}]}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def bounded(chars: int) -> None:
        if chars > most_chars:
            raise BadRequest(f"the prompt has {chars} characters: more tokens than the context length "
                             f"{art.manifest.context_length} holds; shorten it")

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest):
        _check_model(body, name)
        bounded(len(body.prompt) if isinstance(body.prompt, str) else 0)
        return await _serve(art, scheduler, body, encode(art, body.prompt), "text_completion", speculation)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(body: ChatRequest):
        _check_model(body, name)
        if not art.tokenizer.chat_template:
            raise BadRequest(f"model {name!r} has no chat template: use /v1/completions")
        messages = _messages(body.messages, tool_role)
        bounded(sum(len(m["content"]) for m in messages))
        try:
            text = art.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - the template's own raise_exception (a role order it refuses)
            raise BadRequest(f"messages: the chat template refused them: {exc}") from None
        bounded(len(text))  # many short messages: the template's text, before it is tokenized
        ids = art.tokenizer(text, add_special_tokens=False)["input_ids"]  # as apply_chat_template(tokenize=True)
        return await _serve(art, scheduler, body, encode(art, ids), "chat.completion", speculation)

    return app


def _messages(messages: list[Message], tool_role: bool) -> list[dict]:
    """The messages as the chat template takes them: a known role each, text parts joined (as OpenAI
    joins them: no separator), `developer` as `system` (OpenAI's newer name for it)."""
    roles = (*ROLES, "tool") if tool_role else ROLES
    out = []
    for i, m in enumerate(messages):
        if m.role not in roles:
            raise BadRequest(f"messages[{i}].role: {m.role!r} is not one of {', '.join(roles)}")
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise BadRequest(f"messages[{i}].content[{j}]: part type {part.type!r} is not supported "
                                     "(text parts only: {'type': 'text', 'text': ...})")
            content = "".join(part.text for part in content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out


def _check_model(body: Sampling, name: str) -> None:
    if body.model is not None and body.model != name:
        raise BadRequest(f"unknown model {body.model!r}; this server serves {name!r}")


def encode(art: Artifact, prompt: str | list[int]) -> list[int]:
    try:
        return encode_prompt(art, prompt, chat=False)
    except (ValueError, TypeError) as exc:
        raise BadRequest(str(exc)) from None


async def _serve(art: Artifact, scheduler: Scheduler, body: Sampling, ids: list[int], kind: str,
                 speculation: str | None):
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    method = speculation if body.speculation is None else body.speculation
    chat = kind == "chat.completion"
    top = (body.top_logprobs or 0) if chat and body.logprobs else None if chat else body.logprobs
    echo = not chat and body.echo
    try:
        spec = batched_speculation(art, False if method in (None, "none") else method, body.draft_length)
        seeds = [None if body.seed is None else body.seed + i for i in range(body.n)]
        t = body.temperature
        decodings = [decoding(max_new_tokens=body.max_tokens or None, do_sample=None if t is None else t > 0,
                              temperature=t or None, top_k=body.top_k, top_p=body.top_p, seed=s, stop=stops)
                     for s in seeds]
        if body.max_tokens == 0:  # echo alone: score the prompt
            decodings = [replace(d, max_new_tokens=0) for d in decodings]
    except (ValueError, TypeError, ArtifactError) as exc:
        raise BadRequest(str(exc)) from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()  # (choice, event) of every choice
    try:  # the choices share one prefilled prompt
        listeners = [lambda e, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, e)) for i in range(len(decodings))]
        reqs = scheduler.submit_choices(ids, decodings, listeners, spec, top, echo and top is not None)
    except CapacityError as exc:
        raise BadRequest(str(exc)) from None
    meta = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                model=body.model or art.manifest.name)
    outputs = [_Output(art, stops, top, ids if echo else None) for _ in reqs]
    if body.stream:
        usage = len(ids) if (body.stream_options or {}).get("include_usage") else None
        return StreamingResponse(_stream(scheduler, reqs, events, outputs, kind, meta, usage),
                                 media_type="text/event-stream")
    try:
        running = len(outputs)
        while running:
            i, event = await events.get()
            running -= outputs[i].take(event, reqs[i])
    except asyncio.CancelledError:
        for r in reqs:
            scheduler.cancel(r)
        raise
    if errors := [o.error for o in outputs if o.error]:
        return _error(500, errors[0], "server_error")
    choices = [_choice(kind, i, o.text, o.finish, logprobs=o.report(0, chat)) for i, o in enumerate(outputs)]
    return {"object": kind, **meta, "choices": choices, "usage": _usage(len(ids), reqs, outputs)}


def _usage(prompt: int, reqs: list, outputs: list) -> dict:
    """OpenAI's usage object; cached_tokens: the prompt tokens the prefix cache held."""
    completion = sum(o.generated for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": reqs[0].cached}}


class _Output:
    """One choice's text as it grows: stop strings cut (and never shown), pieces held back while
    they could still be the start of a stop string; with `top` (not None), its tokens' log
    probabilities; with `echo` (the prompt's ids), the prompt's text (and log probabilities) first."""

    def __init__(self, art: Artifact, stops: list[str], top: int | None = None, echo: list[int] | None = None) -> None:
        self.pieces, self.stops, self.top, self.echo = TextPieces(art.tokenizer), stops, top, echo
        self.tokens: list[int] = []  # echo: the prompt's first
        self.texts: list[str] = []  # each token's own text (with logprobs)
        self.logprobs: list[TokenLogprob | None] = []  # None: the prompt's first token (nothing predicts it)
        self.text, self.sent, self.finish, self.error = "", 0, None, None
        self.chunks = self.reported = 0  # stream chunks sent; tokens whose logprobs went out in them
        self.prefix, self.begun = "", False

    def _log(self, tokens: list[int], logprobs: list) -> None:
        self.tokens += tokens
        self.logprobs += logprobs
        self.texts += [self.pieces.tokenizer.decode([t]) for t in tokens]

    def take(self, event: Event, req: object) -> bool:
        """One event of the choice; True for its last. The first brings echo's prompt text and, with
        logprobs, its tokens' (the scheduler has filled req.prompt_logprobs before any event)."""
        if not self.begun:
            self.begun = True
            if self.echo:
                self.prefix = self.text = self.pieces.tokenizer.decode(self.echo, skip_special_tokens=True)
                if self.top is not None:
                    self._log(self.echo, [None, *req.prompt_logprobs])
        if event.finish is None:
            if self.top is not None:
                self._log([event.token], [event.logprob])
            else:
                self.tokens.append(event.token)
            if (piece := self.pieces.add(event.token)) is not None:
                self.text += piece
            return False
        self.finish, self.error = FINISH.get(event.finish, event.finish), event.error
        generated = self.tokens[len(self.echo or ()) if self.top is not None else 0:]
        self.text = self.pieces.tokenizer.decode(generated, skip_special_tokens=True)  # with a trailing partial
        cuts = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.text = self.text[: min(cuts)]
        self.text = self.prefix + self.text
        return True

    @property
    def generated(self) -> int:
        return len(self.tokens) - (len(self.echo or ()) if self.top is not None else 0)

    def new_text(self) -> str:
        """Text not sent yet that can no longer turn into a stop string."""
        hold = 0 if self.finish else max((len(s) - 1 for s in self.stops), default=0)
        cuts = [i for i in (self.text.find(s, len(self.prefix)) for s in self.stops) if i >= 0]
        end = min(cuts) if cuts else max(self.sent, len(self.text) - hold)
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return piece

    def report(self, start: int, chat: bool) -> dict | None:
        """OpenAI's logprobs object for tokens `start` on (None where none were asked for)."""
        if self.top is None:
            return None
        decode = self.pieces.tokenizer.decode
        texts, lps = self.texts[start:], self.logprobs[start:]
        if chat:
            def entry(text: str, logprob: float) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
            return {"content": [entry(text, lp.logprob) | {"top_logprobs": [entry(decode([i]), v) for i, v in lp.top]}
                                for text, lp in zip(texts, lps, strict=True)]}
        offsets = list(accumulate(map(len, self.texts), initial=0))[start : start + len(texts)]
        return {"tokens": texts, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else {decode([i]): v for i, v in lp.top} | {text: lp.logprob}
                                 for text, lp in zip(texts, lps, strict=True)],  # the chosen token too, as OpenAI's
                "text_offset": offsets}


def _choice(kind: str, index: int, text: str, finish: str | None, delta: bool = False, first: bool = True,
            logprobs: dict | None = None) -> dict:
    """A choice of a response, or of a stream chunk (delta); a chat delta names the role in its first chunk only."""
    if kind != "chat.completion":
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    message = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta" if delta else "message": message, "logprobs": logprobs, "finish_reason": finish}


async def _stream(scheduler: Scheduler, reqs: list, events: asyncio.Queue, outputs: list, kind: str, meta: dict,
                  usage_prompt: int | None) -> AsyncIterator[str]:
    """Chunks as the choices grow, one per token; with usage_prompt (the prompt's tokens), a last
    chunk with usage. The chunks of events that arrived together go out in one write."""
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
    running = len(outputs)
    try:
        while running:
            batch, chunks = [await events.get()], []
            while not events.empty():
                batch.append(events.get_nowait())
            for i, event in batch:
                out = outputs[i]
                running -= out.take(event, reqs[i])
                if event.error:
                    error = {"error": {"message": event.error, "type": "server_error"}}
                    chunks.append(f"data: {json.dumps(error)}\n\n")
                    continue
                text = out.new_text()  # may be "" (text held back): a chunk per token all the same
                if event.finish is None or text or out.finish:
                    logprobs = out.report(out.reported, kind == "chat.completion")
                    out.reported = len(out.tokens)
                    if logprobs is not None and not logprobs.get("content", logprobs.get("tokens")):
                        logprobs = None  # the last chunk's: no token of its own
                    choice = _choice(kind, i, text, out.finish, delta=True, first=not out.chunks, logprobs=logprobs)
                    out.chunks += 1
                    chunks.append(f"data: {json.dumps({'object': chunk_kind, **meta, 'choices': [choice]})}\n\n")
            yield "".join(chunks)
        if usage_prompt is not None:
            usage = _usage(usage_prompt, reqs, outputs)
            yield f"data: {json.dumps({'object': chunk_kind, **meta, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # a client that went away: free its sequences at the next step
        for r, out in zip(reqs, outputs, strict=True):
            if out.finish is None:
                scheduler.cancel(r)


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def check_exposure(host: str, api_key: str | None) -> None:
    """Warn when the server is reachable beyond this machine and anyone may use it."""
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        local = False
    if not local and not api_key:
        warnings.warn(f"serving on {host} without an API key: anyone who can reach this port can use the model; "
                      f"set --api-key or {API_KEY_ENV}", stacklevel=2)


def server_arguments(prog: str, doc: str | None, per: str = "") -> argparse.ArgumentParser:
    """The options this server and the Ray deployment (serve/ray_serve.py: `per` = " per replica") share."""
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("artifact")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", help="the model id clients name (default: the recipe's name)")
    p.add_argument("--max-queue", type=positive, default=64, help=f"waiting requests{per} before 429 (default 64)")
    p.add_argument("--speculation", choices=["none", "draft", "prompt_lookup", "lookahead"], default="none",
                   help="the method of requests that name none in their 'speculation' field (default none: under "
                        "concurrency the shared calls are already full)")
    p.add_argument("--threads", type=positive, help="ONNX Runtime threads per call (default: every core; on a busy "
                   "machine with a small model, 1 can be faster)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"clients must send 'Authorization: Bearer KEY' on /v1/ routes (default: ${API_KEY_ENV})")
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = server_arguments("python -m serve", __doc__)
    p.add_argument("--max-body-kb", type=positive, default=MAX_BODY_BYTES >> 10,
                   help=f"the largest request body accepted, in KiB (default {MAX_BODY_BYTES >> 10}); larger is a 413")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: finished requests' KV is reused by prompts that start "
                        "with the same tokens, as a chat's later turns do; outputs are the same bits either way)")
    args = p.parse_args(argv)
    check_exposure(args.host, args.api_key)
    art = load_artifact(args.artifact, threads=args.threads)
    try:
        app = create_app(art, args.model_name, args.max_queue, None if args.speculation == "none" else args.speculation,
                         args.api_key, False if args.no_prefix_cache else None, args.max_body_kb << 10)
    except (ValueError, ArtifactError) as exc:
        p.error(str(exc))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
