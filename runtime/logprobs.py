"""Log probabilities of tokens under the target model, as OpenAI's `logprobs` report them.

Computed from the float32 logits of the very call that chose each token (with speculation: the
verification call's row, which equals autoregressive decoding's bit for bit on a batch-invariant
artifact), before any temperature or top-k/top-p warping: the model's own distribution, as vLLM
reports by default. The log-sum-exp runs in float64, so the only rounding is the logits' own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP = 20  # alternatives per token, OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens of the row, most likely first


def log_softmax(row: np.ndarray) -> np.ndarray:
    """log p of every token of one row of logits, in float64."""
    x = np.asarray(row, dtype=np.float64)
    top = x.max()
    return x - (top + np.log(np.exp(x - top).sum()))


def token_logprob(row: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """`token`'s log probability under `row`, with the row's `top` most likely tokens (ties: lower id first)."""
    if not 0 <= top <= MAX_TOP:
        raise ValueError(f"top must lie in [0, {MAX_TOP}], got {top}")
    lp = log_softmax(row)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        ids = np.argpartition(-lp, top - 1)[:top] if top < len(lp) else np.arange(len(lp))
        ids = sorted(ids.tolist(), key=lambda i: (-lp[i], i))
        best = tuple((i, float(lp[i])) for i in ids)
    return TokenLogprob(int(token), float(lp[token]), best)
