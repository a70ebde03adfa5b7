"""How many tokens to draft this round: the one that maximises expected tokens per second.

With acceptance a per drafted token (the i.i.d. model of shared/notes/spd-math.md), a round that
drafts k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens. A round that accepts n of k drafts has
tested n + 1 of them (n < k; the rest were never judged) or k (n = k): for a draft model, whose
tokens are accepted about independently (`independent`), a is estimated as accepted over tested;
over drafted it would read 0.59 for a = 0.8 at k = 4. A lookup's drafts are right or wrong
together (a match that fails at its first token rarely recovers), so there the untested ones count
as rejected (docs/benchmarks-history.md: estimated the independent way, prompt lookup drafted more and lost
3-5% more on the default recipe's prompts). Acceptance is estimated per kind of draft where a drafter
tells kinds apart (prompt lookup: the match length, since a match of one token is right far less
often than one of three), so that a good kind is drafted and a poor one is not. A round of k
costs round(k): its whole wall
time (DLM catch-up and drafting, the scoring call, host work), first estimated as
score(k) + (k + 1) * dlm_step; k = 0 is a plain decode step: 1 token for decode. The policy picks
the best compiled k, so when drafting does not pay (low acceptance, a slow DLM, a costly scoring
call) it decodes plainly and speculation costs no more than autoregressive decoding beyond its
estimation error.

Costs start from the compiler's measurements (manifest). With `adapt_costs` they follow what this
process measures (the faster of a k's first two warm rounds replaces its estimate, later ones are
averaged in), since the machine, its load, host work and the interplay of sessions differ; the
first rounds are then plain steps, to measure what drafting must beat. The runtime adapts only when
the TLM is greedy, where the output does not depend on k. When it samples, choices must depend on nothing
but the seeded random stream (acceptances), so that a seed reproduces a run. The acceptance
estimate starts at a prior worth a few drafts (per kind where the drafter knows one: how often such a
draft was right on an n-gram table's held-out answers). After a run of plain rounds the policy drafts once
(a probe), so a generation whose text turns predictable later is noticed: with the smallest k, or
for independent drafts with the k of the best expected rate (the smallest while drafting looks
hopeless, a longer one near break-even, where k independent verdicts can settle the question in
one probe: with the smallest k a good draft model was seen never to start drafting). A lookup's
longer probe tells little more than its first token and costs a longer scoring call. The
run is at least `probe_every` rounds, doubles after each probe that changed nothing, and is long
enough that probes cost at most `probe_share` of the time when drafting does not pay (a probe
loses its cost minus the plain steps its expected tokens would have taken, plus its drafter's
catch-up on those plain steps, plus what the plain step after it costs over a warm one).
Drafting must be predicted `margin` faster than plain decoding: near break-even, noise in the
estimates would make it lose as often as win. A plain step is
measured only when the one before it was plain too: the first of a generation, or one right after
drafting, runs a decode session that sat idle. Two are measured before the first draft, and a
plain step faster than the estimate replaces it at once (slower ones are averaged in), so that
plain decoding is not underrated. Symmetrically, after `remeasure_every` drafting rounds in a row
plain steps are measured again.
"""

from __future__ import annotations


def judged(drafted: int, accepted: int, independent: bool) -> int:
    """The drafts a round tells the acceptance estimate about: those the target judged (the accepted
    ones and the first rejected) when drafts are accepted independently (a draft model); all of them
    for a lookup, whose drafts stand or fall together."""
    return accepted + (accepted < drafted) if independent else drafted


class DraftPolicy:
    def __init__(
        self,
        score_ms: dict[int, float],
        decode_ms: float,
        dlm_step_ms: float | None,
        fixed: int | None = None,
        adapt_costs: bool = True,
        prior: float = 0.5,
        prior_weight: float = 4.0,
        priors: dict[int, float] | None = None,
        smoothing: float = 0.2,
        probe_every: int = 8,
        probe_share: float = 0.02,
        remeasure_every: int = 32,
        margin: float = 0.05,
        independent: bool = True,
    ) -> None:
        if not score_ms:
            raise ValueError("no score graphs: speculative decoding needs at least one draft length")
        if fixed is not None and fixed not in score_ms:
            raise ValueError(f"draft_length {fixed} is not compiled; available: {sorted(score_ms)}")
        # Unknown costs (0 or None: not measured at build) start as the usual assumption: scoring
        # k+1 tokens costs one decode step, a DLM step a tenth of it (drafts that cost nothing, such
        # as prompt lookup's, pass 0.0). Measurements replace them within rounds.
        decode = decode_ms if decode_ms > 0 else 1.0
        dlm_step = 0.1 * decode if dlm_step_ms is None else dlm_step_ms
        self.cost = {k: (v if v > 0 else decode) + (k + 1) * dlm_step for k, v in score_ms.items()}
        self.cost[0] = decode
        self.measured: set[int] = set()
        self.first: dict[int, float] = {}  # a draft length's first warm round, until a second confirms it
        self.tried: set[int] = set()  # draft lengths run at least once (whose sessions are warm)
        self.plain_wanted = 2  # warm plain steps to measure before drafting (first, and on re-measuring)
        self.fixed, self.adapt_costs, self.prior, self.prior_weight = fixed, adapt_costs, prior, prior_weight
        self.priors = priors or {}  # kind -> prior acceptance, where known (else `prior`)
        self.smoothing, self.probe_every, self.probe_share = smoothing, probe_every, probe_share
        self.remeasure_every, self.margin, self.independent = remeasure_every, margin, independent
        # Per kind of draft (a lookup's match length: a 1-token match is right far less often than a
        # 3-token one; one kind, 0, for other drafters): drafted tokens the TLM judged, those it accepted.
        self.counts: dict[int, list[int]] = {}  # kind -> [tested, accepted]
        self.kind = 0  # this round's kind, from choose() to observe()
        self.plain_in_a_row = self.drafting_in_a_row = 0
        self.wait = probe_every
        self.catch_up = 0.0  # ms the last probe spent feeding the DLM what the plain steps before it committed
        self.rewarm = 0.0  # ms a plain step right after drafting costs over a warm one (its session sat idle)
        self.last_k: int | None = None  # the previous round's k (None: a generation starts)

    @property
    def k_max(self) -> int:
        return max(k for k in self.cost if k > 0)

    @property
    def tested(self) -> int:
        return sum(t for t, _ in self.counts.values())

    @property
    def acceptance(self) -> float:
        """The acceptance estimate of this round's kind of draft."""
        tested, accepted = self.counts.get(self.kind, (0, 0))
        prior = self.priors.get(self.kind, self.prior)
        return (accepted + prior * self.prior_weight) / (tested + self.prior_weight)

    def expected_tokens(self, k: int) -> float:
        a = self.acceptance
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def rate(self, k: int) -> float:
        """Expected tokens per ms of a round that drafts k tokens (k = 0: a plain decode step)."""
        return self.expected_tokens(k) / self.cost[k]

    def choose(self, limit: int, kind: int = 0) -> int:
        """The draft length for this round; at most `limit` (the slots left for scoring); `kind`: what
        kind of draft is on offer (its acceptance is estimated apart)."""
        self.kind = kind
        if self.fixed is not None:
            return max((k for k in self.cost if k <= min(limit, self.fixed)), default=0)
        if self.adapt_costs and self.plain_wanted > 0:
            self.drafting_in_a_row = 0
            return 0  # measure a plain step (first, or again): it is what drafting has to beat
        # The fastest k, where drafting must beat plain decoding by the margin: too close to call,
        # estimation noise would make it lose as often as win; and the fastest drafting k, a
        # probe's. (Runs every round: kept lean.)
        best, bar, probe, probe_rate = 0, (1 + self.margin) / self.cost[0], 0, 0.0
        for k, cost in self.cost.items():
            if 0 < k <= limit:
                rate = self.expected_tokens(k) / cost
                if not probe or (rate > probe_rate if self.independent else k < probe):
                    probe, probe_rate = k, rate
                if rate > bar:
                    best, bar = k, rate
        if best > 0:
            self.wait = self.probe_every
            self.drafting_in_a_row += 1
            self.plain_in_a_row = 0
            if self.drafting_in_a_row >= self.remeasure_every:
                # A plain step's cost goes stale while drafting (one slow spell of the machine would
                # otherwise keep it high): measure it again, warm (the first after drafting is cold).
                self.plain_wanted = 2
            return best
        self.drafting_in_a_row = 0
        if probe and self.plain_in_a_row >= self.wait and self.plain_in_a_row >= self._probe_gap(probe):
            self.wait *= 2  # back off: the last probe did not change the choice
            self.plain_in_a_row = 0
            return probe  # is drafting paying off again?
        self.plain_in_a_row += 1
        return 0

    def _probe_gap(self, k: int) -> float:
        """Plain rounds per probe of k that keep probing within probe_share of the time. A probe
        also pays for its drafter's catch-up on the plain steps before it (a DLM prefill, cold), and
        for the plain step after it, whose session sat idle."""
        loss = self.cost[k] - self.expected_tokens(k) * self.cost[0] + self.catch_up + self.rewarm
        return loss / (self.probe_share * self.cost[0])

    def new_generation(self) -> None:
        self.counts = {kind: [tested // 2, accepted // 2] for kind, (tested, accepted) in self.counts.items()}
        self.plain_in_a_row = 0
        self.wait = self.probe_every
        self.last_k = None

    def observe(self, k: int, accepted: int, round_ms: float, catch_up_ms: float = 0.0, cold: bool = False) -> None:
        """A finished round: k drafted (0: a decode step), how many were accepted, its wall time
        (without `catch_up_ms`, the drafter's catch-up on earlier plain steps, which prices probes).

        A plain step right after drafting (or first in a generation) runs a decode session that sat
        idle and costs more than the steady plain decoding it stands for; the first round of a draft
        length runs its scoring session for the first time; `cold`: the drafter ran a graph of its
        own for the first time (its first catch-up, its first 2-token catch-up). None is measured: a
        cold first measurement, rescaling the others, could keep the policy off the best draft length
        for good (on stdlib-wide-spd a first DLM prefill of 5.9 ms, against 1.1-1.8 warm, spaced
        probes ~230 plain steps apart, and a draft accepted 0.8 of the time went unused)."""
        if k == 0 and self.last_k and 0 in self.measured:
            self.rewarm += self.smoothing * (max(round_ms - self.cost[0], 0.0) - self.rewarm)
        cold = cold or (self.last_k != 0 if k == 0 else k not in self.tried)
        self.last_k = k
        self.tried.add(k)
        if catch_up_ms > 0 and not cold:  # the first catch-up also opened the drafter's sessions
            self.catch_up = catch_up_ms
        if self.adapt_costs and not cold:
            if k == 0:
                self.plain_wanted = max(0, self.plain_wanted - 1)
            if k in self.measured:
                self.cost[k] += self.smoothing * (round_ms - self.cost[k])
                if k == 0:  # a faster plain step counts at once: underrating plain decoding can lose
                    self.cost[0] = min(self.cost[0], round_ms)
            elif k and k not in self.first:  # one round of a draft length can be a spike (a DLM graph's
                self.first[k] = round_ms     # second run took 7.6 ms against 1.9): wait for another
            else:  # a first measurement (drafting: the faster of two) replaces the estimate, and rescales
                measured = min(round_ms, self.first.pop(k, round_ms))  # the unmeasured drafting ones
                scale = measured / self.cost[k]
                self.cost[k] = measured
                self.measured.add(k)
                if k:
                    for j in self.cost:
                        if j and j not in self.measured:
                            self.cost[j] *= scale
        counts = self.counts.setdefault(self.kind, [0, 0])
        counts[0] += judged(k, accepted, self.independent)
        counts[1] += accepted
