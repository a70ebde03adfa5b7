"""Decode and prefill against llama.cpp on the same model and CPU, side by side in one run.

    python -m benchmarks.vs_llamacpp [--recipe smollm2-135m-chat] [--formats F32,Q8_0,Q6_K,Q4_1]
                                     [--engines fp32,mxfp6_native,mxfp6_native_head8] [--genai int4,fp32]
                                     [--speculation prompt_lookup,lookahead] [--new-tokens 128]
                                     [--prompts long|recipe] [--repeats 2] [--threads 2] [--no-pss]

llama.cpp through llama-cpp-python (a benchmark-only extra, `pip install -e ".[peers]"`; it builds
llama.cpp from source; on CPUs whose native build crashes, build it with
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"). Its formats are made
from the recipe's GGUF with llama_model_quantize (requantized where the source is already
quantized, as a user of a Q4_1 download would) and cached. `--genai` adds onnxruntime-genai's model
builder's builds (the `bench` extra; int4 is MatMulNBits 4-bit, block 32), made from a float32
Hugging Face copy of the same GGUF (its builder reads float GGUFs only) and cached. `--speculation`
adds the last engine with each speculation method (`ours:ENGINE+METHOD`, the draft policy deciding
each round); its text is compared with the same engine's autoregressive text (lossless). Ours are
the recipe's TLM built as benchmarks.mx_decode's engines. Every system gets the same chat-templated
prompt token ids (`--prompts long`: one request for code with an explanation; `recipe`: the
recipe's prompts one after another, each system's decode speed their tokens over their time),
greedy, the same thread count; runs alternate between systems. Prints per system:
decode tokens/s of every run and their median, prefill ms, the ratio to llama.cpp Q6_K (and to each
F32), the weight bytes read per token with the floor they imply at the measured read bandwidth,
whether the greedy text equals the system's own float32 text (`compared_with` names the system
compared: for a speculating engine its autoregressive self), and PSS after loading and generating
(each system alone in a fresh process, measured once this one has let every system go: while it
still mapped a model's file, the child's PSS counted half of that file's pages).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import runtime
from benchmarks.bandwidth import cpu_name, read_bandwidth_gbs, weight_bytes_per_call
from benchmarks.decode import genai_model, time_genai, time_ours
from benchmarks.memory import smaps_mib
from benchmarks.mx_decode import ENGINES, LONG_ANSWER, engine_recipe
from benchmarks.variants import build_cached
from common.cache import cache_root
from export.gguf_checkpoint import gguf_file
from recipes import get_recipe
from runtime.request import encode_prompt

REFERENCE = "Q6_K"  # issue 27's yardstick: llama.cpp's 6.56-bit format


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        sys.exit('llama-cpp-python is not installed: pip install -e ".[peers]" (a benchmark-only extra)')
    return llama_cpp


def llama_file(source: Path, fmt: str) -> Path:
    """`source` in llama.cpp format `fmt` (F32, Q8_0, ...), made once with llama_model_quantize."""
    out = cache_root() / "bench" / "llamacpp" / f"{source.stem}-{fmt}.gguf"
    if out.is_file():
        return out
    llama_cpp = _llama_cpp()
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32" if fmt == "F32" else f"LLAMA_FTYPE_MOSTLY_{fmt}")
    params.allow_requantize = True
    tmp = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize to {fmt} failed")
    tmp.rename(out)
    return out


class LlamaCpp:
    """One llama.cpp model: prefill the prompt ids, then greedy decode, timed apart."""

    def __init__(self, path: Path, threads: int) -> None:
        llama_cpp = _llama_cpp()
        self.llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.vocab = self.llm.n_vocab()
        self.eos = self.llm.token_eos()

    def _next(self) -> int:
        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,)).argmax())

    def generate(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        """(prefill ms, decode tokens/s, new token ids)."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        out = [self._next()]
        first = time.perf_counter()
        while len(out) < n and out[-1] != self.eos:
            self.llm.eval([out[-1]])
            out.append(self._next())
        end = time.perf_counter()
        return (first - start) * 1e3, (len(out) - 1) / (end - first), out


class Genai:
    """One onnxruntime-genai build (benchmarks.decode's builder call and timing), same interface."""

    def __init__(self, source: Path, precision: str, threads: int, provider: str = "cpu") -> None:
        import onnxruntime_genai as og

        self.path = genai_model(hf_copy(source), precision, provider)
        config = og.Config(str(self.path))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)

    def generate(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        tps, out, first = time_genai(self.model, prompt, n)
        return (first - start) * 1e3, tps, [int(t) for t in out]

    def weight_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.glob("*.onnx*"))


def hf_copy(source: Path) -> Path:
    """A float32 Hugging Face folder of the GGUF `source` (transformers' GGUF loader), made once."""
    out = cache_root() / "bench" / "hf" / source.stem
    if not (out / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tmp = out.with_name(out.name + ".partial")
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype="float32")
        model.hf_quantizer = None  # dequantized on load: plain float32 weights, which transformers would refuse
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(tmp)
        tmp.rename(out)
    return out


def ours(recipe, engine: str, new_tokens: int) -> Path:
    """Our build of `engine`, in the cache folder benchmarks.mx_decode uses for it."""
    return build_cached(engine_recipe(recipe, engine, new_tokens), cache_root() / "bench" / f"{recipe.name}-{engine}")


def pss_of(system: str, prompt: list[int], args) -> float:
    """PSS growth (MiB) of a fresh process that loads `system` alone and generates 16 tokens."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.vs_llamacpp", "--recipe", args.recipe,
                          "--threads", str(args.threads), "--pss-of", system, "--prompt-ids",
                          ",".join(map(str, prompt))], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _measure_pss(system: str, prompt: list[int], args) -> None:
    kind, _, name = system.partition(":")
    recipe = get_recipe(args.recipe)
    # found before the baseline: checking a cached build reads every build source (Python heap, kept)
    path = llama_file(gguf_file(recipe.tlm.model), name) if kind == "llama.cpp" else ours(recipe, name, args.new_tokens)
    base = smaps_mib()["pss"]
    if kind == "llama.cpp":
        loaded = LlamaCpp(path, args.threads)
        loaded.generate(prompt, 16)
    else:
        loaded = runtime.load_artifact(path)
        runtime.generate(loaded, prompt, max_new_tokens=16, speculative=False)
    print(round(smaps_mib()["pss"] - base, 1))  # while `loaded` is alive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2-135m-chat")
    ap.add_argument("--formats", default="F32,Q8_0,Q6_K,Q4_1", help="llama.cpp formats")
    ap.add_argument("--engines", default="fp32,mxfp6_native,mxfp6_native_head8", help=f"ours, from {list(ENGINES)}")
    ap.add_argument("--genai", default="", help="onnxruntime-genai builds to add (int4, fp32, ...)")
    ap.add_argument("--speculation", default="", help="the last engine with these methods too (prompt_lookup, ...)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", choices=("long", "recipe"), default="long",
                    help="one long-answer prompt, or every prompt of the recipe")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-pss", action="store_true", help="skip the PSS of each system alone")
    ap.add_argument("--pss-of", help=argparse.SUPPRESS)  # internal: one system's PSS, in a fresh process
    ap.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pss_of:
        return _measure_pss(args.pss_of, [int(i) for i in args.prompt_ids.split(",")], args)
    formats, engines = args.formats.split(","), args.engines.split(",")
    if "F32" not in formats or "fp32" not in engines:
        ap.error("each system needs its float32 (F32 / fp32): outputs are compared with it")
    recipe = get_recipe(args.recipe)
    source = gguf_file(recipe.tlm.model)
    arts = {f"ours:{e}": runtime.load_artifact(ours(recipe, e, args.new_tokens)) for e in engines}
    llamas: dict[str, LlamaCpp | Genai] = {f"llama.cpp:{f}": LlamaCpp(llama_file(source, f), args.threads)
                                           for f in formats}
    llamas |= {f"genai:{p}": Genai(source, p, args.threads) for p in filter(None, args.genai.split(","))}
    texts = list(recipe.prompts) if args.prompts == "recipe" else [LONG_ANSWER]
    if not texts:
        ap.error(f"recipe {recipe.name!r} has no prompts; use --prompts long")
    prompts = [encode_prompt(arts["ours:fp32"], text) for text in texts]
    prompt = prompts[0]
    n = args.new_tokens
    speculating = {f"ours:{engines[-1]}+{m}": m for m in filter(None, args.speculation.split(","))}
    arts |= {system: arts[f"ours:{engines[-1]}"] for system in speculating}
    speed: dict[str, list[float]] = {k: [] for k in [*llamas, *arts]}
    prefill: dict[str, list[float]] = {k: [] for k in speed}
    ids: dict[str, list[int]] = {}

    def run(system: str, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
        """(prefill ms, decode tokens/s, new token ids)."""
        if system in llamas:
            return llamas[system].generate(prompt, new)
        tps, r = time_ours(arts[system], prompt, new, speculating.get(system, False))
        return r.metrics.ttft_s * 1e3, tps, r.token_ids

    for system in speed:  # warm-up
        run(system, prompt, 8)
    for _ in range(args.repeats):
        for system in speed:
            tokens, seconds, ms, ids[system] = 0, 0.0, [], []
            for p in prompts:
                prefill_ms, tps, new_ids = run(system, p, n)
                tokens, seconds = tokens + len(new_ids) - 1, seconds + ((len(new_ids) - 1) / tps if tps else 0.0)
                ms.append(prefill_ms)
                ids[system] += new_ids
            speed[system].append(round(tokens / seconds, 1) if seconds else 0.0)
            prefill[system].append(round(float(np.mean(ms)), 1))
    gbs = read_bandwidth_gbs()
    ref = float(np.median(speed[f"llama.cpp:{REFERENCE}"])) if f"llama.cpp:{REFERENCE}" in speed else None
    report = {"machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores",
              "cpu": cpu_name(), "recipe": recipe.name, "prompts": len(prompts),
              "prompt_tokens": [len(p) for p in prompts], "new_tokens": n,
              "threads": args.threads, "read_bandwidth_GB_per_s": round(gbs, 1), "systems": {}}
    for system in speed:
        kind, _, name = system.partition(":")
        own_f32 = {"llama.cpp": "llama.cpp:F32", "genai": "genai:fp32" if "genai:fp32" in speed else "ours:fp32"
                   }.get(kind, "ours:fp32")
        if system in speculating:  # lossless: the same engine's autoregressive text
            own_f32 = system.partition("+")[0]
        mb = (llama_file(source, name).stat().st_size if kind == "llama.cpp"
              else llamas[system].weight_bytes() if kind == "genai"
              else weight_bytes_per_call(arts[system].path, "tlm")) / 1e6
        med = float(np.median(speed[system]))
        report["systems"][system] = {
            "decode_tokens_per_s": speed[system], "median": med, "prefill_ms": prefill[system],
            f"vs_llama.cpp_{REFERENCE}": round(med / ref, 3) if ref else None,
            # the system the next two figures compare with: its own float32, or for a speculating
            # engine its autoregressive self (genai without its fp32 build: ours)
            "compared_with": own_f32,
            "vs_own_f32": round(med / float(np.median(speed[own_f32])), 3),
            "weights_read_per_token_MB": round(mb, 1), "floor_tokens_per_s": round(gbs * 1e3 / mb, 1),
            "fraction_of_floor": round(med * mb / (gbs * 1e3), 3),
            "text_equals_own_f32": ids[system] == ids[own_f32], "generated": len(ids[system]),
            "pss_mib_alone": None,
        }
    if not args.no_pss:
        # Alone: a page this process still mapped would count half to the child (PSS shares it out)
        arts.clear()
        llamas.clear()
        gc.collect()
        for system in report["systems"]:
            if not (system.startswith("genai:") or system in speculating):
                report["systems"][system]["pss_mib_alone"] = pss_of(system, prompt, args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
