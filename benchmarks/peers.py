"""The peers the benchmarks run in-process, each timed the same way (prefill, then greedy decode):
llama.cpp through llama-cpp-python (its formats of a GGUF made once with llama_model_quantize and
cached), and onnxruntime-genai's model builder's builds (the `bench` extra) of a float32 Hugging Face
copy of the same GGUF.

llama-cpp-python is a benchmark-only extra (`pip install -e ".[peers]"`); it builds llama.cpp from
source, natively for the CPU it is built on. Where its AMX matmul dies of SIGILL at `tilezero` (Q8_0, Q6_K and
other AMX types; seen on an Intel Xeon whose tiles mxspd's own AMX path runs on: docs/development.md), build it
without AMX: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"; on an AVX2-only CPU
whose native build crashes, CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON".
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.decode import genai_model, time_genai
from benchmarks.gguf_writer import write_f16_gguf
from common.cache import cache_root
from export.gguf_checkpoint import gguf_file, is_gguf_reference
from export.loader import resolve_model_dir


def llama_cpp_module():
    try:
        import llama_cpp
    except ImportError:
        sys.exit('llama-cpp-python is not installed: pip install -e ".[peers]" (a benchmark-only extra)')
    return llama_cpp


def checkpoint_gguf(checkpoint: Path) -> Path:
    """The checkpoint's own weights as an F16 GGUF, written once (keyed by its files' names, sizes, times)."""
    files = sorted(f for f in checkpoint.iterdir() if f.is_file())
    key = hashlib.sha256(repr([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode())
    out = cache_root() / "bench" / "gguf" / f"{checkpoint.name}-{key.hexdigest()[:12]}-F16.gguf"
    return out if out.is_file() else write_f16_gguf(checkpoint, out)


def llama_source(reference: str) -> Path:
    """The GGUF llama.cpp's formats of a recipe's model are made from: the model's own GGUF file, or an F16 GGUF of
    its checkpoint's weights (a model with float weights: builtin:NAME, a folder, a cached Hugging Face id)."""
    return gguf_file(reference) if is_gguf_reference(reference) else checkpoint_gguf(resolve_model_dir(reference))


def llama_file(source: Path, fmt: str) -> Path:
    """`source` in llama.cpp format `fmt` (F32, Q8_0, ...), made once with llama_model_quantize."""
    out = cache_root() / "bench" / "llamacpp" / f"{source.stem}-{fmt}.gguf"
    if out.is_file():
        return out
    llama_cpp = llama_cpp_module()
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32" if fmt == "F32" else f"LLAMA_FTYPE_MOSTLY_{fmt}")
    params.allow_requantize = True
    tmp = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize to {fmt} failed")
    tmp.rename(out)
    return out


def _streamed(path: Path) -> list:
    """The tensors of a llama.cpp file a decode step reads whole: all but the token embedding table (one row is
    gathered), unless the model ties its output matrix to that table (no output.weight: the table is the head)."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return [t for t in tensors if tied or t.name != "token_embd.weight"]


def streamed_bytes(path: Path) -> int:
    """Bytes of a llama.cpp file a decode step reads."""
    return sum(int(t.n_bytes) for t in _streamed(path))


def matrix_bits(path: Path) -> float:
    """Bits per weight of a llama.cpp file over the matrices a decode step multiplies (its decoder's and the
    output matrix), as benchmarks.accuracy counts ours."""
    matrices = [t for t in _streamed(path) if len(t.shape) == 2]
    return 8 * sum(int(t.n_bytes) for t in matrices) / sum(int(t.n_elements) for t in matrices)


def llama_path(source: Path, fmt: str, checkpoint: Path | None) -> Path:
    """llama.cpp's file of `fmt`: a checkpoint's F16 GGUF is its own source."""
    return source if fmt == "F16" and checkpoint is not None else llama_file(source, fmt)


class LlamaCpp:
    """One llama.cpp model: prefill the prompt ids, then greedy decode, timed apart."""

    def __init__(self, path: Path, threads: int, context: int = 512) -> None:
        llama_cpp = llama_cpp_module()
        self.llm = llama_cpp.Llama(str(path), n_ctx=context, n_batch=min(context, 512), n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.path = path
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
