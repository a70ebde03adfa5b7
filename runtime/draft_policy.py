"""How many tokens to draft in a step: the lengths that maximise the step's expected tokens per second,
for a generation and the server's batch alike (docs/runtime.md, "The draft policy", says what it weighs,
when it probes, and why only greedy requests share a policy that follows measured costs).

Why acceptance is counted as it is: a round that accepts n of k drafts has tested n + 1 of them (n <
k; the rest were never judged) or k. A draft model's tokens are accepted about independently, so a is
accepted over tested (over drafted it would read 0.59 for a = 0.8 at k = 4). A lookup's drafts are
right or wrong together (a match that fails at its first token rarely recovers), so there the untested
ones count as rejected (estimated the independent way, prompt lookup drafted more and lost 3-5% more
on the default recipe's prompts: docs/benchmarks-history.md). A draft model's probe takes the length
of the best expected rate near break-even, where k verdicts can settle the question in one probe: with
the smallest k a good draft model was seen never to start drafting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Offer = tuple[int, int]  # a request's kind of draft, and the most tokens it can draft this step


def judged(drafted: int, accepted: int, independent: bool) -> int:
    """The drafts a round tells the acceptance estimate about (the module's docstring says why)."""
    return accepted + (accepted < drafted) if independent else drafted


class DraftPolicy:
    def __init__(self, method: str, price: Callable[[str, int, bool], float], lengths: Sequence[int], window: int = 0,
                 fixed: int | None = None, adapt: bool = True, prior: float = 0.5, prior_weight: float = 4.0,
                 priors: dict[int, float] | None = None, smoothing: float = 0.2, probe_every: int = 8,
                 probe_share: float = 0.02, remeasure_every: int = 32, margin: float = 0.05) -> None:
        """`method`: "draft", "prompt_lookup" or "lookahead"; `price(role, rows, warm)`: ms of that many rows
        of the "tlm" or the "dlm" (`warm`: as steady plain decoding, else as drafting has cost); `lengths`:
        the draft lengths a step may take (compiled scoring graphs; lookahead: 1, a step); `window`: a
        lookahead step's rows beyond its root; `fixed`: always this length (where offered)."""
        if not lengths:
            raise ValueError("no score graphs: speculative decoding needs at least one draft length")
        if fixed is not None and fixed not in lengths:
            raise ValueError(f"draft_length {fixed} is not compiled; available: {sorted(lengths)}")
        self.method, self.price, self.lengths = method, price, sorted(lengths)
        self._allowed = set(self.lengths)
        self.independent = method == "draft"
        self.window, self.fixed, self.adapt, self.prior, self.prior_weight = window, fixed, adapt, prior, prior_weight
        self.priors = priors or {}  # kind -> prior acceptance, where known (else `prior`)
        self.smoothing, self.probe_every, self.probe_share = smoothing, probe_every, probe_share
        self.remeasure_every, self.margin = remeasure_every, margin
        self.counts: dict[int, list[float]] = {}  # kind -> [tested, accepted]
        self.plain_wanted = 2 if adapt else 0  # warm plain steps to measure before drafting (first, and again)
        self.plain_in_a_row = self.drafting_in_a_row = 0
        self.wait = probe_every
        self.rewarm = 0.0  # ms a plain step right after drafting costs over a warm one (its session sat idle)
        self.rows = 1  # the rows of the last plain step priced
        self.last_k: int | None = None  # the previous step's length (None: nothing yet)
        self.probe: tuple[int, float] | None = None  # this run of plain steps' probe: its length, and when it is due

    def acceptance(self, kind: int = 0) -> float:
        tested, accepted = self.counts.get(kind, (0, 0))
        prior = self.priors.get(kind, self.prior)
        return (accepted + prior * self.prior_weight) / (tested + self.prior_weight)

    def expected_tokens(self, k: int, kind: int = 0) -> float:
        """What a request emits in a step that drafts k of this kind (k = 0: a plain step's 1)."""
        return self._expected(k, self.acceptance(kind))

    def _expected(self, k: int, a: float) -> float:
        if self.method == "lookahead":
            return 1.0 + a if k else 1.0
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def fit(self, k: int, most: int) -> int:
        """A request's length when the step's is k: the longest allowed up to k and what it offers."""
        j = min(k, most)
        return j if j in self._allowed else max((i for i in self.lengths if i <= j), default=0)

    def cost(self, k: int, extra: int, drafting: int) -> float:
        """ms of a step whose TLM call has `extra` rows of drafts beyond `self.rows`, and for a draft model
        k DLM calls over `drafting` requests."""
        dlm = k * self.price("dlm", drafting, False) if self.independent and k and drafting else 0.0
        return self.price("tlm", self.rows + extra, not k) + dlm

    def _likeliest(self, offers: Sequence[Offer]) -> list[tuple[int, int, float]]:
        """Each offer's index, most tokens and acceptance, the likeliest kind first."""
        order = [(i, most, self.acceptance(kind)) for i, (kind, most) in enumerate(offers)]
        return sorted(order, key=lambda o: -o[2]) if len(order) > 1 else order

    def _step(self, k: int, order: list[tuple[int, int, float]], live: int, best_first: bool,
              plain: float) -> tuple[float, float, list[int]]:
        """Tokens, cost and each offer's length of a step of length k (`order`: `_likeliest`): every
        offer drafting, or (`best_first`) the likeliest kinds first, each while it raises the rate."""
        ks, tokens, extra, drafting, cost = [0] * len(order), float(live), 0, 0, plain
        for i, most, a in order:
            j = self.fit(k, most)
            if not j:
                continue
            rows = self.window if self.method == "lookahead" else j
            more, more_cost = tokens + self._expected(j, a) - 1.0, self.cost(k, extra + rows, drafting + 1)
            if best_first and more / more_cost <= tokens / cost:
                break
            ks[i], tokens, extra, drafting, cost = j, more, extra + rows, drafting + 1, more_cost
        return tokens, cost, ks

    def choose(self, offers: Sequence[Offer], rows: int = 1, live: int = 1) -> list[int]:
        """Each offer's length this step (0: it does not draft); `rows`: the step's TLM rows besides
        these drafts; `live`: the tokens the step emits without them (its running requests)."""
        self.rows = rows
        none = [0] * len(offers)
        if not any(most for _, most in offers):
            return none  # nothing on offer (no match): a plain step, not one the policy chose
        if self.fixed is not None:
            return [self.fit(self.fixed, most) for _, most in offers]
        if self.plain_wanted > 0:
            self.drafting_in_a_row = 0
            return none  # measure a plain step (first, or again): it is what drafting has to beat
        most, order, plain = max(m for _, m in offers), self._likeliest(offers), self.cost(0, 0, 0)
        best, bar = none, (1 + self.margin) * live / plain
        for k in self.lengths:
            if k > most:
                break
            tokens, cost, ks = self._step(k, order, live, True, plain)
            if tokens / cost > bar:
                best, bar = ks, tokens / cost
        if any(best):
            self.wait = self.probe_every
            self.drafting_in_a_row += 1
            self.plain_in_a_row, self.probe = 0, None
            if self.drafting_in_a_row >= self.remeasure_every:
                self.plain_wanted = 2  # measure a plain step again, warm (the first after drafting is cold)
            return best
        self.drafting_in_a_row = 0
        if self.plain_in_a_row >= self.wait:
            if self.probe is None:  # worked out once a run: the run's steps are alike
                k = self._probe(order, live, most, plain)
                self.probe = k, self._probe_gap(k, order, live, plain)
            if self.plain_in_a_row >= self.probe[1]:
                self.wait *= 2  # back off: the last probe did not change the choice
                self.plain_in_a_row, k, self.probe = 0, self.probe[0], None
                return self._step(k, order, live, False, plain)[2]  # is drafting paying off again?
        self.plain_in_a_row += 1
        return none

    def _probe(self, order: list[tuple[int, int, float]], live: int, most: int, plain: float) -> int:
        """A probe's length: a lookup's shortest; a draft model's of the best expected rate, every offer drafting."""
        fits = [k for k in self.lengths if k <= most]
        if not self.independent:
            return fits[0]
        rates = [tokens / cost for tokens, cost, _ in (self._step(k, order, live, False, plain) for k in fits)]
        return fits[rates.index(max(rates))]  # the shortest of equals

    def _probe_gap(self, k: int, order: list[tuple[int, int, float]], live: int, plain: float) -> float:
        """Plain steps per probe of k that keep probing within probe_share of the time. A probe also
        pays for its draft model's catch-up on the plain steps before it, and for the plain step after
        it, whose session sat idle."""
        tokens, cost, ks = self._step(k, order, live, False, plain)
        # the DLM's catch-up: a call over the plain steps' tokens (at least `wait` of them), per drafting request
        catch_up = self.price("dlm", self.wait + 1, False) * sum(map(bool, ks)) if self.independent else 0.0
        loss = cost - tokens / live * plain + catch_up + self.rewarm
        return loss / (self.probe_share * plain)

    def new_generation(self, others: int = 0) -> None:
        """A new request, beside `others` live ones that share this policy. Alone, what was learned counts
        half and probing starts over (its text may be new). Among others the batch's steps go on as they
        were and the evidence fades by 1 / (2 (others + 1)): about half (0.5-0.61) each time the batch's
        requests have all been replaced, not half at every admission of a busy server."""
        keep = 1.0 - 1.0 / (2 * (others + 1))
        self.counts = {kind: [tested * keep, accepted * keep] for kind, (tested, accepted) in self.counts.items()}
        if not others:
            self.plain_in_a_row, self.probe = 0, None
            self.wait = self.probe_every

    def observe(self, rounds: Sequence[tuple[int, int, int]], step_ms: float) -> None:
        """A finished step: (kind, drafted, accepted) of each request it offered (drafted 0: a plain
        round; lookahead: 1 for a lookahead step, and the tokens it accepted), and the step's wall time.

        A plain step right after drafting (or a first) runs a decode session that sat idle: it is not
        a warm plain step, and what it costs over one is `rewarm`, which prices probes."""
        k = max((drafted for _, drafted, _ in rounds), default=0)
        if k == 0 and self.last_k and self.adapt and self.plain_wanted == 0:  # (a sampled policy's: timing-free)
            self.rewarm += self.smoothing * (max(step_ms - self.cost(0, 0, 0), 0.0) - self.rewarm)
        if k == 0 and self.last_k == 0:
            self.plain_wanted = max(0, self.plain_wanted - 1)
        self.last_k = k
        for kind, drafted, accepted in rounds:
            counts = self.counts.setdefault(kind, [0, 0])
            counts[0] += judged(drafted, accepted, self.independent)
            counts[1] += accepted
