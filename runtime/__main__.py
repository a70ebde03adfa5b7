"""`python -m runtime ARTIFACT --prompt TEXT`: generate from a compiled artifact and print metrics."""

from __future__ import annotations

import argparse
import sys

from common.manifest import ArtifactError
from common.recipe import SPECULATION_METHODS
from common.targets import TargetUnavailableError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime", description=__doc__)
    p.add_argument("artifact", help="compiled artifact folder (from python -m export)")
    p.add_argument("--prompt", help="prompt text (default: the recipe's first prompt)")
    p.add_argument("--max-new-tokens", type=int)
    sampling = p.add_argument_group("sampling (default: the recipe's [sampling] table)")
    mode = sampling.add_mutually_exclusive_group()
    mode.add_argument("--sample", action="store_true", default=None, help="sample instead of greedy decoding")
    mode.add_argument("--greedy", dest="sample", action="store_false", help="greedy decoding")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    spd = p.add_mutually_exclusive_group()
    spd.add_argument("--speculative", nargs="?", const=True, default=None, choices=[*SPECULATION_METHODS, True],
                     metavar="METHOD", help=f"speculate: the recipe's method, or one of {SPECULATION_METHODS}")
    spd.add_argument("--no-speculative", dest="speculative", action="store_false")
    p.add_argument("--draft-length", type=int, help="fix the speculative draft length (default: chosen per round)")
    la = p.add_argument_group("lookahead (default: the recipe's [lookahead] settings)")
    la.add_argument("--ngram", type=int, help="lookahead N-gram size")
    la.add_argument("--window", type=int, help="lookahead Jacobi window W")
    la.add_argument("--guesses", type=int, help="lookahead n-grams verified per step G")
    pl = p.add_argument_group("prompt lookup (default: the recipe's [prompt_lookup] settings)")
    pl.add_argument("--lookup-ngram", type=int, help="longest tail matched against the text so far")
    pl.add_argument("--max-draft", type=int, help="most tokens proposed per match")
    pl.add_argument("--no-ngram-table", dest="table", action="store_false", default=None,
                    help="draft from the text so far only, not from the artifact's n-gram table")
    p.add_argument("--always-draft", action="store_true",
                   help="prompt lookup/lookahead: speculate every round, even when plain decoding is faster")
    p.add_argument("--no-stream", action="store_true", help="print the text only at the end")
    md = p.add_argument_group("MultiDecode: several sequences in one call per step (the prompt is prefilled once)")
    md.add_argument("--n", type=int, help="parallel sampling: N completions (with --sample; branch i uses seed + i)")
    md.add_argument("--beams", type=int, help="beam search with this many beams (as transformers' num_beams)")
    md.add_argument("--length-penalty", type=float, help="beam search length penalty (default 1.0)")
    md.add_argument("--num-return", type=int, help="beam search: how many best sequences to print (default 1)")
    md.add_argument("--question", action="append",
                    help="a question over the prompt (repeat it): all answers decode together")
    args = p.parse_args(argv)

    from runtime import load_artifact, stream
    from runtime.model_runner import NonFiniteLogitsError

    try:
        art = load_artifact(args.artifact)
        prompts = art.manifest.recipe.get("prompts") or ["def main():\n"]
        prompt = args.prompt if args.prompt is not None else prompts[0]
        sampling = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        if any(x is not None for x in (args.n, args.beams, args.question, args.length_penalty, args.num_return)):
            return _multi(art, prompt, args, sampling)
        kw = dict(sampling, speculative=args.speculative, draft_length=args.draft_length, **_method_settings(args))
        results = []
        pieces = stream(art, prompt, on_done=results.append, **kw)  # checks every argument first
        chat = art.manifest.recipe.get("chat_template", False)  # the answer follows the question, not the text
        print(f"user: {prompt}\nassistant: " if chat else prompt, end="", flush=True)
        text = "".join(piece if args.no_stream else print(piece, end="", flush=True) or piece for piece in pieces)
    except (ArtifactError, TargetUnavailableError, NonFiniteLogitsError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    if args.no_stream:
        print(text, end="")
    r = results[0]
    m = r.metrics
    print(f"\n\n[{r.finish_reason}] {m.new_tokens} tokens | load {m.load_s:.2f}s | TTFT {m.ttft_s * 1e3:.1f} ms"
          f" | decode {m.decode_tokens_per_s:.1f} tok/s | end-to-end {m.e2e_tokens_per_s:.1f} tok/s")
    if m.speculative:
        s = m.speculative
        print(f"speculative ({s['method']}): {s['tokens_per_tlm_call']:.2f} tokens per TLM call | acceptance "
              f"{s['acceptance_rate']:.2f} | mean accepted length {s['mean_accepted_length']:.2f} | TLM calls "
              f"{s['tlm_calls']} | rounds {s['rounds']}, plain steps {s['plain_decode_steps']}"
              + (f" | DLM calls {s['dlm_calls']}, draft lengths {s['draft_lengths_used']}" if "dlm_calls" in s else "")
              + (f" | n-gram table offered a draft in {s['rounds_with_a_table_guess']} rounds"
                 if s.get("rounds_with_a_table_guess") else ""))
    return 0


def _multi(art, prompt: str, args: argparse.Namespace, sampling: dict) -> int:
    """--n, --beams or --question: print every sequence when all are done."""
    from runtime import beam_search, generate, generate_multi

    if sum(x is not None and x != [] for x in (args.n, args.beams, args.question)) > 1:
        raise ValueError("choose one of --n, --beams and --question")
    if args.speculative or args.draft_length is not None or _method_settings(args):
        raise ValueError("--n, --beams and --question decode several sequences in one call per step, without "
                         "speculation: drop the speculation flags")
    if args.beams is not None and (args.sample or args.seed is not None):
        raise ValueError("--beams is deterministic beam search: drop --sample/--seed")
    if args.beams is None and (args.length_penalty is not None or args.num_return is not None):
        raise ValueError("--length-penalty and --num-return apply to --beams only")
    if args.beams is not None:
        r = beam_search(art, prompt, num_beams=args.beams, max_new_tokens=args.max_new_tokens,
                        length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
                        num_return_sequences=args.num_return or 1)
        for i, s in enumerate(r.sequences):
            print(f"=== beam {i} | score {s.score:.4f} | {s.finish_reason} ===\n{prompt}{s.text}\n")
    else:
        if args.n is not None:
            r = generate(art, prompt, n=args.n, **sampling)
            heads = [f"branch {i} | seed {seed}" for i, seed in enumerate(r.seeds)]
            shown = [prompt] * args.n
        else:
            r = generate_multi(art, prompt, args.question, **sampling)
            heads = [f"question {i}" for i in range(len(args.question))]
            shown = [prompt + q for q in args.question]
        for head, text, b in zip(heads, shown, r.branches, strict=True):
            print(f"=== {head} | {b.finish_reason} | {b.metrics.new_tokens} tokens ===\n{text}{b.text}\n")
    m = r.metrics
    print(f"[{m.new_tokens} tokens in {m.steps} steps, {m.tlm_calls} TLM calls] {m.total_s:.2f}s | "
          f"{m.tokens_per_s:.1f} tok/s summed over sequences | load {m.load_s:.2f}s")
    return 0


def _method_settings(args: argparse.Namespace) -> dict:
    """The lookahead/prompt_lookup keyword dicts from the flags that were given."""
    extra = {"adaptive": False} if args.always_draft else {}
    given = {"lookahead": {"ngram": args.ngram, "window": args.window, "guesses": args.guesses},
             "prompt_lookup": {"ngram": args.lookup_ngram, "max_draft": args.max_draft, "table": args.table}}
    given = {name: {k: v for k, v in d.items() if v is not None} | extra for name, d in given.items()}
    return {name: d for name, d in given.items() if d}


if __name__ == "__main__":
    sys.exit(main())
