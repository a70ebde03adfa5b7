"""What MXFP6 costs in accuracy: held-out perplexity and top-1 agreement with the unquantized TLM.

    python -m benchmarks.accuracy [--recipe tiny-stdlib-spd] [--tokens 16384] [--text FILE|pydoc:topics|os:licences]
                                  [--window N]
                                  [--configs ...] [--instructions 100] [--genai int4,fp32] [--llamacpp F32,Q6_K,Q8_0]
                                  [--artifact ART] [--out reports]

Builds the recipe's TLM unquantized and in each MX format, lowering and block-exponent choice (rounded
with error feedback where the recipe names a calibration text, `+nearest` to nearest), and scores held-
out text (the standard-library modules the default pair never saw, --text FILE, pydoc:topics: the Python
reference's topic pages that CPython ships, or os:licences: the licence texts the operating system
ships, but the calibration's) teacher-forced through the compiled graphs, in windows of --window
positions (the builds' context length; by default the recipe's, at most 512, so that figures stay
comparable whatever context a recipe deploys with). Peers (onnxruntime-genai's builds, llama.cpp's
formats of the recipe's GGUF) score the same windows in the same chunks, each also against its own
float32. Each build's greedy answers to the recipe's prompts (and to --instructions generated ones) are
compared with float32's. Writes OUT/RECIPE/accuracy.{json,md}. The gate (QEfficient's): perplexity <=
1.01x the float32 perplexity, judged on the recipe's TLM as shipped where that build is among the
configs, else on exact MXFP6 in the recipe's format (fp6_e2m3 if it names none) and exponent choice.
Each ratio comes with a 95% batch-means interval over blocks of BLOCK tokens (benchmarks.intervals):
one text's ratio carries a term that another stretch of text would change, and where the interval
holds the gate, that text alone cannot tell the build from the gate.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

import runtime
from benchmarks.bandwidth import weight_bytes_per_call
from benchmarks.chain import Chain
from benchmarks.intervals import perplexity_ratio_interval
from benchmarks.peers import Genai, llama_cpp_module, llama_file, llama_source, matrix_bits
from benchmarks.variants import build_cached, variant, with_settings
from common.manifest import ArtifactError
from common.recipe import selects_head
from recipes import DEFAULT_RECIPE, get_recipe
from recipes.calibration_text import PROSE
from recipes.default_pair import stdlib_files, training_texts
from recipes.ngram_draft import instructions

# Other TLM settings, whatever the recipe says: every decoder weight in the MX format with a float32 LM
# head; the LM head in the MX format too; the LM head in MXINT8 (8.25 bits per weight; the default).
PLAIN = {"mx_int8": (), "mx_fp6": (), "mx_lm_head": "float32"}
HEAD6 = {"mx_int8": (), "mx_fp6": (), "mx_lm_head": "format"}
HEAD8 = {"mx_int8": (), "mx_fp6": (), "mx_lm_head": "int8"}
ALL_INT8 = {"mx_int8": ("proj",), "mx_fp6": (), "mx_lm_head": "int8"}  # every decoder linear and the head in MXINT8
# The tensors that cost SmolLM2 most agreement in MXFP6 (docs/formats.md), in MXINT8: attention, the MLP's
# down projection, the last layer and the head.
SENSITIVE = ("self_attn", "down_proj", "layers.29.")
SENSITIVE8 = {"mx_int8": SENSITIVE, "mx_fp6": (), "mx_lm_head": "int8"}
# At four bits, the tensors llama.cpp's Q4_K_M keeps finer (attention's value and the MLP's down projections), in
# MXINT8, and the head.
V_DOWN8 = {"mx_int8": ("v_proj", "down_proj"), "mx_fp6": (), "mx_lm_head": "int8"}
# At four bits, the same tensors in MXFP6 (mx_fp6) instead: the head MXINT8 or MXFP6 (as Q4_K_M's Q6_K head).
SENSITIVE6 = {"mx_int8": (), "mx_fp6": SENSITIVE, "mx_lm_head": "int8"}
SENSITIVE6_HEAD6 = SENSITIVE6 | {"mx_lm_head": "fp6"}
V_DOWN6_HEAD6 = {"mx_int8": (), "mx_fp6": ("v_proj", "down_proj"), "mx_lm_head": "fp6"}
# And the MLPs of the 9 layers whose gate and up projections cost most KL in MXFP4 (benchmarks.sensitivity --by layer
# on the calibration's Apache-2.0, 2026-11-30): the bits Q4_K_M reads on SmolLM2 (6.16 per weight), not more.
LAYERS6 = ("layers.0.", "layers.1.", "layers.20.", "layers.4.", "layers.2.", "layers.8.", "layers.7.", "layers.12.",
           "layers.11.")
SENSITIVE6_LAYERS6 = SENSITIVE6 | {"mx_fp6": SENSITIVE + LAYERS6}
# The same bits spent otherwise: the head MXFP6 frees 7 MB a token, which keep every other layer's MLP in MXFP6 too;
# MXFP4 stays on the gate and up projections of the 4 layers that cost least KL there (the same ranking).
LAYERS4 = ("layers.14.", "layers.6.", "layers.5.", "layers.13.")
SMOLLM2_LAYERS = 30
MOSTLY6_HEAD6 = {"mx_int8": (), "mx_fp6": ("self_attn", "down_proj") + tuple(
    f"layers.{i}." for i in range(SMOLLM2_LAYERS) if f"layers.{i}." not in LAYERS4), "mx_lm_head": "fp6"}
ROUND_TO_NEAREST = {"mx_calibration": ""}  # the MX configs round with error feedback where the recipe does
FLOAT_EMBEDDING = {"mx_embedding": "float32"}  # the embedding table as the recipe says otherwise
KV16, KV32 = {"kv_cache": "float16"}, {"kv_cache": "float32"}  # the KV cache's type (a recipe key; KV32: CPU)
TARGET_KV = {"kv_cache": ""}  # the target's own KV cache: the reference's float32 on the CPU, whatever the recipe's
# Every other config keeps the recipe's cache (the default recipe's is float16): the recipe as shipped.
CONFIGS = {  # name -> (mx_format, lowering, block exponent choice, other TLM settings)
    "fp32": (None, "exact", "spec", TARGET_KV),
    "fp6_e2m3 exact spec": ("fp6_e2m3", "exact", "spec", PLAIN),
    "fp6_e2m3 exact min_error": ("fp6_e2m3", "exact", "min_error", PLAIN),
    "fp6_e2m3 fused min_error": ("fp6_e2m3", "fused", "min_error", PLAIN),
    "fp6_e2m3 native min_error": ("fp6_e2m3", "native", "min_error", PLAIN),
    "fp6_e2m3 native8 min_error": ("fp6_e2m3", "native8", "min_error", PLAIN),
    "fp6_e2m3 native min_error +head": ("fp6_e2m3", "native", "min_error", HEAD6),
    "fp6_e2m3 native min_error +head8": ("fp6_e2m3", "native", "min_error", HEAD8),
    "fp6_e2m3 native8 min_error +head8": ("fp6_e2m3", "native8", "min_error", HEAD8),
    "fp6_e2m3 native min_error +sensitive8": ("fp6_e2m3", "native", "min_error", SENSITIVE8),
    "fp6_e2m3 native8 min_error +sensitive8": ("fp6_e2m3", "native8", "min_error", SENSITIVE8),
    "fp6_e2m3 native min_error +sensitive8 +kv16": ("fp6_e2m3", "native", "min_error", SENSITIVE8 | KV16),
    "fp6_e2m3 native min_error +sensitive8 +nearest": ("fp6_e2m3", "native", "min_error",
                                                       SENSITIVE8 | ROUND_TO_NEAREST),
    "fp6_e2m3 native min_error +sensitive8 +float_embedding": ("fp6_e2m3", "native", "min_error",
                                                               SENSITIVE8 | FLOAT_EMBEDDING),
    "fp6_e3m2 exact min_error": ("fp6_e3m2", "exact", "min_error", PLAIN),
    "fp4_e2m1 exact min_error": ("fp4_e2m1", "exact", "min_error", PLAIN),
    "fp4_e2m1 native min_error +head8": ("fp4_e2m1", "native", "min_error", HEAD8),
    "fp4_e2m1 native min_error +v_down8": ("fp4_e2m1", "native", "min_error", V_DOWN8),
    "fp4_e2m1 native min_error +sensitive8": ("fp4_e2m1", "native", "min_error", SENSITIVE8),
    "fp4_e2m1 native min_error +sensitive6": ("fp4_e2m1", "native", "min_error", SENSITIVE6),
    "fp4_e2m1 native min_error +sensitive6 +head6": ("fp4_e2m1", "native", "min_error", SENSITIVE6_HEAD6),
    "fp4_e2m1 native min_error +v_down6 +head6": ("fp4_e2m1", "native", "min_error", V_DOWN6_HEAD6),
    "fp4_e2m1 native min_error +sensitive6 +layers6": ("fp4_e2m1", "native", "min_error", SENSITIVE6_LAYERS6),
    "fp4_e2m1 native8 min_error +sensitive6 +layers6": ("fp4_e2m1", "native8", "min_error", SENSITIVE6_LAYERS6),
    "fp4_e2m1 native min_error +mostly6 +head6": ("fp4_e2m1", "native", "min_error", MOSTLY6_HEAD6),
    "fp4_e2m1 native8 min_error +mostly6 +head6": ("fp4_e2m1", "native8", "min_error", MOSTLY6_HEAD6),
}
NOT_AVAILABLE = {"fp6_e3m2 fused": "E3M2 values are not int8 multiples of one power of two (16 x 28 = 448)"}
GATE = 1.01
# Tokens per block of the perplexity ratio's batch-means interval: on GPL-3 the per-token differences'
# correlation is gone within 10 tokens and blocks of 64-1,024 give the same interval to 0.001; 256
# leaves 8 blocks in 2,048 tokens (docs/benchmarks.md, Accuracy).
BLOCK = 256


def with_int8(fragment_lists: list[str]) -> dict[str, tuple]:
    """CONFIGS plus, per comma-separated fragment list, MXFP6 native8 (the default) with those weights in MXINT8."""
    return CONFIGS | {f"fp6_e2m3 native8 min_error +int8:{f}": ("fp6_e2m3", "native8", "min_error",
                                                               (HEAD8 if selects_head(tuple(f.split(","))) else PLAIN)
                                                               | {"mx_int8": tuple(f.split(","))})
                      for f in fragment_lists}


WINDOW = 512  # positions per scored window at most, by default (the default recipe's context until 2026-11-29)


def scoring_recipe(recipe, window: int | None = None):
    """The recipe with a context of `window` positions (default: its own, at most WINDOW): the windows text is
    scored in, whatever context the recipe deploys with."""
    window = window or min(recipe.context_length, WINDOW)
    if window < 2:
        raise ValueError("--window must be at least 2")
    return replace(recipe, context_length=window, kv_slots=0, prefill_chunk=min(recipe.prefill_chunk, window),
                   max_prompt_length=min(recipe.max_prompt_length, window - 1))


def config_recipe(recipe, config: tuple):
    """The recipe, without its draft, with its TLM as `config` (CONFIGS) says."""
    fmt, lowering, scale, settings = config
    return with_settings(variant(recipe, fmt, lowering, with_dlm=False, scale=scale), settings)


def config_artifact(recipe, name: str, config: tuple, out_dir: Path) -> Path:
    """The recipe's TLM built as `config`, cached in out_dir/<name>."""
    return build_cached(config_recipe(recipe, config), out_dir / name.replace(" ", "-"))


# A second natural-language text that needs no download, unlike a licence (repetitive legal prose, on
# which one format's luck decides perplexity: docs/benchmarks-history.md): the Python language reference's
# topic pages that CPython ships for pydoc, the same on every machine with the same Python.
PYTHON_DOCS = "pydoc:topics"
# Every licence text the operating system ships (Debian's /usr/share/common-licenses), whole, in name
# order, links and the calibration's prose (Apache-2.0) left out: one licence's ratio is mostly its own luck
# (GPL-3's is the second highest of eleven for the default recipe), the set's is the genre's.
LICENCES = "os:licences"
LICENCE_DIR = Path("/usr/share/common-licenses")


def licence_files(folder: Path = LICENCE_DIR) -> list[Path]:
    files = sorted(f for f in folder.glob("*") if f.is_file() and not f.is_symlink() and f.name != PROSE.name)
    if not files:
        raise FileNotFoundError(f"no licence texts in {folder} (Debian's base-files ships them): pass --text FILE")
    return files


def held_out_texts(text_file: Path | None) -> list[str]:
    if text_file is None:
        return [f.read_text(errors="replace") for f in stdlib_files("heldout")]
    if str(text_file) == PYTHON_DOCS:
        from pydoc_data.topics import topics

        return ["\n\n".join(topics.values())]
    if str(text_file) == LICENCES:
        return [f.read_text(errors="replace") for f in licence_files()]
    return [text_file.read_text()]


# A calibration text of the default pair's own domain (--calibration stdlib:train): the first 60,000 characters
# (~8k tokens) of the standard-library modules it trained on, in order; none of them is held out.
STDLIB_TRAIN = "stdlib:train"
STDLIB_TRAIN_CHARS = 60_000


def calibration_reference(reference: str, folder: Path) -> str:
    """A calibration text as a recipe names it (a path or builtin:NAME); stdlib:train written into `folder`."""
    if reference != STDLIB_TRAIN:
        return reference
    path = folder / "stdlib-train.txt"
    path.write_text("".join(training_texts(STDLIB_TRAIN_CHARS))[:STDLIB_TRAIN_CHARS])
    return str(path)


TOKENIZER_PROBE = "The quick brown fox, 1,234 times: def f(x): return x ** 2  # l'été"


def given_artifact(path: Path, reference, window: int):
    """A compiled artifact to score beside the configs: it must hold the scored windows and read text as
    the float32 build (`reference`) does, or the comparison means nothing."""
    try:
        art = runtime.load_artifact(path)
    except (OSError, ValueError, ArtifactError) as exc:
        raise SystemExit(f"--artifact {path}: {exc}") from exc
    if art.manifest.context_length < window:
        raise SystemExit(f"--artifact {path}: its context ({art.manifest.context_length} positions) is shorter than "
                         f"the scored windows ({window}); pass --window {art.manifest.context_length}")
    ours, theirs = (t(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
                    for t in (reference.tokenizer, art.tokenizer))
    if ours != theirs:
        raise SystemExit(f"--artifact {path}: its tokenizer reads text otherwise than the recipe's: another model?")
    return art


def held_out_tokens(tok, text_file: Path | None, limit: int) -> np.ndarray:
    texts = held_out_texts(text_file)
    ids: list[int] = []
    for text in texts:
        ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        if len(ids) >= limit:
            break
    return np.asarray(ids[:limit], dtype=np.int64)


class Divergence:
    """KL(p_fp32 || p) per scored token. The first system scored (float32) leaves its log-probabilities in a
    file (tokens x vocabulary: 1.6 GB at 8,192 tokens of SmolLM2, too many to hold beside a model), and each
    later one is read against them, position by position in the same order (`start` before each system)."""

    def __init__(self, file: Path, positions: int) -> None:
        self.file, self.positions = file, positions
        self.logp: np.ndarray | None = None
        self.recording, self.at = True, 0

    def start(self) -> None:
        self.recording, self.at = self.logp is None, 0

    def __call__(self, logp: np.ndarray) -> np.ndarray:
        if self.logp is None:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            self.logp = np.lib.format.open_memmap(self.file, mode="w+", dtype=np.float32,
                                                  shape=(self.positions, logp.shape[-1]))
        rows = slice(self.at, self.at + len(logp))
        self.at += len(logp)
        if self.recording:
            self.logp[rows] = logp
            return np.zeros(len(logp))  # by definition (its float32 copy would differ in the last bits)
        p = self.logp[rows].astype(np.float64)
        return (np.exp(p) * (p - logp)).sum(-1)

    def close(self) -> None:
        self.logp = None
        self.file.unlink(missing_ok=True)


def judge(logits: np.ndarray, targets: np.ndarray, divergence: Divergence
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Negative log-likelihood of each row's target, each row's argmax and its KL divergence from float32's."""
    logits = logits.astype(np.float64)
    logp = logits - (np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1))[:, None]
    return -logp[np.arange(len(targets)), targets], logits.argmax(-1), divergence(logp)


def windows(tokens: np.ndarray, window: int, chunk: int):
    """(window index, inputs, targets) per chunk: windows of `window` + 1 tokens, each scored from an
    empty cache in chunks of `chunk` (every system sees the same contexts)."""
    for w, start in enumerate(range(0, len(tokens) - 1, window)):
        seq = tokens[start : start + window + 1]
        for c in range(0, len(seq) - 1, chunk):
            yield w, seq[c : min(c + chunk, len(seq) - 1)], seq[c + 1 : min(c + 1 + chunk, len(seq))]


Scores = tuple[np.ndarray, np.ndarray, np.ndarray]  # per scored token: negative log-likelihood, argmax, KL


def scored(chunks) -> Scores:
    nll, top1, kl = zip(*chunks, strict=True)
    return np.concatenate(nll), np.concatenate(top1), np.concatenate(kl)


def score(art, tokens: np.ndarray, divergence: Divergence, window: int | None = None) -> Scores:
    """Per-token negative log-likelihood, argmax and KL, teacher-forced through the prefill graph, in windows of
    `window` positions (default: the artifact's context)."""
    runner, last = Chain(art.tlm), None

    def chunk(w: int, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        nonlocal last
        if w != last:
            runner.rewind(0)
            last = w
        return judge(runner.forward("prefill", inputs), targets, divergence)

    divergence.start()
    return scored(chunk(*c) for c in windows(tokens, window or art.manifest.context_length, art.manifest.prefill_chunk))


def genai_score(model, tokens: np.ndarray, window: int, chunk: int, divergence: Divergence) -> Scores:
    """`score` for an onnxruntime-genai model: the same windows and chunks, its own KV cache."""
    import onnxruntime_genai as og

    gen, last = None, None

    def one(w: int, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        nonlocal gen, last
        if w != last:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=window + 1, do_sample=False)
            gen, last = og.Generator(model, params), w
        gen.append_tokens(inputs.tolist())
        return judge(gen.get_output("logits")[0, -len(inputs):], targets, divergence)

    divergence.start()
    return scored(one(*c) for c in windows(tokens, window, chunk))


def llama_score(path: Path, tokens: np.ndarray, window: int, chunk: int, divergence: Divergence, threads: int = 2
                ) -> Scores:
    """`score` for a llama.cpp model file: the same windows and chunks, its own KV cache."""
    llm = llama_cpp_module().Llama(str(path), n_ctx=window, n_batch=chunk, logits_all=True, n_threads=threads,
                             n_threads_batch=threads, verbose=False)
    last = None

    def one(w: int, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        nonlocal last
        if w != last:
            llm.reset()
            last = w
        llm.eval(inputs.tolist())
        return judge(np.asarray(llm.scores[llm.n_tokens - len(inputs) : llm.n_tokens]), targets, divergence)

    divergence.start()
    return scored(one(*c) for c in windows(tokens, window, chunk))


def answers(art, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers to the recipe's prompts (its chat template applies), no speculation."""
    return [runtime.generate(art, p, max_new_tokens=max_new_tokens, do_sample=False, speculative=False).text
            for p in prompts]


def measures(scores: Scores, base: Scores) -> dict:
    """A system's scores against float32's: perplexity and its ratio (with its interval), KL, top-1 agreement."""
    (nll, top1, kl), (base_nll, base_top1, _) = scores, base
    ppl = float(np.exp(nll.mean()))
    return {"perplexity": ppl, "ppl_ratio": ppl / float(np.exp(base_nll.mean())),
            "ppl_interval": perplexity_ratio_interval(nll, base_nll, BLOCK), "kl_mean": float(kl.mean()),
            "kl_p99": float(np.quantile(kl, 0.99)), "top1_agreement": float((top1 == base_top1).mean())}


def printed(label: str, row: dict, more: str = "") -> None:
    print(f"{label:26s} perplexity {row['perplexity']:.4f} ({row['ppl_ratio']:.4f}x {interval_text(row)})  "
          f"KL {row['kl_mean']:.4f}  top-1 agreement {row['top1_agreement']:.4f}{more}")


def interval_text(r: dict) -> str:
    """A row's perplexity-ratio interval as `[low, high]`, or `-` where the text is too short for one."""
    v = r.get("ppl_interval")
    return f"[{v['low']:.4f}, {v['high']:.4f}]" if v else "-"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# MXFP6 accuracy: {meta['recipe']} ({meta['tokens']} held-out tokens, {meta['text']})", "",
        "| weights | lowering | block exponent | perplexity | vs fp32 | 95% interval | KL mean / p99 (nats) "
        "| top-1 agreement with fp32 | with its own float32 | answers as fp32 | bits per weight |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"| {r['name']} | - | - | not available: {r['unavailable']} | | | | | | | |")
            continue
        bits = "-" if r["bits_per_weight"] is None else f"{r['bits_per_weight']:.2f}"
        own = "-" if r.get("top1_own") is None else f"{100 * r['top1_own']:.2f}%"
        scale = (r["scale"] or "-") + (" + feedback" if r.get("feedback") else "")
        lines.append(f"| {r['name']} | {r['lowering'] or '-'} | {scale} | {r['perplexity']:.4f} | "
                     f"{r['ppl_ratio']:.4f}x | {interval_text(r)} | {r['kl_mean']:.4f} / {r['kl_p99']:.3f} "
                     f"| {100 * r['top1_agreement']:.2f}% | {own} | {r['same_answers']} | {bits} |")
    verdict = {True: "PASS", False: "FAIL", None: "not run (its config was not chosen)"}[meta["gate_pass"]]
    interval = meta.get("gate_interval")
    if interval and interval["low"] <= GATE <= interval["high"]:
        verdict += f" by its point figure; its 95% interval [{interval['low']:.4f}, {interval['high']:.4f}] " \
                   f"holds {GATE}"
    lines += ["", f"Gate: {meta['gate']}: **{verdict}**.", "",
              f"95% interval of each perplexity ratio: batch means over blocks of {meta['block']} tokens, how far "
              "another stretch of such text could move it; where it holds the gate, this text alone cannot tell "
              "the ratio from the gate. KL: of each token's next-token distribution from float32's, over the whole "
              "vocabulary. Bits per weight: over every matrix a token reads (the decoder's linears and the LM head, "
              "as stored).", "",
              f"Answers: greedy, {meta['answer_tokens']} new tokens, to the recipe's {meta['prompts']} prompts"
              + (f" and {meta['instructions']} generated instructions" if meta["instructions"] else "") + "; "
              "a differing answer is listed with fp32's (the recipe's prompts only).", ""]
    for name, differing in meta["differing"].items():
        lines += [f"- {name}: {prompt!r}: {theirs!r} (fp32: {ours!r})" for prompt, theirs, ours in differing]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--tokens", type=int, default=16384, help="held-out tokens to score")
    parser.add_argument("--text", type=Path, help="held-out text file; pydoc:topics (the Python reference's "
                        "topic pages CPython ships); or os:licences (every licence text in /usr/share/common-licenses "
                        "but the calibration's Apache-2.0); default: held-out stdlib modules")
    parser.add_argument("--out", type=Path, default=Path("reports"))
    parser.add_argument("--window", type=int, help="positions per scored window, the builds' context (default: the "
                        "recipe's context, at most 512)")
    parser.add_argument("--answer-tokens", type=int, default=48, help="new tokens of each greedy answer compared")
    parser.add_argument("--instructions", type=int, default=0, help="also compare greedy answers to this many "
                        "generated instructions (the last of recipes.ngram_draft's; calibration texts use the first)")
    parser.add_argument("--configs", help=f"comma-separated subset of {list(CONFIGS)} (fp32 always runs first)")
    parser.add_argument("--genai", default="", help="also onnxruntime-genai builds of the recipe's GGUF (int4, ...; "
                        "the bench extra): perplexity and top-1 agreement, also with its own fp32")
    parser.add_argument("--llamacpp", default="", help="also llama.cpp formats made from the recipe's GGUF (F32, "
                        "Q6_K, Q8_0, ...; the peers extra): perplexity, top-1 agreement with our fp32 and with its F32")
    parser.add_argument("--artifact", action="append", default=[], type=Path, metavar="ART",
                        help="also score this compiled artifact of the recipe's TLM (any format, lowering or mix; "
                             "repeatable), in the same windows, against the same float32")
    parser.add_argument("--calibration", metavar="TEXT", help="round the MX configs with error feedback over this "
                        f"text (a path, builtin:NAME, or {STDLIB_TRAIN}: the default pair's training modules), "
                        "whatever the recipe names")
    parser.add_argument("--mx-int8", action="append", default=[], metavar="FRAGMENTS",
                        help="also fp6_e2m3 native8 min_error with the weights named by these comma-separated "
                             "fragments in MXINT8 (repeatable; e.g. lm_head,down_proj): which tensors are sensitive")
    args = parser.parse_args(argv)
    configs = with_int8(args.mx_int8)
    chosen = ["fp32", *(c for c in (args.configs or ",".join(CONFIGS)).split(",") if c != "fp32")]
    chosen += [c for c in configs if c not in CONFIGS]
    if unknown := sorted(set(chosen) - set(configs)):
        parser.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    try:
        recipe = scoring_recipe(get_recipe(args.recipe), args.window)
    except ValueError as exc:
        parser.error(str(exc))
    out_dir = args.out / recipe.name
    if args.calibration:
        out_dir.mkdir(parents=True, exist_ok=True)
        text = calibration_reference(args.calibration, out_dir)
        recipe = replace(recipe, tlm=replace(recipe.tlm, mx_calibration=text))
    rows, base, tokens, base_answers, reference, divergence, fp32_bytes = [], None, None, None, None, None, 0
    prompts = list(recipe.prompts)
    generated = instructions(exclude=prompts)
    if not 0 <= args.instructions <= len(generated) // 2:  # the first ones make calibration texts
        parser.error(f"--instructions must be between 0 and {len(generated) // 2}")
    extra = generated[-args.instructions :] if args.instructions else []
    differing: dict[str, list] = {}
    try:
        for name in [*chosen, *(f"artifact {p}" for p in args.artifact)]:
            if name in configs:
                fmt = configs[name][0]
                path = config_artifact(recipe, name, configs[name], out_dir)
                art = runtime.load_artifact(path)
                built = config_recipe(recipe, configs[name])
                shipped = not args.calibration and built.tlm == recipe.tlm and built.kv_cache == recipe.kv_cache
            else:
                path = Path(name.split(" ", 1)[1])
                art = given_artifact(path, reference, recipe.context_length)
                fmt, shipped = art.manifest.models["tlm"].quant.get("format"), False
            if tokens is None:
                tokens, reference = held_out_tokens(art.tokenizer, args.text, args.tokens), art
                fp32_bytes = weight_bytes_per_call(path, "tlm")
                divergence = Divergence(out_dir / "fp32-logprobs.npy", len(tokens) - 1)
            scores = score(art, tokens, divergence, recipe.context_length)
            base = base or scores
            said = answers(art, prompts + extra, args.answer_tokens)
            base_answers = said if base_answers is None else base_answers
            differs = [(p, a, b) for p, a, b in zip(prompts + extra, said, base_answers, strict=True) if a != b]
            differing[name] = differs[: sum(p in prompts for p, _, _ in differs)]  # the recipe's prompts come first
            quant = art.manifest.models["tlm"].quant
            same = f"{len(prompts) - len(differing[name])}/{len(prompts)}"
            if extra:
                same += f", {len(extra) - len(differs) + len(differing[name])}/{len(extra)} instructions"
            short = " ".join(w for i, w in enumerate(name.split()) if i == 0 or w.startswith("+"))
            rows.append({"name": short if name in configs else name, "lowering": quant.get("lowering"),
                         "scale": quant.get("scale"), "feedback": bool(quant.get("calibration")),
                         "format": fmt, "same_answers": same, "shipped": shipped, "kernel": quant.get("kernel"),
                         # float32 reads 4 bytes per matrix weight
                         "bits_per_weight": 32 * weight_bytes_per_call(path, "tlm") / fp32_bytes}
                        | measures(scores, base))
            rows[-1]["top1_own"] = rows[-1]["top1_agreement"]
            printed(name, rows[-1])
        genai = sorted(filter(None, args.genai.split(",")), key=lambda p: p != "fp32")  # its own reference first
        families = [(f"onnxruntime-genai {p}", "genai", p, "fp32") for p in genai]
        llama = sorted(filter(None, args.llamacpp.split(",")), key=lambda f: f != "F32")  # its own reference first
        families += [(f"llama.cpp {f}", "llama.cpp", f, "F32") for f in llama]
        own_top1: dict[str, np.ndarray] = {}  # each peer's own float32 argmax
        for label, system, precision, own_reference in families:
            source, bits = llama_source(recipe.tlm.model), None
            if system == "genai":
                scores = genai_score(Genai(source, precision, threads=2).model, tokens, recipe.context_length,
                                     recipe.prefill_chunk, divergence)
            else:
                file = llama_file(source, precision)
                scores, bits = llama_score(file, tokens, recipe.context_length, recipe.prefill_chunk,
                                           divergence), matrix_bits(file)
            if precision == own_reference:
                own_top1[system] = scores[1]
            own = float((scores[1] == own_top1[system]).mean()) if system in own_top1 else None
            rows.append({"name": label, "lowering": system, "scale": None, "format": precision, "same_answers": "-",
                         "top1_own": own, "bits_per_weight": bits} | measures(scores, base))
            printed(label, rows[-1], f" (with its own {own_reference}: {own:.4f})" if own is not None else "")
    finally:
        if divergence is not None:
            divergence.close()
    rows += [{"name": n.split()[0], "unavailable": why} for n, why in NOT_AVAILABLE.items()]
    gated = recipe.tlm.mx_format or "fp6_e2m3"
    exact = (r for r in rows if r.get("format") == gated and r["lowering"] == "exact"
             and r["scale"] == recipe.tlm.mx_scale)
    gate_row = next((r for r in rows if r.get("shipped") and r["format"]), None) or next(exact, None)
    judged = "the recipe as shipped" if gate_row and gate_row["shipped"] else f"{gated} exact"
    meta = {"recipe": recipe.name, "tokens": int(len(tokens)), "text": str(args.text or "held-out stdlib modules"),
            "gate": f"{judged}: perplexity <= {GATE}x fp32", "block": BLOCK,
            "gate_pass": None if gate_row is None else gate_row["ppl_ratio"] <= GATE,
            "gate_interval": gate_row and gate_row["ppl_interval"],
            "answers": base_answers, "answer_tokens": args.answer_tokens, "differing": differing,
            "prompts": len(prompts), "instructions": len(extra)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out_dir / "accuracy.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0 if meta["gate_pass"] is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
