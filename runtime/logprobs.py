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


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """log p of every token of each row of logits (the last axis), in float64."""
    x = np.asarray(rows, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))


def token_logprobs(rows: np.ndarray, tokens: list[int], top: int = 0) -> list[TokenLogprob]:
    """Each `tokens[i]`'s log probability under `rows[i]` ([n, V]), with the row's `top` most likely tokens
    (ties: lower id first); one vectorised pass for a chunk of rows (an echoed prompt's)."""
    if not 0 <= top <= MAX_TOP:
        raise ValueError(f"top must lie in [0, {MAX_TOP}], got {top}")
    lp = log_softmax(np.asarray(rows).reshape(len(tokens), -1))
    chosen = lp[np.arange(len(tokens)), tokens]
    best = [()] * len(tokens)
    if top:
        k = min(top, lp.shape[1])
        ids = np.argpartition(-lp, k - 1, axis=1)[:, :k] if k < lp.shape[1] else np.tile(np.arange(k), (len(lp), 1))
        best = [tuple((i, float(row[i])) for i in sorted(r.tolist(), key=lambda i, row=row: (-row[i], i)))
                for r, row in zip(ids, lp, strict=True)]
    return [TokenLogprob(int(t), float(c), b) for t, c, b in zip(tokens, chosen, best, strict=True)]


def token_logprob(row: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """`token`'s log probability under one row of logits (token_logprobs of one row)."""
    return token_logprobs(np.asarray(row)[None], [token], top)[0]
