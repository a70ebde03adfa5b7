"""Write a checkpoint with the exact shape of a real model and RANDOM weights, without downloading it.

    python -m benchmarks.make_checkpoint --shape llama2-7b --out DIR [--seed 0] [--layers N]

Shapes: llama2-7b (meta-llama/Llama-2-7b-chat-hf), llama-160m (JackFram/llama-160m), codegen-6b
(Salesforce/codegen-6B-mono), codegen-350m (Salesforce/codegen-350M-mono). The weights are random
(normal, std 0.02; norms 1, biases 0) and stored as float16 safetensors: the model computes
nothing meaningful. It exists to measure what the real size costs (export time, memory, disk,
decode speed). Tensors are written one at a time, so memory stays at one tensor whatever the
size. The tokenizer is a byte-level BPE trained on this Python's standard library sources to the
model's vocabulary size (deterministic); models of one family get the same tokenizer. `--layers N`
keeps the shape's widths with N decoder layers: each layer costs what the full model's does, so a
short lease can build and time it (docs say so wherever a figure comes from one).
"""

from __future__ import annotations

import argparse
import json
import struct
import sysconfig
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, CodeGenConfig, LlamaConfig, PretrainedConfig

LLAMA = dict(model_type="llama", vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False, hidden_act="silu", torch_dtype="float16")
SHAPES: dict[str, dict] = {
    "llama2-7b": LLAMA | dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "llama-160m": LLAMA | dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                               num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
                               rms_norm_eps=1e-6),
    "codegen-6b": dict(model_type="codegen", vocab_size=51200, n_embd=4096, n_layer=33, n_head=16, rotary_dim=64,
                       n_positions=2048, n_ctx=2048, bos_token_id=1, eos_token_id=50256, tie_word_embeddings=False,
                       torch_dtype="float16"),
    "codegen-350m": dict(model_type="codegen", vocab_size=51200, n_embd=1024, n_layer=20, n_head=16, rotary_dim=32,
                         n_positions=2048, n_ctx=2048, bos_token_id=1, eos_token_id=50256,
                         tie_word_embeddings=False, torch_dtype="float16"),
}
LLAMA2_CHAT = ("{% for m in messages %}{% if m['role'] == 'user' %}"
               "{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
               "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")


def config_for(shape: str, layers: int | None = None) -> PretrainedConfig:
    values = dict(SHAPES[shape])
    kind = values.pop("model_type")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be at least 1, not {layers}")
        values["num_hidden_layers" if kind == "llama" else "n_layer"] = layers
    return (LlamaConfig if kind == "llama" else CodeGenConfig)(**values)


def tensor_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, from the model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if not name.endswith(".masked_bias")
            and not name.endswith(".attn.bias")}


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("norm.weight") or ".ln_" in name or name.endswith("ln_f.weight"):
        return np.ones(shape, np.float16)
    if name.endswith(".bias"):
        return np.zeros(shape, np.float16)
    out = np.empty(shape, np.float16)
    flat = out.reshape(-1)
    for s in range(0, flat.size, 1 << 24):  # 16M values at a time: bounded float32 scratch
        n = min(1 << 24, flat.size - s)
        flat[s : s + n] = rng.standard_normal(n, dtype=np.float32) * 0.02
    return out


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], seed: int, progress: bool = True) -> int:
    """Stream random float16 tensors into one safetensors file (header first, then each tensor)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", "note": "random weights (benchmarks.make_checkpoint)"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape in tqdm(shapes.items(), desc=path.name, unit="tensor", disable=not progress):
            f.write(_values(name, shape, rng).tobytes())
    tmp.replace(path)
    return offset


def write_tokenizer(out: Path, vocab_size: int, bos: str, eos: str, chat_template: str | None) -> None:
    """A byte-level BPE with exactly vocab_size entries, trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", bos, eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    filler = vocab_size - tok.get_vocab_size()
    if filler > 0:  # the library ran out of merges: unused tokens fill the vocabulary
        tok.add_tokens([f"<extra_{i}>" for i in range(filler)])
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "unk_token": "<unk>", "model_max_length": 4096}
    if chat_template:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_checkpoint(shape: str, out: Path, seed: int = 0, progress: bool = True, layers: int | None = None) -> Path:
    config = config_for(shape, layers)
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    total = write_safetensors(out / "model.safetensors", shapes, seed, progress)
    config.save_pretrained(out)
    llama = config.model_type == "llama"
    write_tokenizer(out, config.vocab_size, "<s>" if llama else "<|bos|>", "</s>" if llama else "<|endoftext|>",
                    LLAMA2_CHAT if llama else None)
    params = sum(int(np.prod(s)) for s in shapes.values())
    kept = "" if layers is None else f", {layers} decoder layers"
    (out / "README.md").write_text(f"RANDOM weights with the shape of {shape}{kept} ({params:,} parameters, "
                                   f"{total / 2**30:.1f} GiB float16), written by benchmarks.make_checkpoint. "
                                   "Not a trained model.\n")
    AutoConfig.from_pretrained(out, local_files_only=True)  # readable by transformers
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's own)")
    args = ap.parse_args()
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be at least 1, not {args.layers}")
    path = make_checkpoint(args.shape, args.out, args.seed, layers=args.layers)
    kept = "" if args.layers is None else f" ({args.layers} decoder layers)"
    print(f"wrote {path}: RANDOM weights with the shape of {args.shape}{kept}")


if __name__ == "__main__":
    main()
