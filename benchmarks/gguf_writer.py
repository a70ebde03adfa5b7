"""A Llama-family checkpoint's own weights as an F16 GGUF file, so llama.cpp runs exactly what we run.

    python -m benchmarks.gguf_writer CHECKPOINT_DIR OUT.gguf

The inverse of export/gguf_checkpoint.py: transformers' state-dict keys to llama.cpp's tensor names,
Q and K rows permuted as llama.cpp's converter does (each head's two RoPE halves interleaved), the
matrices float16 and the norms float32, and the hyperparameters llama.cpp's `llama` architecture reads.
Tensors are streamed one at a time (a 7B checkpoint never sits in memory). The vocabulary is written as
placeholder pieces with the checkpoint's size and special ids: the benchmarks give llama.cpp token ids,
never text, so its tokenizer only has to load. A tied LM head is written as `output.weight` too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from export.gguf_checkpoint import GLOBAL_NAMES, LAYER_NAMES
from export.weights import checkpoint_tensors

F16_FILE_TYPE = 1  # llama.cpp's LLAMA_FTYPE_MOSTLY_F16


class UnsupportedCheckpointError(ValueError):
    """A checkpoint llama.cpp's `llama` architecture cannot hold as it is (not a Llama-family model)."""


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: within each head, row i of the first RoPE half then row i of the second."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_shapes(config: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (transformers key, shape as transformers stores it), for every tensor llama.cpp reads."""
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    layer = {"input_layernorm": (hidden,), "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden),
             "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q), "post_attention_layernorm": (hidden,),
             "mlp.gate_proj": (inner, hidden), "mlp.up_proj": (inner, hidden), "mlp.down_proj": (hidden, inner)}
    whole = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
             "lm_head.weight": (vocab, hidden)}
    shapes = {name: (hf, whole[hf]) for name, hf in GLOBAL_NAMES.items()}
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"blk.{i}.{short}.weight": (f"model.layers.{i}.{hf}.weight", layer[hf])
                   for short, hf in LAYER_NAMES.items()}
    return shapes


def read_llama_config(model_dir: Path) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("model_type") not in ("llama", "mistral"):
        raise UnsupportedCheckpointError(f"{model_dir}: model_type {config.get('model_type')!r} is not a Llama-family "
                                         "model (llama, mistral), which is what llama.cpp's llama architecture runs")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise UnsupportedCheckpointError(f"{model_dir}: biases in attention or MLP are not written")
    return config


def write_f16_gguf(model_dir: Path, out: Path, progress: bool = True) -> Path:
    """Write `out` (atomically) from the checkpoint in `model_dir`; returns `out`."""
    import gguf
    from tqdm import tqdm

    config = read_llama_config(model_dir)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    source = checkpoint_tensors(Path(model_dir))
    tied = config.get("tie_word_embeddings", False)
    shapes = tensor_shapes(config)
    tmp = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(Path(model_dir).name)
    w.add_context_length(config.get("max_position_embeddings", 4096))
    w.add_embedding_length(hidden)
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_file_type(F16_FILE_TYPE)
    vocab = config["vocab_size"]
    special = {config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} - {None}
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(vocab)])
    for key in ("bos_token_id", "eos_token_id"):
        if config.get(key) is not None:
            getattr(w, f"add_{key}")(config[key])
    w.add_add_bos_token(False)
    for name, (_, shape) in shapes.items():
        dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for key, shape in tqdm(shapes.values(), desc=out.name, unit="tensor", disable=not progress):
        t = source("model.embed_tokens.weight" if key == "lm_head.weight" and tied else key).float().numpy()
        if t.shape != shape:
            raise UnsupportedCheckpointError(f"{model_dir}: {key} has shape {t.shape}, not the {shape} its config says")
        if key.endswith("self_attn.q_proj.weight"):
            t = permute(t, heads)
        elif key.endswith("self_attn.k_proj.weight"):
            t = permute(t, kv_heads)
        w.write_tensor_data(np.ascontiguousarray(t.astype(np.float32 if len(shape) == 1 else np.float16)))
    w.close()
    tmp.replace(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a Llama-family Hugging Face checkpoint folder")
    ap.add_argument("out", type=Path, help="the .gguf file to write")
    args = ap.parse_args()
    try:
        path = write_f16_gguf(args.checkpoint, args.out)
    except (UnsupportedCheckpointError, FileNotFoundError) as exc:
        ap.exit(2, f"error: {exc}\n")
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, F16)")


if __name__ == "__main__":
    main()
