"""The counters users expect of speculation: step compression, acceptance per position, calls, time,
and the chain model's predicted speed-up (shared/notes/spd-math.md), one record per generation."""

from __future__ import annotations

from runtime.proposal import Proposal


class RoundStats:
    def __init__(self) -> None:
        self.rounds = self.plain_steps = self.drafted = self.accepted = self.delivered = 0
        self.drafted_at: list[int] = []  # rounds whose tree reached depth d + 1
        self.accepted_at: list[int] = []
        self.draft_s = self.tlm_s = self.round_s = 0.0
        self.spec_draft_s = self.score_s = 0.0  # the same, on drafting rounds only (the chain model's c)

    def record(self, proposal: Proposal, n_acc: int, draft_s: float, tlm_s: float, round_s: float) -> None:
        self.draft_s += draft_s
        self.tlm_s += tlm_s
        self.round_s += round_s
        if proposal.empty:
            self.plain_steps += 1  # a decode step (a lookahead window without candidates is a round)
            return
        self.rounds += 1
        self.spec_draft_s += draft_s
        self.score_s += tlm_s
        self.drafted += len(proposal.tokens)
        self.accepted += n_acc
        depth = proposal.depth
        for counts, n in ((self.drafted_at, depth), (self.accepted_at, n_acc)):
            counts.extend([0] * (depth - len(counts)))
            for d in range(n):
                counts[d] += 1

    def summary(self, method: str, tlm_calls: int) -> dict:
        a = self.accepted / self.drafted if self.drafted else 0.0
        steps = self.rounds + self.plain_steps
        score_step = self.score_s / max(self.rounds, 1)
        out = {
            "method": method,
            "rounds": self.rounds,
            "plain_decode_steps": self.plain_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": a,
            "mean_accepted_length": 1 + self.accepted / max(self.rounds, 1),
            "tokens_per_tlm_call": self.delivered / max(steps, 1),  # step compression
            "per_position_acceptance": [n / max(d, 1) for n, d in zip(self.accepted_at, self.drafted_at,
                                                                        strict=True)],
            "tlm_calls": tlm_calls,
            "draft_s": self.draft_s,
            "drafting_rounds_draft_s": self.spec_draft_s,  # proposing, on the rounds that drafted
            "tlm_s": self.tlm_s,
            "host_s": self.round_s - self.draft_s - self.tlm_s,
            "tlm_step_s": self.tlm_s / max(steps, 1),
            "tlm_score_step_s": score_step,
        }
        if method != "lookahead" and self.rounds:  # the i.i.d. chain model of shared/notes/spd-math.md
            c = self.spec_draft_s / max(self.drafted, 1) / score_step if score_step else 0.0
            k = self.drafted / self.rounds
            out["cost_ratio_c"] = c
            out["predicted_speedup"] = ((1 - a ** (k + 1)) / ((1 - a) * (c * k + 1)) if a < 1
                                        else (k + 1) / (c * k + 1))
        return out
