"""Streaming detokenization: TextPieces' windowed decode against decoding the whole text per token.

    python -m benchmarks.detokenize [--lengths 250,2000]

Feeds the default pair's tokenizer the token ids of a real Python source file and prints the
cost per token of each method, alternated twice, at each generation length.
"""

from __future__ import annotations

import argparse
import os
import time

from recipes.builtin import builtin_model_dir
from runtime.results import TextPieces
from runtime.tokenizer import Tokenizer


def whole_text(tok: Tokenizer, ids: list[int]) -> None:
    """The quadratic baseline: decode everything so far at every token."""
    shown = ""
    for i in range(1, len(ids) + 1):
        text = tok.decode(ids[:i], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            shown = text
    assert shown


def windowed(tok: Tokenizer, ids: list[int]) -> None:
    pieces = TextPieces(tok)
    for token in ids:
        pieces.add(token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="250,2000")
    args = ap.parse_args()
    tok = Tokenizer(builtin_model_dir("stdlib-tlm"))
    ids = tok(open(os.__file__).read() * 4)["input_ids"]
    print("| tokens | whole text us/token | windowed us/token |\n|---|---|---|")
    for n in map(int, args.lengths.split(",")):
        times: dict[str, list[float]] = {"whole": [], "windowed": []}
        for _ in range(2):
            for name, fn in (("whole", whole_text), ("windowed", windowed)):
                start = time.perf_counter()
                fn(tok, ids[:n])
                times[name].append((time.perf_counter() - start) / n * 1e6)
        print(f"| {n} | {min(times['whole']):.1f} | {min(times['windowed']):.1f} |")


if __name__ == "__main__":
    main()
