"""Continuous batching: one thread owns an artifact's TLM and drives its engine, one step after another.

The engine (runtime/engine.py) advances every in-flight request in one call per step: chunked
prefill, batching, speculation, the prefix cache and the one capacity rule are its. This module adds
what a server needs around it: a bounded waiting queue (QueueFullError), submission from any thread,
cancellation, and a step that raises failing its requests while the server keeps serving. Callers
never touch a runner: they submit and read events.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from runtime.artifact import Artifact
from runtime.engine import Engine, Event, Request, check_fits, make_requests
from runtime.request import Decoding, Speculation


class QueueFullError(RuntimeError):
    """The scheduler's waiting queue is full: retry later."""


class Scheduler:
    def __init__(self, art: Artifact, max_queue: int = 64, max_batch: int | None = None,
                 prefix_cache: bool | None = None) -> None:
        self.engine = Engine(art, max_batch, prefix_cache)  # its on_finish: the server's metrics
        self.art, self.max_queue = art, max_queue
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="mxspd-scheduler", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> dict:
        return self.engine.stats

    def submit(self, prompt: list[int], decoding: Decoding, listener: Callable[[Event], None] | None = None,
               spec: Speculation | None = None, logprobs: int | None = None, echo: bool = False) -> Request:
        """Queue a request; its events go to `listener` (called on the scheduler thread, must not block),
        or, without one, to `request.events()`. A request that can never fit the cache is refused at
        once (CapacityError); a full queue raises QueueFullError. `logprobs`: each new token's event
        carries its log probability and that many alternatives; `echo`: the prompt's are computed too
        (Request.prompt_logprobs; the prefix cache is not used for it)."""
        return self.submit_choices(prompt, [decoding], [listener], spec, logprobs, echo)[0]

    def submit_choices(self, prompt: list[int], decodings: list[Decoding],
                       listeners: list[Callable[[Event], None] | None], spec: Speculation | None = None,
                       logprobs: int | None = None, echo: bool = False) -> list[Request]:
        """Several choices of one prompt (OpenAI's `n`): the prompt is prefilled once and every choice
        forks it, as MultiDecode's parallel sampling does. Admitted together or not at all. A decoding
        of max_new_tokens 0 only prefills (with `echo`: scores the prompt)."""
        requests = make_requests(self.art, prompt, decodings, listeners, spec, logprobs, echo)
        check_fits(self.art, requests)
        with self._wake:
            if len(self.engine.waiting) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFullError(f"{len(self.engine.waiting)} requests are waiting (the limit): retry later")
            self.engine.add(requests)
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

    def _loop(self) -> None:
        engine = self.engine
        with self.art.exclusive("scheduler"):
            while True:
                with self._wake:
                    while not self._stop and not engine.busy:
                        self._wake.wait()
                    if self._stop:
                        return
                    engine.admit()
                if engine.live:
                    try:
                        engine.step()
                    except Exception as exc:  # noqa: BLE001 - the step's requests fail; the server keeps serving
                        engine.fail(f"{type(exc).__name__}: {exc}")
