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
        """Cache slots this request may still take: its prompt and every new token but the last."""
        used = self.branch.length if self.branch is not None else 0
        return len(self.prompt) + self.max_new_tokens - 1 - used


class Scheduler:
    def __init__(self, art: Artifact, max_queue: int = 64, max_batch: int | None = None) -> None:
        self.art, self.max_queue = art, max_queue
        self.max_batch = max_batch or art.manifest.context_length
        self.waiting: deque[Request] = deque()
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
        decoding, max_new = decoding.with_recipe(self.art), decoding.new_tokens(self.art)
        need = len(prompt) + max_new - 1
        if need > self.art.manifest.context_length:
            raise CapacityError(f"{len(prompt)} prompt tokens + {max_new - 1} new tokens = {need} cache slots, "
                                f"but the cache holds {self.art.manifest.context_length}: lower max_tokens")
        events: queue.Queue[Event] = queue.Queue()
        req = Request(list(prompt), decoding, max_new, listener or events.put, events)
        with self._wake:
            if len(self.waiting) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFullError(f"{len(self.waiting)} requests are waiting (the limit): retry later")
            self.waiting.append(req)
            self.stats["requests"] += 1
            self._wake.notify()
        return req

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
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                req.listener(Event(finish="cancelled"))
                continue
            if req.need > room:
                break  # first come, first served: no overtaking that could starve a long request
            self.waiting.popleft()
            room -= req.need
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
        chains = [req.prompt if id(req) in admitted else req.tokens[-1:] for req in self.live]
        try:
            logits = forest.extend([r.branch for r in self.live], chains, check=False)
        except Exception as exc:  # noqa: BLE001 - the step's requests fail; the server keeps serving
            for req in list(self.live):
                self._finish(forest, req, "error", f"{type(exc).__name__}: {exc}")
            return
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
        forest.release(req.branch)
        self.live.remove(req)
        self.stats["finished"] += 1
        self.stats["cancelled"] += reason == "cancelled"
        req.listener(Event(finish=reason, error=error))

