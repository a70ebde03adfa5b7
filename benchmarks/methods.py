"""Speculation methods side by side: autoregressive, draft model, prompt lookup, lookahead decoding.

    python -m benchmarks.methods [--recipe tiny-stdlib-spd] [--repeats 2] [--max-new-tokens N] [--formats mxfp6]

For the recipe's TLM in float32 and in MXFP6 (as the recipe lowers it), on two prompt sets: the
recipe's prompts, and an input-grounded set (a function, then a request for the same function with
an argument renamed: text the model must largely repeat). Every method runs with its default
(adaptive) policy, and prompt lookup and lookahead also with speculation forced every round
("always"), to show what the policy protects against; where the artifact ships an n-gram table,
prompt lookup also runs on the text alone. The draft model runs where the artifact has one. Runs
alternate method by method, prompt by prompt, so machine drift hits all alike; each method's
policy is warmed up on one prompt first, as a served artifact would be. Greedy; prints tokens per
TLM call, decode tokens/s, the speedup over autoregressive decoding of the same artifact, and
whether the tokens equal autoregressive ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import runtime
from benchmarks.variants import build_cached, variant
from recipes import DEFAULT_RECIPE, get_recipe

GROUNDED = [  # stdlib-style code the model has to repeat with one name changed
    'def mean(values):\n    """Return the arithmetic mean of values."""\n    total = 0\n    count = 0\n'
    '    for value in values:\n        total += value\n        count += 1\n    if count == 0:\n'
    '        raise ValueError("mean of empty data")\n    return total / count\n\n\n'
    '# The same function, with the argument renamed to data:\ndef mean(data):\n    """',
    'def read_lines(path):\n    """Return the lines of the file at path."""\n    with open(path) as f:\n'
    '        lines = f.readlines()\n    return [line.rstrip("\\n") for line in lines]\n\n\n'
    '# The same function, with the argument renamed to filename:\ndef read_lines(filename):\n    """',
    'class Counter:\n    def __init__(self, start):\n        self.value = start\n\n    def increment(self, step):\n'
    '        self.value += step\n        return self.value\n\n\n'
    '# The same class, with start renamed to initial:\nclass Counter:\n    def __init__(self, initial):\n'
    '        self.',
    'def find_index(items, target):\n    """Return the index of target in items, or -1."""\n'
    '    for index, item in enumerate(items):\n        if item == target:\n            return index\n'
    '    return -1\n\n\n# The same function, with items renamed to sequence:\ndef find_index(sequence, target):\n'
    '    """',
]

METHODS = {  # name -> generate() keywords
    "autoregressive": dict(speculative=False),
    "draft model": dict(speculative="draft"),
    "prompt lookup": dict(speculative="prompt_lookup"),
    "prompt lookup (always)": dict(speculative="prompt_lookup", prompt_lookup=dict(adaptive=False)),
    "lookahead": dict(speculative="lookahead"),
    "lookahead (always)": dict(speculative="lookahead", lookahead=dict(adaptive=False)),
}


def methods_for(art) -> dict[str, dict]:
    """METHODS that this artifact can run, plus prompt lookup without its n-gram table where it has one."""
    out = {name: kw for name, kw in METHODS.items() if kw["speculative"] != "draft" or "dlm" in art.runners}
    if art.ngram_table is not None:
        out["prompt lookup (text only)"] = dict(speculative="prompt_lookup", prompt_lookup=dict(table=False))
    return out


def run_set(art, prompts: list[str], max_new: int, repeats: int) -> dict:
    methods = methods_for(art)
    for kw in methods.values():  # warm up sessions and the adaptive policies
        runtime.generate(art, prompts[0], max_new_tokens=max_new, **kw)
    runs: dict[str, list] = {name: [] for name in methods}
    for _ in range(repeats):
        for prompt in prompts:
            for name, kw in methods.items():
                runs[name].append(runtime.generate(art, prompt, max_new_tokens=max_new, **kw))
    rows = {}
    for name, results in runs.items():
        decode_tokens = sum(r.metrics.new_tokens - 1 for r in results)
        spec = [r.metrics.speculative for r in results if r.metrics.speculative]
        calls = sum(s["rounds"] + s["plain_decode_steps"] for s in spec) if spec else decode_tokens
        rows[name] = {
            "decode_tokens_per_s": decode_tokens / sum(r.metrics.decode_s for r in results),
            "tokens_per_tlm_call": decode_tokens / max(calls, 1),
            "acceptance_rate": (sum(s["accepted"] for s in spec) / max(sum(s["drafted"] for s in spec), 1)
                                if spec else None),
            "equals_autoregressive": sum(r.token_ids == a.token_ids
                                         for r, a in zip(results, runs["autoregressive"], strict=True)),
            "runs": len(results),
        }
    base = rows["autoregressive"]["decode_tokens_per_s"]
    for row in rows.values():
        row["speedup"] = row["decode_tokens_per_s"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.methods", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=DEFAULT_RECIPE)
    ap.add_argument("--out", type=Path, default=Path("reports"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--formats", default="fp32,mxfp6", help="TLM formats to run, comma-separated")
    args = ap.parse_args(argv)
    recipe = get_recipe(args.recipe)
    fmt = recipe.tlm.mx_format or "fp6_e2m3"
    recipes = {"fp32": variant(recipe, None), "mxfp6": variant(recipe, fmt, recipe.tlm.mx_lowering)}
    dirs = {which: build_cached(recipes[which], args.out / recipe.name / which) for which in args.formats.split(",")}
    sets = {"recipe prompts": list(recipe.prompts), "input-grounded": GROUNDED}
    report = {}
    for which, d in dirs.items():
        art = runtime.load_artifact(d)
        for set_name, prompts in sets.items():
            rows = run_set(art, prompts, args.max_new_tokens, args.repeats)
            report[f"{which}, {set_name}"] = rows
            print(f"\n## {recipe.name}, TLM {which}, {set_name} ({len(prompts)} prompts x {args.repeats})")
            print("| method | tokens per TLM call | decode tok/s | speedup | acceptance | = AR |")
            print("|---|---|---|---|---|---|")
            for name, r in rows.items():
                acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
                print(f"| {name} | {r['tokens_per_tlm_call']:.2f} | {r['decode_tokens_per_s']:.0f} | "
                      f"{r['speedup']:.2f}x | {acc} | {r['equals_autoregressive']}/{r['runs']} |")
    (args.out / recipe.name).mkdir(parents=True, exist_ok=True)
    (args.out / recipe.name / "methods.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
