"""`python -m serve ARTIFACT`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Every request becomes one sequence of the scheduler's forest (serve/scheduler.py), so
concurrent requests share each TLM call (continuous batching). Routes: POST /v1/completions,
POST /v1/chat/completions (streaming as server-sent events ending in `data: [DONE]`, or not),
GET /v1/models, /health, /metrics (Prometheus, through prometheus_client: the scheduler's counters
and, as vLLM exposes them, histograms of queue time, time to first token, time per output token
and end-to-end latency). Errors are OpenAI-style JSON bodies: 400 for
bad input, 401 for a missing or wrong API key, 429 with Retry-After when the queue is full.

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

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from common.manifest import ArtifactError
from runtime.artifact import Artifact
from runtime.forest import CapacityError
from runtime.load import load_artifact
from runtime.request import batched_speculation, decoding, encode_prompt
from runtime.results import TextPieces
from serve import scheduler as sched
from serve.scheduler import Event, QueueFullError, Scheduler

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's finish_reason
API_KEY_ENV = "MXSPD_API_KEY"


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unsupported field (logit_bias, ...) is a 400, never ignored

    model: str | None = None
    user: str | None = None  # accepted, unused (an end-user id for abuse tracking in OpenAI's API)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)  # 0: greedy, as OpenAI's API means it
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # unset: the recipe's [sampling] values
    top_k: int | None = Field(default=None, ge=0)  # extension
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with usage, as OpenAI sends
    speculation: str | None = None  # extension: "draft", "prompt_lookup", "lookahead" or "none" (unset: server's)
    draft_length: int | None = Field(default=None, ge=1)  # extension: most tokens drafted per round


class CompletionRequest(Sampling):
    prompt: str | list[int]


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


class BadRequest(ValueError):
    pass


class Unauthorized(Exception):
    """No API key, or the wrong one, on a /v1/ route."""


def _error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status, headers)


COUNTERS = {  # metric (without the _total Prometheus adds) -> scheduler.stats key
    "requests": "requests", "requests_finished": "finished", "requests_cancelled": "cancelled",
    "requests_rejected": "rejected", "generated_tokens": "tokens", "steps": "steps", "tlm_calls": "calls",
    "drafted_tokens": "drafted", "accepted_tokens": "accepted", "prompt_tokens": "prompt_tokens",
    "prefix_cache_hit_tokens": "cached_prompt_tokens", "prefix_cache_evicted_tokens": "prefix_cache_evicted"}
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
HISTOGRAMS = {  # metric -> (Request.timings key, help)
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
        for key, value in req.timings().items():
            self.histograms[key].observe(value)

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        s, sch = self.scheduler.stats, self.scheduler
        for name, key in COUNTERS.items():
            yield CounterMetricFamily(f"mxspd_{name}", f"scheduler total: {key}", value=s[key])
        for name, value, text in [
            ("tokens_per_second", s["tokens"] / s["busy_s"] if s["busy_s"] else 0.0, "tokens per busy second"),
            ("acceptance_rate", s["accepted"] / s["drafted"] if s["drafted"] else 0.0, "accepted / drafted"),
            ("queue_depth", len(sch.waiting), "requests waiting"), ("batch_occupancy", len(sch.live), "live requests"),
            ("prefix_cache_tokens", s["prefix_cache_tokens"], "finished requests' tokens kept for reuse"),
        ]:
            yield GaugeMetricFamily(f"mxspd_{name}", text, value=value)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def create_app(art: Artifact, name: str | None = None, max_queue: int = 64, speculation: str | None = None,
               api_key: str | None = None, prefix_cache: bool | None = None) -> FastAPI:
    """The app serving `art`; `speculation` is the method a request that names none uses (None: off);
    with `api_key`, /v1/ routes need `Authorization: Bearer <api_key>`; `prefix_cache` (default: on
    for batch-invariant artifacts) reuses finished requests' KV for prompts that start the same."""
    name = name or art.manifest.name
    batched_speculation(art, speculation or False)  # a bad default fails at start, not per request
    scheduler = Scheduler(art, max_queue=max_queue, prefix_cache=prefix_cache)
    metrics = Metrics(scheduler)
    scheduler.on_finish = metrics.observe
    app = FastAPI(title="mxspd", lifespan=None)
    app.state.scheduler = scheduler
    started = time.time()

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
        return PlainTextResponse(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest):
        _check_model(body, name)
        return await _serve(art, scheduler, body, encode(art, body.prompt), "text_completion", speculation)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(body: ChatRequest):
        _check_model(body, name)
        if not art.tokenizer.chat_template:
            raise BadRequest(f"model {name!r} has no chat template: use /v1/completions")
        ids = list(art.tokenizer.apply_chat_template([m.model_dump() for m in body.messages], tokenize=True,
                                                     add_generation_prompt=True, return_dict=False))
        return await _serve(art, scheduler, body, encode(art, ids), "chat.completion", speculation)

    return app


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
    try:
        spec = batched_speculation(art, False if method in (None, "none") else method, body.draft_length)
        seeds = [None if body.seed is None else body.seed + i for i in range(body.n)]
        t = body.temperature
        decodings = [decoding(max_new_tokens=body.max_tokens, do_sample=None if t is None else t > 0,
                              temperature=t or None, top_k=body.top_k, top_p=body.top_p, seed=s, stop=stops)
                     for s in seeds]
    except (ValueError, TypeError, ArtifactError) as exc:
        raise BadRequest(str(exc)) from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()  # (choice, event) of every choice
    try:  # the choices share one prefilled prompt
        listeners = [lambda e, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, e)) for i in range(len(decodings))]
        reqs = scheduler.submit_choices(ids, decodings, listeners, spec)
    except CapacityError as exc:
        raise BadRequest(str(exc)) from None
    meta = dict(id=f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}", created=int(time.time()),
                model=body.model or art.manifest.name)
    outputs = [_Output(art, stops) for _ in reqs]
    if body.stream:
        usage = len(ids) if (body.stream_options or {}).get("include_usage") else None
        return StreamingResponse(_stream(scheduler, reqs, events, outputs, kind, meta, usage),
                                 media_type="text/event-stream")
    try:
        running = len(outputs)
        while running:
            i, event = await events.get()
            if event.finish is None:
                outputs[i].add(event.token)
            else:
                outputs[i].end(event)
                running -= 1
    except asyncio.CancelledError:
        for r in reqs:
            scheduler.cancel(r)
        raise
    errors = [o.error for o in outputs if o.error]
    if errors:
        return _error(500, errors[0], "server_error")
    choices = [_choice(kind, i, o.text, o.finish) for i, o in enumerate(outputs)]
    return {"object": kind, **meta, "choices": choices, "usage": _usage(len(ids), reqs, outputs)}


def _usage(prompt: int, reqs: list, outputs: list) -> dict:
    """OpenAI's usage object; cached_tokens: the prompt tokens the prefix cache held."""
    completion = sum(len(o.tokens) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": reqs[0].cached}}


class _Output:
    """One choice's text as it grows: stop strings cut (and never shown), pieces held back while
    they could still be the start of a stop string."""

    def __init__(self, art: Artifact, stops: list[str]) -> None:
        self.pieces, self.stops = TextPieces(art.tokenizer), stops
        self.tokens: list[int] = []
        self.text, self.sent, self.finish, self.error = "", 0, None, None
        self.chunks = 0  # stream chunks sent

    def add(self, token: int) -> None:
        self.tokens.append(token)
        if (piece := self.pieces.add(token)) is not None:
            self.text += piece

    def end(self, event: Event) -> None:
        self.finish, self.error = FINISH.get(event.finish, event.finish), event.error
        self.text = self.pieces.tokenizer.decode(self.tokens, skip_special_tokens=True)  # with a trailing partial
        cuts = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.text = self.text[: min(cuts)]

    def new_text(self) -> str:
        """Text not sent yet that can no longer turn into a stop string."""
        hold = 0 if self.finish else max((len(s) - 1 for s in self.stops), default=0)
        cuts = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        end = min(cuts) if cuts else max(self.sent, len(self.text) - hold)
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return piece


def _choice(kind: str, index: int, text: str, finish: str | None, delta: bool = False, first: bool = True
            ) -> dict:
    """A choice of a response, or of a stream chunk (delta); a chat delta names the role in its first chunk only."""
    if kind == "chat.completion":
        if not delta:
            return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"index": index, "delta": {"role": "assistant", "content": text} if first else {"content": text},
                "finish_reason": finish}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}


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
                if event.finish is None:
                    out.add(event.token)
                else:
                    out.end(event)
                    running -= 1
                if event.error:
                    error = {"error": {"message": event.error, "type": "server_error"}}
                    chunks.append(f"data: {json.dumps(error)}\n\n")
                    continue
                text = out.new_text()  # may be "" (text held back): a chunk per token all the same
                if event.finish is None or text or out.finish:
                    choice = _choice(kind, i, text, out.finish, delta=True, first=not out.chunks)
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


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m serve", description=__doc__)
    p.add_argument("artifact")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", help="the model id clients name (default: the recipe's name)")
    p.add_argument("--max-queue", type=positive, default=64, help="waiting requests before 429 (default 64)")
    p.add_argument("--speculation", choices=["none", "draft", "prompt_lookup", "lookahead"], default="none",
                   help="the method of requests that name none in their 'speculation' field (default none: under "
                        "concurrency the shared calls are already full)")
    p.add_argument("--threads", type=positive, help="ONNX Runtime threads per call (default: every core; on a busy "
                   "machine with a small model, 1 can be faster)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"clients must send 'Authorization: Bearer KEY' on /v1/ routes (default: ${API_KEY_ENV})")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: finished requests' KV is reused by prompts that start "
                        "with the same tokens, as a chat's later turns do; outputs are the same bits either way)")
    args = p.parse_args(argv)
    check_exposure(args.host, args.api_key)
    art = load_artifact(args.artifact, threads=args.threads)
    try:
        app = create_app(art, args.model_name, args.max_queue, None if args.speculation == "none" else args.speculation,
                         args.api_key, False if args.no_prefix_cache else None)
    except (ValueError, ArtifactError) as exc:
        p.error(str(exc))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
