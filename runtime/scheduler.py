"""Continuous batching: one thread owns an artifact's TLM and advances every request in one call per step.

Each in-flight request is one branch of the forest over the shared KV cache (runtime/forest.py):
a step feeds every live request's newest token (and the prompts of requests admitted this step)
as rows of as few calls as the graphs allow, then samples each request's next token from its own
row with its own random stream. Requests join and leave between steps. A request is admitted
only when the cache has room for its prompt and all its new tokens besides what the admitted
requests may still need, so a running request never runs out of slots; the waiting queue is
bounded (QueueFullError). Callers never touch a runner: they submit and read events.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from runtime.artifact import Artifact
from runtime.forest import Branch, CapacityError, Forest
from runtime.request import Decoding
from runtime.results import finish_reason
from runtime.sampling import next_token


class QueueFullError(RuntimeError):
    """The scheduler's waiting queue is full: retry later."""


@dataclass
class Event:
    token: int | None = None  # a new token, or None with `finish` set (the last event)
    finish: str | None = None  # "eos", "stop", "length", "cancelled" or "error"
    error: str | None = None


@dataclass
class Request:
    prompt: list[int]
    decoding: Decoding
    max_new_tokens: int
    listener: Callable[[Event], None]
    queue: queue.Queue[Event]
    rng: np.random.Generator = field(init=False)
    tokens: list[int] = field(default_factory=list)
    branch: Branch | None = None
    leader: Request | None = None  # another choice of the same prompt, whose prefilled branch this one forks
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.decoding.seed)

    def events(self) -> Iterator[Event]:
        """The request's events as they come (when it was submitted without a listener)."""
        while True:
            event = self.queue.get()
            yield event
            if event.finish is not None:
                return

    @property
    def need(self) -> int:
        """Cache slots this request may still take: its prompt (unless a leader holds it) and every
        new token but the last."""
        shared = 0 if self.leader is None else len(self.prompt)
        used = self.branch.length - shared if self.branch is not None else 0
        return len(self.prompt) - shared + self.max_new_tokens - 1 - used


class Scheduler:
    def __init__(self, art: Artifact, max_queue: int = 64, max_batch: int | None = None) -> None:
        self.art, self.max_queue = art, max_queue
        self.max_batch = max_batch or art.manifest.context_length
        self.waiting: deque[list[Request]] = deque()  # groups: the choices of one prompt
        self.live: list[Request] = []
        self.stats = dict(requests=0, finished=0, cancelled=0, rejected=0, tokens=0, steps=0, calls=0, busy_s=0.0)
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="mxspd-scheduler", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], decoding: Decoding, listener: Callable[[Event], None] | None = None
               ) -> Request:
        """Queue a request; its events go to `listener` (called on the scheduler thread, must not block),
        or, without one, to `request.events()`. A request that can never fit the cache is refused at
        once (CapacityError); a full queue raises QueueFullError."""
        return self.submit_choices(prompt, [decoding], [listener])[0]

    def submit_choices(self, prompt: list[int], decodings: list[Decoding],
                       listeners: list[Callable[[Event], None] | None]) -> list[Request]:
        """Several choices of one prompt (OpenAI's `n`): the prompt is prefilled once and every choice
        forks it, as MultiDecode's parallel sampling does. Admitted together or not at all."""
        requests = []
        for decoding, listener in zip(decodings, listeners, strict=True):
            decoding, max_new = decoding.with_recipe(self.art), decoding.new_tokens(self.art)
            events: queue.Queue[Event] = queue.Queue()
            requests.append(Request(list(prompt), decoding, max_new, listener or events.put, events,
                                    leader=requests[0] if requests else None))
        need = sum(r.need for r in requests)
        if need > self.art.manifest.context_length:
            raise CapacityError(f"{len(prompt)} prompt tokens + {len(requests)} choices x their new tokens = {need} "
                                f"cache slots, but the cache holds {self.art.manifest.context_length}: lower "
                                "max_tokens or n")
        with self._wake:
            if len(self.waiting) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFullError(f"{len(self.waiting)} requests are waiting (the limit): retry later")
            self.waiting.append(requests)
            self.stats["requests"] += len(requests)
            self._wake.notify()
        return requests

    def cancel(self, req: Request) -> None:
        """Stop a request (a client that went away): its slots are freed at the next step."""
        req.cancelled = True
        with self._wake:
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join()

    def _admit(self, forest: Forest) -> list[Request]:
        """Move waiting requests in while the cache can hold all they may need."""
        room = forest.free_slots() - sum(r.need for r in self.live)
        admitted = []
        while self.waiting and len(self.live) < self.max_batch:
            group = [r for r in self.waiting[0] if not r.cancelled]
            for req in self.waiting[0]:
                if req.cancelled:
                    req.listener(Event(finish="cancelled"))
            if group and group[0].leader is not None:  # its leader was cancelled: the next choice leads
                group[0].leader = None
                for req in group[1:]:
                    req.leader = group[0]
            need = sum(r.need for r in group)
            if group and need > room:
                self.waiting[0] = group
                break  # first come, first served: no overtaking that could starve a long request
            self.waiting.popleft()
            room -= need
            for req in group:
                if req.leader is None:
                    req.branch, _ = forest.root()
                self.live.append(req)
                admitted.append(req)
        return admitted

    def _loop(self) -> None:
        with self.art.exclusive("scheduler"):
            forest = Forest(self.art.tlm)
            while True:
                with self._wake:
                    while not self._stop and not self.waiting and not self.live:
                        self._wake.wait()
                    if self._stop:
                        return
                    admitted = set(map(id, self._admit(forest)))
                if self.live:
                    self._step(forest, admitted)

    def _step(self, forest: Forest, admitted: set[int]) -> None:
        """One call for every live request: prompts of the new ones, the newest token of the others."""
        start, calls = time.perf_counter(), self.art.tlm.calls
        for req in [r for r in self.live if r.cancelled]:
            self._finish(forest, req, "cancelled")
        if not self.live:
            return
        for req in self.live:  # a choice whose leader went away before sharing its prompt: on its own
            if req.branch is None and req.leader not in self.live:
                req.leader, req.branch = None, forest.root()[0]
        fed = [r for r in self.live if r.branch is not None]
        chains = [req.prompt if id(req) in admitted else req.tokens[-1:] for req in fed]
        try:
            rows = forest.extend([r.branch for r in fed], chains, check=False)
        except Exception as exc:  # noqa: BLE001 - the step's requests fail; the server keeps serving
            for req in list(self.live):
                self._finish(forest, req, "error", f"{type(exc).__name__}: {exc}")
            return
        row_of = {id(r): row for r, row in zip(fed, rows, strict=True)}
        for req in self.live:  # new choices fork their leader's prefilled prompt and share its logits
            if req.branch is None:
                req.branch, row_of[id(req)] = forest.fork(req.leader.branch), row_of[id(req.leader)]
        logits = np.stack([row_of[id(r)] for r in self.live])
        now = time.perf_counter()
        finite = np.isfinite(logits).all(axis=1)
        for req, row, ok in zip(list(self.live), logits, finite, strict=True):
            if not ok:  # that request's error only: a token from NaN logits would be garbage
                self._finish(forest, req, "error", "NonFiniteLogitsError: the model produced NaN/Inf logits "
                             "for this request (damaged weights, or values overflowing the weight format)")
                continue
            req.tokens.append(next_token(row, req.decoding.params, req.rng))
            req.first_token = req.first_token or now
            req.listener(Event(token=req.tokens[-1]))
            reason = finish_reason(self.art, req.tokens, req.decoding.stop, req.max_new_tokens)
            if reason:
                self._finish(forest, req, reason)
        self.stats["tokens"] += int(finite.sum())
        self.stats["steps"] += 1
        self.stats["calls"] += self.art.tlm.calls - calls
        self.stats["busy_s"] += time.perf_counter() - start

    def _finish(self, forest: Forest, req: Request, reason: str, error: str | None = None) -> None:
        if req.branch is not None:
            forest.release(req.branch)
        self.live.remove(req)
        self.stats["finished"] += 1
        self.stats["cancelled"] += reason == "cancelled"
        req.listener(Event(finish=reason, error=error))

