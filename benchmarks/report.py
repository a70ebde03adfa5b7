"""Per-recipe tokens/s report: the four configurations of the Qualcomm article's Figure 7, side by side,
and the draft-free speculation methods.

    python -m benchmarks.report [--recipe tiny-stdlib-spd] [--out reports] [--repeats 1] [--warmup 1]
                                [--tlm DIR] [--dlm DIR] [--bandwidth-gib 1]

Configurations: baseline (unquantized TLM, autoregressive), MXFP6 TLM autoregressive, unquantized
speculative decoding, MXFP6 + speculative decoding ("SpD": the recipe's method, its draft model if
it has a [dlm], else its draft-free method), and MXFP6 with each draft-free method (prompt lookup,
lookahead) that is not already the recipe's. Two artifacts are built (cached while the recipe is
unchanged): the recipe with its TLM unquantized, and with its TLM in MXFP6 (the recipe's format
and lowering, fp6_e2m3 fused if it names none); both carry the recipe's DLM, if any. Runs alternate between
configurations prompt by prompt so machine drift hits all alike. Every run is greedy, and the
report checks that speculative output equals autoregressive output of the same compiled TLM.
Writes report.json, report.md and report.png under OUT/RECIPE/. A configuration whose artifact
does not fit this machine (export or load) is reported as "does not fit", with the estimate.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

import runtime
from benchmarks.bandwidth import cpu_name, gpu_name, gpu_read_bandwidth_gbs, read_bandwidth_gbs, weight_bytes_per_call
from benchmarks.intervals import geometric_mean_interval
from benchmarks.memory import weights_file_mib
from benchmarks.variants import build_cached, variant
from common.recipe import TARGETS
from common.resources import DoesNotFitError
from common.targets import get_target
from export.loader import is_available
from recipes import DEFAULT_RECIPE, get_recipe
from runtime.request import check_draft_length

FIGURE_7 = {  # name -> (artifact, speculative: False, True for the recipe's method, or a method)
    "baseline": ("fp32", False),
    "MXFP6": ("mxfp6", False),
    "SpD": ("fp32", True),
    "MXFP6 + SpD": ("mxfp6", True),
}
DRAFT_FREE = {"prompt_lookup": "prompt lookup", "lookahead": "lookahead"}
AUTOREGRESSIVE = {"fp32": "baseline", "mxfp6": "MXFP6"}  # each artifact's autoregressive row


def configs(recipe) -> dict[str, tuple[str, bool | str]]:
    """Figure 7's four, then MXFP6 with each draft-free method the recipe's SpD is not."""
    return FIGURE_7 | {f"MXFP6 + {label}": ("mxfp6", method) for method, label in DRAFT_FREE.items()
                       if method != recipe.speculation}


def memory_mib(art_dir: Path) -> dict:
    """PSS of a fresh process that loads the artifact and generates (benchmarks.memory)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", str(art_dir)], capture_output=True,
                          text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    out = json.loads(proc.stdout)
    return {"pss_after_generate_mib": out["after_generate_mib"]["pss"], "weights_mib": out["weights_file_mib"]}


def run_all(arts: dict, rows: dict, prompts: list[str], max_new: int | None, warmup: int, repeats: int,
            draft_length: int | None = None) -> dict:
    """Every configuration (`rows`, as configs()) on every prompt, interleaved, in the order
    `round_order` gives each prompt (a configuration always run after the same one, or always first,
    would carry what that one leaves in caches, and the box's drift within a round, into its figures);
    `draft_length` fixes SpD's draft length (None: the timed policy chooses, and may choose not to draft)."""
    runs: dict[str, list] = {name: [] for name in rows}

    def one(which: str, spd: bool | str, prompt: str):
        for runner in arts[which].runners.values():  # cold: a repeated prompt would find its prefix in the caches
            runner.forget()
        return runtime.generate(arts[which], prompt, max_new_tokens=max_new, speculative=spd,
                                draft_length=draft_length if spd is True else None)

    for which, spd in rows.values():
        for _ in range(warmup):
            one(which, spd, prompts[0])
    items = list(rows.items())
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            for j in round_order(len(items), r * len(prompts) + i):
                name, (which, spd) = items[j]
                runs[name].append((i, one(which, spd, prompt)))
    return runs


def round_order(n: int, i: int) -> list[int]:
    """Round i's order of n configurations, a Williams design: over n rounds each comes first once and
    right after each other one once (for odd n over 2n rounds, the second n mirrored)."""
    if n == 0:
        return []
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    order = [(s + i) % n for s in first]
    return order[::-1] if (i // n) % 2 else order


def summarize(runs: list) -> dict:
    m = [r.metrics for _, r in runs]
    decode_tokens = sum(max(x.new_tokens - 1, 0) for x in m)
    row = {
        "new_tokens": sum(x.new_tokens for x in m),
        "decode_tokens_per_s": decode_tokens / sum(x.decode_s for x in m),
        "e2e_tokens_per_s": sum(x.new_tokens for x in m) / sum(x.total_s for x in m),
        "ttft_ms": 1000 * float(np.mean([x.ttft_s for x in m])),
    }
    spec = [x.speculative for x in m if x.speculative]
    # model calls per decoded token, for the bandwidth floor (a DLM's count includes its prompt prefill)
    calls = sum(s["rounds"] + s["plain_decode_steps"] for s in spec) if spec else decode_tokens
    row["tlm_calls_per_token"] = calls / decode_tokens
    row["dlm_calls_per_token"] = sum(s.get("dlm_calls", 0) for s in spec) / decode_tokens
    if spec:  # pooled over all rounds of all prompts, like the token rates
        accepted, rounds = sum(s["accepted"] for s in spec), sum(s["rounds"] for s in spec)
        drafted = sum(s["drafted"] for s in spec)
        row["acceptance_rate"] = accepted / max(drafted, 1)
        row["mean_accepted_length"] = 1 + accepted / max(rounds, 1)
        # where a round's time goes, pooled: one TLM call (scoring or a plain step), drafting, host work
        steps = max(sum(sp["rounds"] + sp["plain_decode_steps"] for sp in spec), 1)
        row["tlm_score_ms"] = 1000 * sum(sp["tlm_s"] for sp in spec) / steps
        # per drafted token, on the rounds that drafted (a plain step's proposing, such as a lookup
        # that found no match, is no draft step)
        row["dlm_step_ms"] = 1000 * sum(sp["drafting_rounds_draft_s"] for sp in spec) / drafted if drafted else None
        row["host_ms_per_round"] = 1000 * sum(sp["host_s"] for sp in spec) / steps
    return row


def _decode_rate(result) -> float | None:
    """Tokens per second after the first token, or None for a generation with nothing to time."""
    m = result.metrics
    return (m.new_tokens - 1) / m.decode_s if m.new_tokens > 1 and m.decode_s > 0 else None


def paired_ratio(runs: list, baseline: list) -> dict | None:
    """A row's decode speed over its baseline's, generation by generation: both ran the same prompt in
    the same round, so each pair's ratio is free of what the prompt asks and of the box's drift between rounds.
    The geometric mean of those ratios and its 95% t interval (None under 4 pairs): on this noisy box one
    row's pooled figure moves by several percent run to run, so a row is below a gate (0.97x its
    baseline, say) only where its whole interval is."""
    rates = [(_decode_rate(r), _decode_rate(b)) for (_, r), (_, b) in zip(runs, baseline, strict=True)]
    if interval := geometric_mean_interval([float(np.log(r / b)) for r, b in rates if r and b]):
        interval["pairs"] = interval.pop("samples")
    return interval


def _paired_text(v: dict | None) -> str:
    return "-" if v is None else f"{v['ratio']:.2f}x [{v['low']:.2f}, {v['high']:.2f}]"


def greedy_equal(runs: dict, rows: dict) -> dict[str, list[bool]]:
    """Per speculative configuration and prompt: are its greedy tokens exactly those of greedy AR on
    the same compiled TLM?"""
    return {name: [a.token_ids == s.token_ids
                   for (_, a), (_, s) in zip(runs[AUTOREGRESSIVE[which]], runs[name], strict=True)]
            for name, (which, spd) in rows.items() if spd is not False}


def metadata(recipe, arts: dict, args) -> dict:
    tlm_quant = arts["mxfp6"].manifest.models["tlm"].quant
    return {
        "recipe": recipe.name, "tlm": recipe.tlm.model, "dlm": recipe.dlm.model if recipe.dlm else None,
        "speculation": recipe.speculation,
        "precisions": {"baseline TLM": recipe.tlm.dtype, "MXFP6 TLM": f"{tlm_quant['format']} ({tlm_quant['kernel']})",
                       "DLM": (recipe.dlm.mx_format or recipe.dlm.dtype) if recipe.dlm else None},
        "k": recipe.k, "context_length": recipe.context_length, "max_new_tokens": args.max_new_tokens
        or recipe.max_new_tokens, "prompts": len(recipe.prompts), "warmup": args.warmup, "repeats": args.repeats,
        "sampling": "greedy", "onnxruntime": ort.__version__, "provider": get_target(recipe.target).provider,
        "machine": {"cpu": cpu_name(),
                    "gpu": gpu_name() if get_target(recipe.target).device == "cuda" else None,
                    "cores": len(os.sched_getaffinity(0)),
                    "system": platform.platform(), "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def markdown(report: dict) -> str:
    meta, rows = report["meta"], report["configs"]
    spd = (f"DLM `{meta['dlm']}`" if meta["speculation"] == "draft"
           else f"SpD = {DRAFT_FREE[meta['speculation']]} (no draft model)")
    lines = [f"# {meta['recipe']}: tokens/s report", "",
             f"TLM `{meta['tlm']}`, {spd}, K = {meta['k']}, {meta['prompts']} prompts x "
             f"{meta['repeats']} repeats after {meta['warmup']} warm-up, greedy, up to {meta['max_new_tokens']} "
             f"new tokens; ONNX Runtime {meta['onnxruntime']} ({meta['provider']}), "
             f"{meta['machine']['gpu'] or str(meta['machine']['cores']) + ' cores'}.",
             "",
             "| configuration | decode tok/s | speedup | paired [95% interval] | e2e tok/s | TTFT ms | acceptance "
             "| mean accepted | PSS MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        acc = f"{r['acceptance_rate']:.3f}" if "acceptance_rate" in r else "-"
        mal = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
        lines.append(f"| {name} | {r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{_paired_text(r.get('speedup_paired'))} | {r['e2e_tokens_per_s']:.1f} | "
                     f"{r['ttft_ms']:.1f} | {acc} | {mal} | {'-' if r['pss_mib'] is None else round(r['pss_mib'])} |")
    lines += ["", "Where the time goes (ms, pooled over prompts): a speculative round is one TLM call (scoring "
              "k+1 tokens, or a plain step when the policy does not draft), k DLM steps and host work; a drafting "
              "round yields `mean accepted` tokens where autoregressive decoding spends one TLM step per token.", "",
              "| configuration | AR ms per token | TLM call per round | call / AR token | DLM step | host per round "
              "| vs its AR, paired [95% interval] |",
              "|---|---|---|---|---|---|---|"]
    for name in report["greedy_spd_equals_ar"]:  # the speculative rows
        ar = "baseline" if name == "SpD" else "MXFP6"
        s, step = rows[name], 1000 / rows[ar]["decode_tokens_per_s"]
        dlm = "-" if s["dlm_step_ms"] is None else f"{s['dlm_step_ms']:.2f}"  # nothing drafted
        paired = _paired_text(s.get("vs_own_ar"))
        lines.append(f"| {name} | {step:.2f} | {s['tlm_score_ms']:.2f} | {s['tlm_score_ms'] / step:.2f} | "
                     f"{dlm} | {s['host_ms_per_round']:.2f} | {paired} |")
    lines += ["", f"Bandwidth floor: weights read per decoded token (every TLM and DLM call reads all of its "
              f"model's matrix weights) over the measured read bandwidth, {meta['read_bandwidth_gb_per_s']:.1f} GB/s "
              f"({meta['machine']['gpu'] or 'the CPU'}, benchmarks/bandwidth.py).", "",
              "| configuration | TLM calls per token | MB read per token | floor tok/s | measured / floor |",
              "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tlm_calls_per_token']:.2f} | {r['weights_read_mb_per_token']:.1f} | "
                     f"{r['floor_tokens_per_s']:.0f} | {r['decode_tokens_per_s'] / r['floor_tokens_per_s']:.2f} |")
    eq = report["greedy_spd_equals_ar"]
    lines += ["", "Greedy speculative output equals greedy autoregressive output of the same compiled TLM: "
              + ", ".join(f"{k}: {sum(v)}/{len(v)} prompts" for k, v in eq.items()) + "."]
    return "\n".join(lines) + "\n"


def chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["configs"])
    speed = [report["configs"][n]["decode_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, speed, color=["#888888", "#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860"][: len(names)])
    for bar, n in zip(bars, names, strict=True):
        ax.annotate(f"{report['configs'][n]['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom")
    meta = report["meta"]
    ax.set_ylabel("decode tokens/s")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(f"{meta['recipe']} (K={meta['k']}, {meta['provider']}, {meta['machine']['cores']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, help="default: the recipe's max_new_tokens")
    parser.add_argument("--tlm", help="local checkpoint folder that replaces the recipe's target model")
    parser.add_argument("--dlm", help="local checkpoint folder that replaces the recipe's draft model")
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the read-bandwidth probe")
    parser.add_argument("--target", choices=TARGETS, help="build and run for this target (default: the recipe's)")
    parser.add_argument("--draft-length", type=int, help="fix SpD's draft length (default: the timed policy's choice)")
    parser.add_argument("--parallel-builds", action="store_true",
                        help="build the two artifacts in two processes at once (twice the build's peak memory)")
    args = parser.parse_args(argv)
    recipe = get_recipe(args.recipe)
    for role, path in (("tlm", args.tlm), ("dlm", args.dlm)):
        if path and getattr(recipe, role) is not None:
            recipe = replace(recipe, **{role: replace(getattr(recipe, role), model=path)})
    recipe = replace(recipe, target=args.target or recipe.target)
    on_gpu = get_target(recipe.target).device == "cuda"
    out = args.out / recipe.name
    out.mkdir(parents=True, exist_ok=True)
    if not recipe.prompts or (recipe.dlm is None and recipe.speculation == "draft"):
        print(f"recipe {recipe.name!r} needs a prompt set, and a [dlm] or a draft-free speculation method, "
              "for this report", file=sys.stderr)
        return 2
    if args.draft_length is not None and recipe.speculation != "draft":
        print("error: --draft-length: applies to recipes whose speculation is a draft model", file=sys.stderr)
        return 2
    rows_of = configs(recipe)
    missing = [m.model for m in (recipe.tlm, recipe.dlm) if m is not None and not is_available(m.model)]
    if missing:
        report = {"meta": {"recipe": recipe.name}, "status": "missing weights", "missing": missing,
                  "how": "put the checkpoints in the local Hugging Face cache or pass local folders to "
                         "`python -m export --recipe ... --tlm DIR --dlm DIR`"}
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / "report.md").write_text(f"# {recipe.name}\n\nNot measured: missing weights for {', '.join(missing)}.\n")
        print(f"recipe {recipe.name!r}: not measured, weights missing for {missing}", file=sys.stderr)
        return 2
    fmt = recipe.tlm.mx_format or "fp6_e2m3"
    lowering = recipe.tlm.mx_lowering if recipe.tlm.mx_format else "fused"
    dirs, arts, unfit = {}, {}, {}
    variants = {"fp32": variant(recipe, None), "mxfp6": variant(recipe, fmt, lowering)}
    if args.parallel_builds:
        _build_in_parallel(variants, out)
    for which, variant_recipe in variants.items():
        try:
            dirs[which] = build_cached(variant_recipe, out / which)
            arts[which] = runtime.load_artifact(dirs[which])
        except DoesNotFitError as exc:
            unfit[which] = str(exc)
    if unfit:
        return _does_not_fit(recipe, rows_of, out, unfit)
    try:  # before any run: an uncompiled draft length would otherwise fail midway
        for art in arts.values():
            check_draft_length(art, "draft", None, args.draft_length)
    except (TypeError, ValueError) as exc:
        print(f"error: --draft-length: {exc}", file=sys.stderr)
        return 2
    runs = run_all(arts, rows_of, list(recipe.prompts), args.max_new_tokens, args.warmup, args.repeats,
                   args.draft_length)
    rows = {name: summarize(r) for name, r in runs.items()}
    # a GPU run's host PSS says little; its floor is the GPU's memory bandwidth
    memory = {k: {"pss_after_generate_mib": None, "weights_mib": weights_file_mib(d)} if on_gpu else memory_mib(d)
              for k, d in dirs.items()}
    bandwidth = gpu_read_bandwidth_gbs(args.bandwidth_gib) if on_gpu else read_bandwidth_gbs(args.bandwidth_gib)
    models = ("tlm", "dlm") if recipe.dlm else ("tlm",)
    per_call = {(which, m): weight_bytes_per_call(d, m) / 1e6 if m in models else 0.0
                for which, d in dirs.items() for m in ("tlm", "dlm")}
    for name, row in rows.items():
        which = rows_of[name][0]
        row["speedup"] = row["decode_tokens_per_s"] / rows["baseline"]["decode_tokens_per_s"]
        row["speedup_paired"] = paired_ratio(runs[name], runs["baseline"]) if name != "baseline" else None
        row["pss_mib"] = memory[which]["pss_after_generate_mib"]
        row["weights_read_mb_per_token"] = (row["tlm_calls_per_token"] * per_call[which, "tlm"]
                                            + row["dlm_calls_per_token"] * per_call[which, "dlm"])
        row["floor_tokens_per_s"] = bandwidth * 1e3 / row["weights_read_mb_per_token"]
    for name, (which, spd) in rows_of.items():  # each speculative row against its own artifact's AR row
        if spd is not False:
            rows[name]["vs_own_ar"] = paired_ratio(runs[name], runs[AUTOREGRESSIVE[which]])
    report = {"meta": metadata(recipe, arts, args) | {"read_bandwidth_gb_per_s": bandwidth}, "status": "measured",
              "configs": rows,
              "greedy_spd_equals_ar": greedy_equal(runs, rows_of),
              "weights_mib": {k: v["weights_mib"] for k, v in memory.items()},
              # what the draft policy's cost model ended up believing each graph's call costs (ms), and the host
              # time per call
              "call_costs_ms": {which: {role: {g: round(r.costs.ms(g), 3) for g in r.graphs}
                                        for role, r in art.runners.items()}
                                | {"host_per_call": round(art.engine.host_ms, 3) if art.engine else None}
                                for which, art in arts.items()}}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    chart(report, out / "report.png")
    print(markdown(report))
    print(f"wrote {out}/report.json, report.md, report.png")
    return 0 if all(all(v) for v in report["greedy_spd_equals_ar"].values()) else 1


def _build_in_parallel(variants: dict, out: Path) -> None:
    """Each artifact built in its own process (a build is mostly single-threaded: on a machine with
    cores and memory to spare this halves the wait). Failures are left to the sequential pass after,
    which reports them as it always does (a build that did not fit, say)."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds ONNX Runtime's threads
    with concurrent.futures.ProcessPoolExecutor(len(variants), mp_context=ctx) as pool:
        done = [pool.submit(build_cached, r, out / which, False) for which, r in variants.items()]
        concurrent.futures.wait(done)


def _does_not_fit(recipe, rows_of: dict, out: Path, unfit: dict[str, str]) -> int:
    """A report whose configurations say which do not fit and why (it compares all of them side by
    side, so none is measured when one of the two artifacts does not fit)."""
    rows = {name: f"does not fit: {unfit[which]}" if which in unfit else "fits; not measured (its counterpart "
            "does not)" for name, (which, _) in rows_of.items()}
    report = {"meta": {"recipe": recipe.name, "tlm": recipe.tlm.model, "dlm": recipe.dlm.model if recipe.dlm else None},
              "status": "does not fit", "configs": rows}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    text = "\n".join([f"# {recipe.name}: tokens/s report", "", "| configuration | status |", "|---|---|",
                      *[f"| {name} | {row} |" for name, row in rows.items()]]) + "\n"
    (out / "report.md").write_text(text)
    print(text)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
