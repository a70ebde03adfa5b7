"""An n-gram draft made for a recipe's TLM from the TLM's own answers (retrieval drafting, as REST).

A draft model trained here (6.7M parameters, distilled on the same answers) agreed with
SmolLM2-135M-Instruct on 0.32 of held-out tokens and cost 18-24% of a TLM step: it lost 8%. A table
of what the TLM said next after each context of up to four tokens costs nothing to consult and, in
its confident contexts, is right far more often. The prompts are instructions generated from
templates and topics below (no dataset; the recipe's own prompts are left out); the answers are the
TLM's greedy ones, through this project's runtime and the recipe's artifact; every tenth prompt is
held out to measure agreement. Deterministic: fixed prompts, greedy decoding, batch-invariant kernels.

    python -m recipes.ngram_draft [--recipe smollm2-135m-chat] [--out recipes/builtin/NAME.npz]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from common.cache import cache_root
from common.ngram_table import NgramTable, vocab_fingerprint
from recipes import DEFAULT_RECIPE, get_recipe
from recipes.default_pair import BUILTIN_DIR

ORDER = 4  # the longest context counted
MIN_COUNT = 2  # a context seen once says little
HELD_OUT_EVERY = 10  # every tenth prompt's answer measures agreement instead of being counted
ANSWER_TOKENS = 128
PROMPT_TOKENS = 96  # the most an instruction below takes with its chat template (~40)
CONTEXT = 4  # prompt tokens before the answer that its first n-grams see (the chat template's "assistant\n")

TOPICS = """apples bicycles volcanoes photosynthesis the_moon gravity rainbows bees elephants the_ocean
computers the_internet electricity magnets clouds rain snow deserts forests rivers mountains earthquakes
the_sun stars planets Mars Jupiter black_holes dinosaurs fossils bacteria viruses vaccines the_heart the_brain
lungs bones muscles sleep exercise nutrition vitamins water salt sugar coffee tea bread cheese rice pasta
chocolate honey milk eggs fish birds cats dogs horses whales sharks penguins owls frogs snakes spiders ants
trees flowers grass mushrooms cotton wool paper glass steel gold silver copper iron plastic rubber wood
music painting poetry novels theatre dance photography film sculpture architecture bridges roads trains
airplanes ships cars rockets satellites telescopes microscopes clocks calendars maps compasses money banks
taxes trade markets farming fishing cooking baking gardening recycling pollution climate_change wind_power
solar_panels batteries nuclear_energy oil coal natural_gas democracy elections laws courts schools
universities libraries museums hospitals doctors nurses teachers engineers scientists mathematics algebra
geometry fractions prime_numbers probability statistics chemistry physics biology geology astronomy
history ancient_Egypt the_Roman_Empire the_Renaissance the_printing_press the_industrial_revolution
the_French_Revolution World_War_II the_Cold_War the_Olympic_Games football basketball tennis chess
languages grammar spelling writing essays reading friendship kindness honesty patience courage
happiness stress time_management teamwork leadership public_speaking job_interviews saving_money
budgets investing credit_cards passwords encryption email smartphones social_media video_games robots
artificial_intelligence Python_programming variables loops functions lists dictionaries recursion sorting
databases spreadsheets operating_systems""".split()
TEMPLATES = [
    "What is {t}?", "Explain {t} in simple terms.", "Tell me three facts about {t}.",
    "Why is {t} important?", "Write a short paragraph about {t}.", "Give me two tips related to {t}.",
    "How does {t} work?", "What are the benefits of {t}?", "Describe {t} to a child.",
    "Write a haiku about {t}.", "What is the history of {t}?", "List some common questions about {t}.",
]
CODE = ["Write a Python function that {c}.", "Write Python code that {c}, and explain it briefly."]
TASKS = ["returns the square of a number", "reverses a string", "checks whether a number is prime",
         "sums a list of numbers", "counts the vowels in a word", "finds the largest item in a list",
         "converts Celsius to Fahrenheit", "returns the factorial of n", "checks whether a word is a palindrome",
         "removes duplicates from a list", "sorts a list of names", "reads a text file and counts its lines",
         "returns the n-th Fibonacci number", "merges two dictionaries", "finds the average of a list",
         "capitalizes every word in a sentence", "computes the greatest common divisor of two numbers",
         "returns the even numbers of a list", "checks whether a year is a leap year", "flattens a nested list"]
ARITHMETIC = ["What is {a} + {b}?", "What is {a} times {b}?", "What is {a} minus {b}?", "Is {a} larger than {b}?"]


def instructions(exclude: Sequence[str] = (), seed: int = 7) -> list[str]:
    """Deterministic instructions: templates x topics, coding tasks, arithmetic; `exclude` left out."""
    topics = sorted({w.replace("_", " ") for w in TOPICS})
    out = [t.format(t=w) for w in topics for t in TEMPLATES] + [c.format(c=x) for x in TASKS for c in CODE]
    rng = random.Random(seed)
    out += [rng.choice(ARITHMETIC).format(a=rng.randint(2, 99), b=rng.randint(2, 99)) for _ in range(200)]
    rng.shuffle(out)
    return [p for p in dict.fromkeys(out) if p not in set(exclude)]


def positions(sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Iterator[tuple[list[int], int]]:
    """Every answer position as (text, i): the answer after its prompt's last `CONTEXT` tokens (which
    may start a context), and the index of a token of the answer."""
    for prompt, answer in sequences:
        seq = [*prompt[-CONTEXT:], *answer]
        for i in range(min(CONTEXT, len(prompt)), len(seq)):
            yield seq, i


def count(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], order: int = ORDER,
          min_count: int = MIN_COUNT) -> dict[tuple[int, ...], Counter]:
    """Next-token counts of every context of 1..order tokens before each answer token, kept where
    the context occurred min_count times or more."""
    counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for seq, i in positions(sequences):
        for n in range(1, min(order, i) + 1):
            counts[tuple(seq[i - n : i])][seq[i]] += 1
    return {c: n for c, n in counts.items() if n.total() >= min_count}


def table_from_counts(counts: dict[tuple[int, ...], Counter], order: int, tokenizer_dir: Path, vocab_size: int,
                      record: dict) -> NgramTable:
    contexts = sorted(counts)
    padded = np.full((len(contexts), order), -1, np.int32)
    for i, c in enumerate(contexts):
        padded[i, order - len(c):] = c
    best = [counts[c].most_common(1)[0] for c in contexts]
    return NgramTable(order, vocab_size, vocab_fingerprint(tokenizer_dir), padded,
                      np.array([t for t, _ in best], np.int32).reshape(-1), np.array([h for _, h in best], np.int32),
                      np.array([counts[c].total() for c in contexts], np.int32), record)


def agreement(table: NgramTable, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict:
    """How often the table's guess is the TLM's next token on answers it did not count, per confidence
    tenth (where the guess is that sure, how often it is right, and how many positions that is)."""
    seen = np.zeros(11, np.int64)
    right = np.zeros(11, np.int64)
    total = 0
    for seq, i in positions(sequences):
        total += 1
        found = table.guess(seq[:i])
        if found is not None:
            tenth = int(found[1] * 10)
            seen[tenth] += 1
            right[tenth] += found[0] == seq[i]
    total = max(total, 1)
    return {
        "positions": total,
        "guessed": int(seen.sum()) / total,
        "top1": int(right.sum()) / total,
        "by_confidence": {f"{t / 10:.1f}": {"share": int(seen[t]) / total, "right": int(right[t]) / int(seen[t])}
                          for t in range(11) if seen[t]},
    }


def match_agreement(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], ngram: int = 3) -> dict:
    """The same for prompt lookup's matches in the text so far (prompt and answer), per match length:
    what the draft policy expects of each kind of draft before it has seen any (runtime/prompt_lookup.py)."""
    from runtime.prompt_lookup import TextIndex

    seen, right, total = Counter(), Counter(), 0
    for prompt, reply in sequences:
        index = TextIndex(ngram, prompt)
        for token in reply:
            total += 1
            n, found = index.match(1)
            if n:
                seen[n] += 1
                right[n] += int(found[0] == token)
            index.extend([token])
    return {str(n): {"share": seen[n] / max(total, 1), "right": right[n] / seen[n]} for n in sorted(seen)}


def answer(artifact_dir: Path, prompts: Sequence[str], batch: int, tokens: int = ANSWER_TOKENS,
           progress: bool = True) -> list[tuple[list, list]]:
    """The TLM's greedy answers (prompt ids, answer ids), `batch` questions decoded together."""
    from tqdm import tqdm

    import runtime
    from runtime.request import encode_prompt

    art = runtime.load_artifact(artifact_dir)
    out = []
    with tqdm(total=len(prompts), desc="answering", unit="prompt", disable=not progress) as bar:
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            result = runtime.generate_multi(art, None, chunk, max_new_tokens=tokens)
            out += [(encode_prompt(art, p), list(b.token_ids)) for p, b in zip(chunk, result.branches, strict=True)]
            bar.update(len(chunk))
    return out


def main(argv: list[str] | None = None) -> None:
    """Answer the instructions with the recipe's TLM, count the n-grams, write the table and its record."""
    from export.pipeline import build_artifact

    p = argparse.ArgumentParser(prog="python -m recipes.ngram_draft", description=main.__doc__)
    p.add_argument("--recipe", default=DEFAULT_RECIPE)
    p.add_argument("--out", type=Path, help="default: recipes/builtin/<recipe>-ngrams.npz")
    p.add_argument("--artifact", type=Path, help="an artifact of the recipe with KV slots for --batch answers "
                   "at once (default: built into the cache with batch x 224 slots)")
    p.add_argument("--batch", type=int, default=10, help="questions decoded together")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS, help="longest answer")
    p.add_argument("--limit", type=int, help="only the first N instructions (a quick try)")
    args = p.parse_args(argv)
    for name in ("batch", "answer_tokens", "limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    recipe = get_recipe(args.recipe)
    out = args.out or BUILTIN_DIR / f"{recipe.name}-ngrams.npz"
    start = time.time()
    artifact = args.artifact
    if artifact is None:  # the recipe's TLM and formats; room for `batch` answers at once
        slots = args.batch * (PROMPT_TOKENS + args.answer_tokens)
        artifact = cache_root() / "ngram-draft" / recipe.name
        build_artifact(replace(recipe, kv_slots=max(slots, recipe.context_length), speculative=False,
                               ngram_table=""), artifact, force=True)
    prompts = instructions(exclude=recipe.prompts)[: args.limit]
    answers = answer(artifact, prompts, args.batch, args.answer_tokens)
    counted = [a for i, a in enumerate(answers) if i % HELD_OUT_EVERY]
    held_out = [a for i, a in enumerate(answers) if not i % HELD_OUT_EVERY]
    vocab_size = json.loads((Path(artifact) / "manifest.json").read_text())["models"]["tlm"]["dims"]["vocab_size"]
    record = {"recipe": recipe.name, "tlm": recipe.tlm.model, "order": ORDER, "min_count": MIN_COUNT,
              "prompts_counted": len(counted), "prompts_held_out": len(held_out),
              "tokens_counted": sum(len(a) for _, a in counted), "answer_tokens": args.answer_tokens}
    table = table_from_counts(count(counted), ORDER, Path(artifact) / "tokenizer", vocab_size, record)
    rates = agreement(table, held_out) | {"by_match_length": match_agreement(held_out, recipe.prompt_lookup.ngram)}
    record |= {"contexts": len(table), "held_out": rates, "seconds": round(time.time() - start)}
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    h = record["held_out"]
    print(f"{out}: {len(table):,} contexts from {record['tokens_counted']:,} answer tokens; held out: a guess at "
          f"{h['guessed']:.0%} of positions, right at {h['top1']:.0%}")


if __name__ == "__main__":
    main()
