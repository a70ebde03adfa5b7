"""How many tokens the greedy requests of a shared step draft: the batch's expected tokens per second.

A step advances `live` requests in one TLM call (or a few); `n` of them may draft k tokens each.
Drafting adds k * n rows to the TLM call and, for draft-model requests, k DLM calls. The expected
extra tokens are n * (a - a^(k+1)) / (1 - a), with `a` the recent acceptance rate (the chain model
of shared/notes/spd-math.md), estimated over the drafts the TLM judged (runtime.draft_policy.judged:
a draft model's round stops at its first rejection). Call costs are the compiler's measurements
(manifest) plus the host time per call this process measures, so in a full batch, where the
drafts' rows are real compute, the policy steps plainly, and alone it drafts when that pays. After
a run of plain steps it drafts once with k = 1 (a probe), so acceptance learned on other text does
not rule forever. Only greedy requests follow it: their output does not depend on k.
"""

from __future__ import annotations

from collections.abc import Callable


class BatchDraftPolicy:
    def __init__(self, call_ms: Callable[[str, int], tuple[float, int]], probe_every: int = 16,
                 decay: float = 0.9) -> None:
        """call_ms(role, rows) -> (measured ms, calls) of that many rows in the cheapest calls the graphs allow."""
        self.call_ms, self.probe_every, self.decay = call_ms, probe_every, decay
        self.tested = self.accepted = 0.0  # decayed counts of judged and accepted drafts: recent text matters most
        self.host_ms = 0.0  # per call, beyond the compiler's measurement
        self.plain_in_a_row = 0

    def acceptance(self) -> float:
        return (self.accepted + 2) / (self.tested + 4)  # a prior of 0.5, worth 4 drafts

    def _cost(self, role: str, rows: int) -> float:
        ms, calls = self.call_ms(role, rows)
        return ms + calls * self.host_ms

    def choose(self, live: int, drafting: int, with_dlm: int, k_max: int) -> int:
        """The draft length of this step's greedy drafting requests (0: a plain step)."""
        a, best, best_rate = self.acceptance(), 0, live / self._cost("tlm", live)
        for k in range(1, k_max + 1):
            gain = drafting * (a - a ** (k + 1)) / (1 - a)
            cost = self._cost("tlm", live + k * drafting) + (k * self._cost("dlm", with_dlm) if with_dlm else 0.0)
            if (live + gain) / cost > best_rate:
                best, best_rate = k, (live + gain) / cost
        if best:
            self.plain_in_a_row = 0
            return best
        self.plain_in_a_row += 1
        if self.plain_in_a_row >= self.probe_every:
            self.plain_in_a_row = 0
            return 1
        return 0

    def observe(self, tested: int, accepted: int, step_ms: float, predicted_ms: float, calls: int) -> None:
        """How many drafts a step had judged (`judged`) and accepted, and its wall time against the
        compiler's prediction."""
        if tested:
            self.tested = self.decay * self.tested + tested
            self.accepted = self.decay * self.accepted + accepted
        if calls:
            host = max(0.0, (step_ms - predicted_ms) / calls)
            self.host_ms = host if self.host_ms == 0.0 else 0.8 * self.host_ms + 0.2 * host
