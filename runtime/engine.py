"""The engine step: every batched way of generating produces its tokens here (docs/runtime.md, "The
engine step", draws the step and gives its rules: one capacity rule, leaders and followers, prompt
chunks, failures that are a request's own).

Each admitted request is one branch of the forest over the shared KV cache (runtime/forest.py).
`Engine.step()` feeds every running request's newest token (and its drafts) as rows of the cheapest
calls the graphs allow, then chooses each request's next tokens from its own rows with its own
random stream, and emits them (`Event`s to the request's listener). Generations, MultiDecode
(runtime/multi.py) and the server's scheduler (serve/scheduler.py) all drive it.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from runtime.artifact import Artifact
from runtime.draft_policy import DraftPolicy
from runtime.forest import Branch, CapacityError, Forest
from runtime.logprobs import TokenLogprob, token_logprob, token_logprobs
from runtime.proposal import Drafter, Proposal
from runtime.rejection import verify_greedy, verify_tree
from runtime.request import Decoding, Speculation
from runtime.results import Metrics, finish_reason
from runtime.round_stats import RoundStats
from runtime.sampling import argmax_rows, next_token, warped_rows
from runtime.speculative import make_drafter, make_policy

NONE = Proposal()  # a plain step
NON_FINITE = ("NonFiniteLogitsError: the model produced NaN/Inf logits for this request (damaged weights, or "
              "values overflowing the weight format)")


@dataclass
class Event:
    token: int | None = None  # a new token, or None with `finish` set (the last event)
    finish: str | None = None  # "eos", "stop", "length", "cancelled" or "error"
    error: str | None = None
    logprob: TokenLogprob | None = None  # the token's, where the request asked for log probabilities


@dataclass(eq=False)  # a request is itself: `in self.live` must not compare prompts
class Request:
    prompt: list[int]
    decoding: Decoding  # with the recipe's values applied
    max_new_tokens: int
    listener: Callable[[Event], None] | None = None  # None: the events go to `events()`
    queue: queue.Queue[Event] = field(default_factory=queue.Queue)
    rng: np.random.Generator = field(init=False)
    tokens: list[int] = field(default_factory=list)
    branch: Branch | None = None
    leader: Request | None = None  # a request whose prompt begins this one's: this one forks its prefilled branch
    spec: Speculation | None = None  # a batched request's speculation: the engine makes its drafter at admission
    drafter: Drafter | None = None  # proposes each round's tree
    policy: DraftPolicy | None = None  # chooses each round's length (Engine.policy_for)
    rounds: RoundStats | None = None  # a generation's speculation counters
    cancelled: bool = False
    logprobs: int | None = None  # report each new token's log probability and this many alternatives
    echo: bool = False  # also every prompt token's (but the first's): prompt_logprobs, set before the first event
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    cached: int = 0  # prompt tokens found in the prefix cache (not prefilled)
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.decoding.seed)
        self.listener = self.listener or self.queue.put

    def events(self) -> Iterator[Event]:
        """The request's events as they come (when it was made without a listener of its own)."""
        while True:
            event = self.queue.get()
            yield event
            if event.finish is not None:
                return

    @property
    def shared(self) -> int:
        """Prompt tokens its leader holds for it."""
        return 0 if self.leader is None else len(self.leader.prompt)

    @property
    def need(self) -> int:
        """Cache slots this request may still take: its prompt (but what a leader holds), every new
        token but the last, and room for a round's drafts scored past its last token."""
        used = self.branch.length - self.shared if self.branch is not None else 0
        return len(self.prompt) - self.shared + max(self.max_new_tokens, 1) - 1 + self.spare - used

    @property
    def dlm_need(self) -> int:
        """The same in the DLM's cache (no prompt is shared there)."""
        drafter = self.drafter
        if (self.spec.method if self.spec is not None else drafter.name if drafter is not None else None) != "draft":
            return 0
        used = drafter.used if drafter is not None else 0  # a DraftModelDrafter's DLM slots
        return len(self.prompt) + max(self.max_new_tokens, 1) - 1 + self.spare - used

    @property
    def spare(self) -> int:
        return self.spec.k if self.spec is not None else 0

    def metrics(self, load_s: float = 0.0) -> Metrics:
        """Its record (results.Metrics), from its timestamps; a request still running counts to now."""
        end, n = self.finished or time.perf_counter(), len(self.tokens)
        first = self.first_token or end
        decode, total = end - first, end - self.submitted
        return Metrics(prompt_tokens=len(self.prompt), cached_prompt_tokens=self.cached, new_tokens=n,
                       queue_s=(self.admitted or end) - self.submitted, ttft_s=first - self.submitted,
                       decode_s=decode, total_s=total,
                       decode_tokens_per_s=(n - 1) / decode if decode > 0 and n > 1 else 0.0,
                       e2e_tokens_per_s=n / total if total > 0 else 0.0, load_s=load_s)


def make_requests(art: Artifact, prompt: list[int], decodings: list[Decoding],
                  listeners: list[Callable[[Event], None] | None], spec: Speculation | None = None,
                  logprobs: int | None = None, echo: bool = False) -> list[Request]:
    """The choices of one prompt (OpenAI's `n`): the first leads, the others fork its prefilled prompt."""
    requests: list[Request] = []
    for d, listener in zip(decodings, listeners, strict=True):
        requests.append(Request(list(prompt), d.with_recipe(art), d.new_tokens(art), listener,
                                leader=requests[0] if requests else None, spec=spec, logprobs=logprobs, echo=echo))
    return requests


def check_fits(art: Artifact, group: list[Request], what: str = "choices") -> None:
    """The one capacity rule, applied before any work: every request of a group (admitted together)
    within the context length, and all of them together within the cache's slots, the DLM's too."""
    most = art.manifest.context_length
    for r in group:
        if len(r.prompt) + max(r.max_new_tokens, 1) - 1 > most:
            raise CapacityError(f"{len(r.prompt)} prompt tokens + {r.max_new_tokens} new tokens need "
                                f"{len(r.prompt) + r.max_new_tokens - 1} positions, past the context length {most}: "
                                "lower max_new_tokens or shorten the prompt")
    c = art.manifest.capacity
    for cache, need in (("cache", sum(r.need for r in group)), ("draft model's cache", sum(r.dlm_need for r in group))):
        if need > c:
            prompts = sum(len(r.prompt) - r.shared for r in group)  # a leader's tokens once
            k, new = sum(r.max_new_tokens > 0 for r in group), max(r.max_new_tokens for r in group)
            drafts = f" and {group[0].spare} drafts" if group[0].spare else ""
            raise CapacityError(
                f"{prompts} prompt tokens + {k} {what} x {max(new, 1) - 1} new tokens{drafts} = {need} cache "
                f"slots, but the {cache} holds {c} (the recipe's kv_slots): lower the new tokens, the number of "
                f"{what} or the draft length, or export with more kv_slots")


class Engine:
    def __init__(self, art: Artifact, max_batch: int | None = None, prefix_cache: bool | None = None) -> None:
        """`prefix_cache` (default: on when the artifact is batch invariant) reuses finished requests'
        KV for later prompts that start with the same tokens, the draft model's too."""
        invariant = art.manifest.models["tlm"].batch_invariant
        if prefix_cache and not invariant:
            raise ValueError("the prefix cache needs a batch-invariant artifact (KV reused from another call "
                             "must equal a cold prefill bit for bit): rebuild with batch_invariant = true")
        self.prefix_cache = invariant if prefix_cache is None else prefix_cache
        self.art = art
        self.max_batch = max_batch or art.manifest.capacity
        self.forest = Forest(art.tlm, prefix_cache=self.prefix_cache)
        self.dlm: Forest | None = None
        if "dlm" in art.runners:
            self.dlm = Forest(art.dlm, prefix_cache=self.prefix_cache and art.manifest.models["dlm"].batch_invariant)
        self.waiting: deque[list[Request]] = deque()  # groups: requests admitted together
        self.live: list[Request] = []
        self.on_finish: Callable[[Request], None] | None = None
        self.stats = dict(requests=0, finished=0, cancelled=0, rejected=0, tokens=0, steps=0, calls=0, busy_s=0.0,
                          drafted=0, accepted=0, prompt_tokens=0, cached_prompt_tokens=0, draft_cached_tokens=0,
                          prefix_cache_tokens=0, prefix_cache_evicted=0)
        self.policies: dict[tuple, DraftPolicy] = {}  # greedy requests', per method and settings
        self.host_ms = 0.0  # a step's wall time beyond its calls', per call
        self._prices: dict[tuple, float] = {}  # this step's prices (the costs change between steps)

    def add(self, group: list[Request]) -> None:
        """Queue requests admitted together or not at all (checked with `check_fits` first)."""
        self.waiting.append(group)
        self.stats["requests"] += len(group)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live)

    def admit(self) -> None:
        """Move waiting requests in while the cache can hold all they may need."""
        if not self.waiting:
            return
        forest, dlm = self.forest, self.dlm
        room = forest.free_slots() - sum(r.need for r in self.live)
        dlm_room = dlm.free_slots() - sum(r.dlm_need for r in self.live) if dlm is not None else 0
        while self.waiting and len(self.live) < self.max_batch:
            group = [r for r in self.waiting[0] if not r.cancelled]
            for req in self.waiting[0]:
                if req.cancelled:
                    req.listener(Event(finish="cancelled"))
            if group and group[0].leader is not None:  # its leader was cancelled: the next one leads
                group[0].leader = None
                for req in group[1:]:
                    req.leader = group[0] if req.prompt[: len(group[0].prompt)] == group[0].prompt else None
            hit = forest.cached_prefix(group[0].prompt) if group and not group[0].echo else []
            newly_pinned = int((~forest.pinned()[hit]).sum())  # cached slots no live request sees yet
            need = sum(r.need for r in group) - len(hit) + newly_pinned
            dlm_need = sum(r.dlm_need for r in group)
            if group and (need > room or dlm_need > dlm_room):
                self.waiting[0] = group
                break  # first come, first served: no overtaking that could starve a long request
            self.waiting.popleft()
            room, dlm_room = room - need, dlm_room - dlm_need
            if group:
                self.stats["prompt_tokens"] += len(group[0].prompt)
                self.stats["cached_prompt_tokens"] += len(hit)
            for req in group:
                if req.leader is None:
                    req.branch = forest.attach(hit)
                    req.cached = len(hit)
                if req.spec is not None:
                    spec, greedy = req.spec, not req.decoding.params.do_sample
                    req.drafter = make_drafter(self.art, spec.method, spec.settings, req.decoding.params, req.rng,
                                               dlm, self.stats)
                    req.policy = self.policy_for(spec.method, spec.settings, spec.fixed, greedy)
                req.admitted = time.perf_counter()
                self.live.append(req)

    def policy_for(self, method: str, settings: object, fixed: int | None, greedy: bool) -> DraftPolicy:
        """A request's draft policy: greedy ones choosing per step share the engine's (told of each new
        request, and of how many live ones share it); a sampled or fixed-length one has its own, priced by
        the compiler's costs alone."""
        if greedy and fixed is None:
            key = (method, repr(settings))
            if key not in self.policies:
                self.policies[key] = make_policy(self.art, method, settings, None, True, self.price)
            policy = self.policies[key]
            policy.new_generation(sum(r.policy is policy for r in self.live))
            return policy
        return make_policy(self.art, method, settings, fixed, False, self.compiler_price)

    def price(self, role: str, rows: int, warm: bool = True) -> float:
        """The one cost model: ms of `rows` rows of the role's model in the cheapest calls, each graph's call
        as its runner timed it (call_costs.GraphCosts: `warm` as steady plain decoding, else as drafting has
        cost), plus the host time per call."""
        key = (role, rows, warm)
        if key not in self._prices:  # asked again and again while a step is chosen
            runner = self.art.runners[role]
            plan = runner.plan(rows)
            self._prices[key] = sum(runner.costs.ms(graph, warm=warm) for graph, _ in plan) + len(plan) * self.host_ms
        return self._prices[key]

    def compiler_price(self, role: str, rows: int, warm: bool = True) -> float:
        """The same by the compiler's measurements alone (a sampled request's: no timing may steer it)."""
        runner = self.art.runners[role]
        return sum(runner.costs.ms(graph, adapt=False) for graph, _ in runner.plan(rows))

    def abort(self, req: Request, reason: str = "cancelled") -> None:
        """End a request now (a generation whose caller stopped reading, or whose step failed: "error", its
        KV not kept): its slots are freed at once."""
        if req in self.live:
            self._finish(req, reason)
        else:
            self.waiting = deque(g for g in ([r for r in g if r is not req] for g in self.waiting) if g)

    def fail(self, error: str) -> None:
        """End every live request with an error (a step that raised)."""
        for req in list(self.live):
            self._finish(req, "error", error)

    def step(self) -> None:
        """One call (or a few) for every live request: the newest token (and this round's drafts) of the
        running ones, then the next chunks of the prompts still being prefilled."""
        forest, dlm = self.forest, self.dlm
        start, calls = time.perf_counter(), self.art.tlm.calls
        runners = [dlm.runner, forest.runner] if dlm else [forest.runner]
        calls0, call_s0 = sum(r.calls for r in runners), sum(r.call_s for r in runners)
        for runner in runners:
            runner.costs.new_step()
        self._prices.clear()
        for req in [r for r in self.live if r.cancelled]:
            self._finish(req, "cancelled")
        for req in self.live:  # followers whose leader went away before sharing its prompt: the first leads
            if req.branch is None and req.leader not in self.live:
                gone, req.leader = req.leader, None
                req.branch = forest.attach([] if req.echo else forest.cached_prefix(req.prompt))
                req.cached = req.branch.length
                for other in self.live:  # the rest follow it, as admission re-leads a group
                    if other.leader is gone and other.branch is None:
                        other.leader = req if other.prompt[: len(req.prompt)] == req.prompt else None
        running = [r for r in self.live if r.branch is not None and not _prefilling(r)]
        draft_s, speculating = time.perf_counter(), [r for r in running if r.drafter]
        proposals, chosen = self._propose(speculating, len(running)) if speculating else ({}, {})
        draft_s = time.perf_counter() - draft_s
        running = [r for r in running if r in self.live]  # a draft model's NaN ends only its own request
        fed, chains, sees, keep = list(running), [], [], []  # each running request's newest token and proposal
        for req in running:
            proposal = proposals.get(id(req), NONE)
            tokens, _, tree = proposal.rows(req.tokens[-1]) if not proposal.empty else ([req.tokens[-1]], None, None)
            chains.append(list(tokens))
            sees.append(tree)
            keep.append(len(tokens))  # drafts: every row's logits
        budget = max(forest.max_rows // 4, forest.max_rows - sum(map(len, chains)))
        chunk_at = {}  # an echoing request's chunk: its first position
        for req in [r for r in self.live if r.branch is not None and _prefilling(r)]:
            if budget <= 0:
                break
            n = min(budget, len(req.prompt) - req.branch.length)
            fed.append(req)
            chains.append(req.prompt[req.branch.length : req.branch.length + n])
            sees.append(None)
            keep.append(n if req.echo else 1)  # the chunk's last row: the prompt's logits once it is the last chunk
            chunk_at[id(req)] = req.branch.length
            budget -= n
        if not fed:
            return
        fetch = not forest.runner.greedy_outputs or any(  # greedy alone (followers too): tokens, not logits
            r.decoding.params.do_sample or r.logprobs is not None or r.echo for r in self.live)
        t0 = time.perf_counter()
        kept, slots = forest.extend_rows([r.branch for r in fed], chains, keep, check=False, sees=sees, fetch=fetch)
        call_s = time.perf_counter() - t0
        rows_of = {id(r): (rows, s) for r, rows, s in zip(fed, kept, slots, strict=True)}
        for req in [r for r in fed if id(r) in chunk_at and r.echo]:  # row j: the prompt's next token's
            at, rows = chunk_at[id(req)], rows_of[id(req)][0]
            scored = rows[: len(req.prompt) - 1 - at]
            if not len(scored):  # a last chunk of one token: nothing after it to score
                continue
            if not np.isfinite(scored).all():
                self._finish(req, "error", NON_FINITE)
                continue
            req.prompt_logprobs += token_logprobs(scored, req.prompt[at + 1 : at + 1 + len(scored)], req.logprobs or 0)
        for req in self.live:  # followers fork their leader's prefilled prompt (the same prompt: its logits too)
            lead = req.leader
            if req.branch is None and id(lead) in rows_of and lead in self.live and not _prefilling(lead):
                req.branch, req.cached = forest.fork(lead.branch), lead.cached
                if len(req.prompt) == len(lead.prompt):
                    rows_of[id(req)] = rows_of[id(lead)]
                    req.prompt_logprobs = lead.prompt_logprobs
        accepted: dict[int, int] = {}
        tokens = self._emit([r for r in self.live if id(r) in rows_of and not _prefilling(r)], rows_of,
                            proposals, accepted, (start, draft_s, call_s))
        elapsed = time.perf_counter() - start
        for policy, members in chosen.values():  # each policy learns its requests' verified rounds
            drafted = [(r, kind, _drafted(proposals.get(id(r), NONE), r.drafter)) for r, kind, _ in members]
            policy.observe([(kind, d, accepted.get(id(r), 0)) for r, kind, d in drafted if not d or id(r) in accepted],
                           elapsed * 1e3)
        n = sum(r.calls for r in runners) - calls0
        if n:  # the cost model's host time per call
            host = max(0.0, (elapsed - sum(r.call_s for r in runners) + call_s0) * 1e3 / n)
            self.host_ms = host if self.host_ms == 0.0 else self.host_ms + 0.2 * (host - self.host_ms)
        self.stats["tokens"] += tokens
        self.stats["steps"] += 1
        self.stats["calls"] += self.art.tlm.calls - calls
        self.stats["busy_s"] += elapsed
        if forest.cache is not None:
            self.stats["prefix_cache_tokens"] = forest.cache.tokens
            self.stats["prefix_cache_evicted"] = forest.cache.evicted

    def _emit(self, done: list[Request], rows_of: dict, proposals: dict[int, Proposal], accepted: dict[int, int],
              times: tuple[float, float, float]) -> int:
        """Verify (drafts) or sample (a plain row) each request's next tokens, emit them, finish those that
        stop. `rows` are a request's logits, or its greedy tokens where the step fetched no logits.
        Returns the tokens emitted; `accepted` gets each drafting request's accepted drafts."""
        now, tokens = time.perf_counter(), 0
        for req in done:
            (rows, s), proposal = rows_of[id(req)], proposals.get(id(req), NONE)
            greedy = rows.ndim == 1  # each row's greedy token (-1: NaN/Inf logits)
            if not (rows >= 0).all() if greedy else not np.isfinite(rows).all():  # a token from NaN logits is garbage
                self._finish(req, "error", NON_FINITE)
                continue
            if req.max_new_tokens == 0:  # scored its prompt (echo) or prefilled a shared context: generates nothing
                self._finish(req, "length")
                continue
            choosers = [len(rows) - 1]  # the row each emitted token was chosen from
            best = rows.__getitem__ if greedy else argmax_rows(rows)
            path: list[int] = []
            if not proposal.empty:
                call, parents, _ = proposal.rows(req.tokens[-1])
                params = req.decoding.params  # greedy walks the argmax, sampling verifies exactly
                path, nxt = verify_greedy(call[: len(parents)], parents, best) if greedy or not params.do_sample \
                    else verify_tree(call[: len(parents)], parents, proposal.q, warped_rows(rows, params), req.rng)
                rejected = np.ones(len(call), dtype=bool)
                rejected[[0, *path]] = False
                self.forest.trim(req.branch, s[rejected])  # the rejected drafts' (and lookahead's window rows') KV
                emitted, choosers = [*call[path].tolist(), nxt], [0, *path]
                self.stats["drafted"] += len(proposal.tokens)
                self.stats["accepted"] += len(path)
                accepted[id(req)] = len(path)
            else:
                emitted = [int(rows[-1]) if greedy else next_token(rows[-1], req.decoding.params, req.rng)]
            if req.drafter is not None and req.tokens:  # a round (the prompt's first token is not one)
                start, draft_s, call_s = times
                req.drafter.observe(proposal, len(path), emitted, best)
                if req.rounds is not None:
                    req.rounds.record(proposal, len(path), draft_s, call_s, time.perf_counter() - start)
            req.first_token = req.first_token or now
            first = not req.tokens
            for token, row in zip(emitted, choosers, strict=True):
                req.tokens.append(token)
                tokens += 1
                lp = None if req.logprobs is None else token_logprob(rows[row], token, req.logprobs)
                if req.rounds is not None and not first:
                    req.rounds.delivered += 1  # what the caller took: it may stop inside a round's tokens
                req.listener(Event(token=token, logprob=lp))
                reason = finish_reason(self.art, req.tokens, req.decoding.stop, req.max_new_tokens)
                if reason:
                    self._finish(req, reason)
                    break
            if first and req.drafter is not None and req in self.live:
                req.drafter.start(req.prompt + req.tokens)  # the prompt and the first token
        return tokens

    def _propose(self, reqs: list[Request], rows: int) -> tuple[dict[int, Proposal], dict[int, tuple]]:
        """This round's tree of each speculating request: what its drafter offers (at most its room in the
        context, and a server request's reserved slots), of the length its policy chooses (a shared one
        for all its requests at once, pricing the step's `rows` and the drafts chosen before). A drafter
        class with `propose_batch` proposes for all its requests at once. Returns the proposals and each
        policy's requests, with the kind and most tokens each offered."""
        forest, texts, chosen, ks = self.forest, {}, {}, {}
        for req in reqs:
            room = forest.runner.max_length - 1 - req.branch.length
            texts[id(req)] = text = req.prompt + req.tokens
            kind, most = req.drafter.offer(text, room if req.spec is None else min(room, req.spec.k))
            chosen.setdefault(id(req.policy), (req.policy, []))[1].append((req, kind, most))
        live = rows  # the running requests: each emits a token
        for policy, members in chosen.values():
            shared = policy in self.policies.values()  # else a request's own: priced as if alone
            lengths = policy.choose([(kind, most) for _, kind, most in members], *((rows, live) if shared else (1, 1)))
            for (req, _, _), k in zip(members, lengths, strict=True):
                ks[id(req)] = k
                rows += policy.window if policy.method == "lookahead" and k else k
        groups: dict[type, list[Request]] = {}
        for req in reqs:
            groups.setdefault(type(req.drafter), []).append(req)
        out = {}
        for kind, group in groups.items():
            batch = getattr(kind, "propose_batch", None)
            proposals = batch([r.drafter for r in group], [texts[id(r)] for r in group], [ks[id(r)] for r in group]) \
                if batch else [r.drafter.propose(texts[id(r)], ks[id(r)]) for r in group]
            for req, p in zip(group, proposals, strict=True):
                if p is None:
                    self._finish(req, "error", NON_FINITE.replace("model", "draft model"))
                elif req.spec is None and not forest.fits(1 + len(p.tokens) + len(p.aux_tokens)):
                    out[id(req)] = NONE  # a generation's drafts take slots until verified: near a full cache, plainly
                else:
                    out[id(req)] = p
        return out, chosen

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.branch is not None:  # an error's KV may be incomplete: not kept
            self.forest.keep(req.branch, None if reason == "error" else req.prompt + req.tokens)
        if req.drafter is not None:  # a draft model's accepted prefix is kept, as the TLM's
            req.drafter.end(None if reason == "error" else req.prompt + req.tokens)
        self.live.remove(req)
        self.stats["finished"] += 1
        self.stats["cancelled"] += reason == "cancelled"
        req.finished = time.perf_counter()
        if self.on_finish is not None:
            self.on_finish(req)
        req.listener(Event(finish=reason, error=error))


def engine_of(art: Artifact) -> Engine:
    """The artifact's engine for generations (made at first use), whose prefix cache serves the next
    generation on the same artifact: a chat's earlier turns are not prefilled again."""
    if art.engine is None:
        art.engine = Engine(art)
    return art.engine


def _drafted(proposal: Proposal, drafter: Drafter) -> int:
    """What a round drafted, as the policy counts it: its tokens (lookahead: 1 for a step, 0 for none)."""
    return int(not proposal.empty) if drafter.name == "lookahead" else len(proposal.tokens)


def _prefilling(req: Request) -> bool:
    """Its prompt is not all in the cache yet (chunked prefill)."""
    return req.branch.length < len(req.prompt)
