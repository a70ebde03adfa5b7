"""An n-gram draft table: for each context of up to `order` tokens, the token a TLM most often said
next in its own answers, and how often it did (the confidence).

recipes/ngram_draft.py counts it from the TLM's greedy answers to many generated instructions; the
compiler ships it in the artifact (FILE); prompt lookup drafts from it where the text so far offers
no match (runtime/prompt_lookup.py). Drafts are verified exactly, so the table only decides speed.
Stored as plain arrays in an .npz (read without pickle): contexts left-padded with -1.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILE = "ngrams.npz"  # its name inside an artifact
FORMAT = 1
_ARRAYS = ("contexts", "next", "hits", "total", "meta")


class NgramTableError(ValueError):
    """A missing, damaged or mismatched n-gram table file."""


def vocab_fingerprint(tokenizer_dir: Path) -> str:
    """What a table's token ids mean: a hash of the vocabulary (token -> id) of a folder's tokenizer.json."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).get_vocab(with_added_tokens=True)
    return hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()


@dataclass
class NgramTable:
    order: int
    vocab_size: int
    vocab_sha256: str
    contexts: np.ndarray  # int32 [M, order], left-padded with -1
    next: np.ndarray  # int32 [M]: the most frequent next token
    hits: np.ndarray  # int32 [M]: how often it came next
    total: np.ndarray  # int32 [M]: how often the context occurred
    record: dict  # how it was made (recipe, prompts, tokens, held-out agreement)

    def __post_init__(self) -> None:
        # Consulted every round, kept per process: a context is one int (its tokens + 1 as digits of
        # base vocab_size + 1, the last token lowest), its guess one int (token * 1024 + confidence in
        # thousandths): 93,635 contexts take ~14 MB and a chain of guesses ~10 microseconds.
        self._base = self.vocab_size + 1
        powers = [self._base ** i for i in range(self.order - 1, -1, -1)]
        exact = self._base ** self.order < 2**63  # int64 holds every key; else Python ints (object arrays)
        digits = (self.contexts.astype(np.int64) + 1).astype(np.int64 if exact else object)  # padding: 0
        keys = digits @ np.array(powers, np.int64 if exact else object)
        sure = self.hits.astype(np.int64) * 1000 // np.maximum(self.total, 1)
        self._guesses: dict[int, int] = dict(zip(keys.tolist(), (self.next.astype(np.int64) * 1024 + sure).tolist(),
                                                 strict=True))

    def __len__(self) -> int:
        return len(self.next)

    def guess(self, text: Sequence[int]) -> tuple[int, float] | None:
        """The next token after `text` by its longest context in the table, with its confidence."""
        found, key, scale = None, 0, 1
        for i in range(1, min(self.order, len(text)) + 1):
            key += (int(text[-i]) + 1) * scale  # Python ints: keys may pass int64 for large vocabularies
            scale *= self._base
            found = self._guesses.get(key, found)
        return None if found is None else (found >> 10, (found & 1023) / 1000)

    def chain(self, text: Sequence[int], max_draft: int, min_confidence: float) -> tuple[float, list[int]]:
        """Up to max_draft guesses in a row, each at least min_confidence sure, and the first's confidence."""
        tail, drafted, first = list(text[-self.order:]), [], 0.0
        while len(drafted) < max_draft:
            found = self.guess(tail)
            if found is None or found[1] < min_confidence:
                break
            first = first or found[1]
            drafted.append(found[0])
            tail = [*tail[1 - self.order:], found[0]] if self.order > 1 else [found[0]]
        return first, drafted

    def save(self, path: Path) -> None:
        """Write atomically (a temporary file renamed into place)."""
        path = Path(path)
        meta = {"format": FORMAT, "order": self.order, "vocab_size": self.vocab_size,
                "vocab_sha256": self.vocab_sha256, "record": self.record}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez_compressed(f, contexts=self.contexts, next=self.next, hits=self.hits, total=self.total,
                                    meta=np.array(json.dumps(meta)))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> NgramTable:
        path = Path(path)
        if not path.is_file():
            raise NgramTableError(f"n-gram table {path} does not exist (make one with `python -m recipes.ngram_draft`)")
        try:
            with np.load(path, allow_pickle=False) as data:
                missing = sorted(set(_ARRAYS) - set(data.files))
                if missing:
                    raise NgramTableError(f"n-gram table {path} lacks {missing}: not a table of this format")
                arrays = {k: data[k] for k in _ARRAYS}
            meta = json.loads(str(arrays.pop("meta")))
        except NgramTableError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged zip or JSON, whatever the reader raises
            raise NgramTableError(f"n-gram table {path} cannot be read: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise NgramTableError(f"n-gram table {path} has format {found!r}; this version reads {FORMAT}")
        problem = _check(arrays, meta)
        if problem:
            raise NgramTableError(f"n-gram table {path}: {problem}")
        return cls(meta["order"], meta["vocab_size"], meta["vocab_sha256"], arrays["contexts"].astype(np.int32),
                   arrays["next"].astype(np.int32), arrays["hits"].astype(np.int32),
                   arrays["total"].astype(np.int32), meta.get("record", {}))

    def check_vocabulary(self, tokenizer_dir: Path, vocab_size: int, where: str) -> None:
        """Refuse a table counted with another tokenizer: its ids would mean other tokens."""
        if vocab_fingerprint(tokenizer_dir) != self.vocab_sha256 or self.vocab_size != vocab_size:
            raise NgramTableError(f"the n-gram table was counted with another tokenizer than {where}'s: "
                                  "rebuild it for this model with `python -m recipes.ngram_draft`")


def _check(arrays: dict[str, np.ndarray], meta: dict) -> str | None:
    """What is wrong with a table's arrays and metadata (None: nothing), so that a damaged file can
    never put an out-of-range id before the TLM."""
    order, vocab = meta.get("order"), meta.get("vocab_size")
    if not (isinstance(order, int) and order >= 1 and isinstance(vocab, int) and vocab >= 1
            and isinstance(meta.get("vocab_sha256"), str)):
        return "its metadata lacks order, vocab_size or vocab_sha256"
    c, m = arrays["contexts"], len(arrays["next"])
    if any(a.dtype.kind not in "iu" for a in arrays.values()):
        return "arrays must hold integers"
    if c.shape != (m, order) or any(arrays[k].shape != (m,) for k in ("next", "hits", "total")):
        return "array shapes disagree with each other"
    if m and (c.max() >= vocab or c.min() < -1 or (c[:, -1] < 0).any() or arrays["next"].max() >= vocab
              or arrays["next"].min() < 0):
        return f"token ids outside [0, {vocab})"
    if m and (arrays["total"].min() < 1 or arrays["hits"].min() < 1 or (arrays["hits"] > arrays["total"]).any()):
        return "counts must satisfy 1 <= hits <= total"
    return None
