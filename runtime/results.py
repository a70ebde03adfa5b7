"""What a generation returns, and the stopping rules every decoding loop shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.artifact import Artifact
from runtime.tokenizer import Tokenizer


@dataclass
class Metrics:
    """One request's record, the same for a generation, a MultiDecode branch and a server request (the
    engine's Request.metrics): counts, and seconds from its arrival."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, found in the cache from an earlier call (not prefilled)
    new_tokens: int = 0
    queue_s: float = 0.0  # waiting to be admitted (the cache had no room yet)
    ttft_s: float = 0.0  # queue + prefill + first token
    decode_s: float = 0.0  # first token to the end
    total_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    e2e_tokens_per_s: float = 0.0
    load_s: float = 0.0
    speculative: dict = field(default_factory=dict)  # filled by speculative decoding

    def latencies(self) -> dict[str, float]:
        """Seconds queued, to the first token, per later token and in all: those that apply (the
        server's histograms)."""
        out = {"queue_s": self.queue_s, "e2e_s": self.total_s}
        if self.new_tokens:
            out["ttft_s"] = self.ttft_s
        if self.new_tokens > 1:
            out["tpot_s"] = self.decode_s / (self.new_tokens - 1)
        return out


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos", "length" or "stop"
    metrics: Metrics


def finish_reason(art: Artifact, ids: Sequence[int], stop: Sequence[str], max_new_tokens: int) -> str | None:
    """Why a sequence whose newest token is ids[-1] ends now ("eos", "stop", "length"), or None."""
    if ids[-1] in art.eos_token_ids:
        return "eos"
    if stop and any(s in art.tokenizer.decode(ids[-32:], skip_special_tokens=True) for s in stop):
        return "stop"
    if len(ids) >= max_new_tokens:
        return "length"
    return None


class TextPieces:
    """Tokens in, text pieces out, as they come; an incomplete multi-byte character waits for the rest.

    Each token decodes a short window, not the whole text (which would make a long generation
    quadratic): the ids from the start of the last piece on, against the same window without the
    ids not shown yet. Both decodes start at the same id, so what a tokenizer does at the start of
    a text (a stripped leading space) cancels out, as in TGI's and vLLM's detokenizers.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""
        self.start = self.read = 0  # ids[start:read] decode to the end of the text shown so far

    def add(self, token: int) -> str | None:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.start : self.read], skip_special_tokens=True)
        text = self.tokenizer.decode(self.ids[self.start :], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return None
        piece = text[len(before) :]
        self.start, self.read, self.shown = self.read, len(self.ids), self.shown + piece
        return piece

    def rest(self, final_text: str) -> str:
        """What the final text holds beyond the pieces shown (a trailing incomplete character)."""
        return final_text[len(self.shown):]
