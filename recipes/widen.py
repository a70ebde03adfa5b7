"""A decode-bound TLM made from the shipped one by a function-preserving widening (Net2WiderNet).

The shipped stdlib TLM (5.5M parameters, ~22 MB in float32) fits in a CPU's last-level cache, so its
decode step is bound by dispatch and compute, not by reading weights: MXFP6 weights cannot show their
advantage on it. `widen(model, r)` repeats every dimension r times and returns a model r^2 times
larger in its decoder that computes the same function, so speed can be measured on a weight-bound
model without training one (and without shipping its weights: it is built from recipes/builtin/ in
seconds, deterministically).

Every width is tiled: hidden unit i becomes units c*H + i (c = 0..r-1), likewise attention heads
(c*n_heads + j), key/value heads and MLP neurons. Tiled copies keep three things unchanged:
- RMSNorm: the mean of squares over r equal copies of every unit is the mean over the originals;
- attention: head size stays the same (RoPE and the 1/sqrt(head_dim) scale are unchanged), and with
  g = n_heads / n_kv_heads, q head c*n_heads + j reads kv head (c*n_heads + j) // g = c*n_kv + j // g,
  copy c of its original kv head j // g (HF's repeat_kv grouping);
- every weight that reads widened inputs is divided by r, so r copies of an input sum to the original.
The token embedding is tiled unscaled and the LM head reads the tiled hidden state (so it is divided
by r): a tied model comes out untied.

WIDE_R = 4 gives 79.2M parameters (decoder 70.8M; r = 5: 121M, r = 6: 172M). It is the only r in the
issue's 4-6 range that is a power of two, which keeps the widening exact beyond float32: W / 4 is the
shipped fp16 weight with its exponent lowered by 2, and MX block scales are powers of two, so the
MXFP6 quantization of a tiled 32-block of W / 4 is the quantization of the original block scaled by
1 / 4 (checked in tests/test_widen.py; at r = 5 blocks round differently), and the fused kernel sees
the same activation blocks. The MXFP6 wide TLM therefore computes the MXFP6 small TLM's function up
to float summation order (the same tokens barring near-ties), so speculative acceptance stays
comparable between the two recipes. At r = 4 the weights read per token (317 MB in float32, ~88 MB
for MXFP6 with its float32 LM head) are several times a 32 MB L3 cache: decoding is weight-bound.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from common.cache import cache_root
from common.staging import MARKER, OutputExistsError, clean_stale, make_staging
from recipes.default_pair import shipped_model_dir

WIDE_R = 4
# builtin name -> (shipped model it is widened from, r)
WIDE_MODELS: dict[str, tuple[str, int]] = {"stdlib-tlm-wide": ("stdlib-tlm", WIDE_R)}
RECORD = "widening.json"


def _tile(w: torch.Tensor, rows: int, cols: int, divide: int) -> torch.Tensor:
    """w tiled rows x cols times (a 1-D w: rows times), divided by `divide` when it reads widened inputs."""
    tiled = w.repeat(rows) if w.dim() == 1 else w.repeat(rows, cols)
    return tiled / divide if divide != 1 else tiled.clone()


def widened_config(config: LlamaConfig, r: int) -> LlamaConfig:
    """The source config with every width times r, head size explicit and unchanged, embeddings untied."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    data = config.to_dict()
    data.update(
        hidden_size=config.hidden_size * r,
        intermediate_size=config.intermediate_size * r,
        num_attention_heads=config.num_attention_heads * r,
        num_key_value_heads=config.num_key_value_heads * r,
        head_dim=head_dim,
        tie_word_embeddings=False,
        dtype="float32",
    )
    return LlamaConfig.from_dict(data)


@torch.no_grad()
def widen(model: LlamaForCausalLM, r: int) -> LlamaForCausalLM:
    """A float32 Llama with every width times r that computes the same logits as `model`."""
    if model.config.model_type != "llama":
        raise ValueError(f"widen supports Llama models, got model type {model.config.model_type!r}")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"r must be a positive integer, got {r!r}")
    config = widened_config(model.config, r)
    src = {k: v.float() for k, v in model.state_dict().items()}
    with torch.device("meta"):  # no random init: every tensor is set below (and the global RNG is left alone)
        wide = LlamaForCausalLM(config).eval()
    out: dict[str, torch.Tensor] = {}
    for name, param in wide.state_dict().items():
        if name == "lm_head.weight":
            w = src.get(name, src["model.embed_tokens.weight"])  # a tied source has no lm_head entry
            out[name] = _tile(w, 1, r, r)  # reads the tiled hidden state
        elif name == "model.embed_tokens.weight":
            out[name] = _tile(src[name], 1, r, 1)  # writes the tiled hidden state, nothing to divide
        elif name.endswith(".bias"):
            out[name] = _tile(src[name], r, 1, 1)  # added to a widened output
        elif name.endswith("norm.weight"):
            out[name] = _tile(src[name], r, 1, 1)
        elif name.endswith(".weight"):
            out[name] = _tile(src[name], r, r, r)  # linear layers: widened output and widened input
        else:
            raise ValueError(f"widen does not know how to widen {name!r}")
        if out[name].shape != param.shape:
            raise ValueError(f"{name}: widened shape {tuple(out[name].shape)} != expected {tuple(param.shape)}")
    wide.load_state_dict(out, strict=True, assign=True)
    for name, buf in model.named_buffers():  # RoPE tables: head size and rope settings are unchanged
        owner, _, leaf = name.rpartition(".")
        setattr(wide.get_submodule(owner), leaf, buf.detach().clone())
    left = [n for n, t in [*wide.named_parameters(), *wide.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"widen left tensors unset: {left}")
    wide.generation_config = copy.deepcopy(model.generation_config)
    return wide


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """A seconds-long step that also runs inside `python -m export --quiet`: no transformers bars."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _check_replaceable(out_dir: Path) -> None:
    """Replace only a missing or empty folder, or a widening of ours (it holds RECORD)."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise OutputExistsError(f"{out_dir} exists and is not a folder; choose another --out")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / RECORD).is_file():
        raise OutputExistsError(f"{out_dir} is a non-empty folder that is not a widened model; nothing was changed")


def build(source_dir: Path, r: int, out_dir: Path) -> dict:
    """Widen the checkpoint in source_dir into out_dir (float32 safetensors + its tokenizer), atomically.

    float32 because r copies of fp16(W / r) only sum back to W when r is a power of two; the exporter
    loads float32 anyway. The model is written in a hidden staging folder beside out_dir (marked, so
    one left by a killed build is removed by the next) and renamed into place; an existing out_dir
    is replaced only if it is empty or a widening (RECORD present).
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out_dir)
    with _no_progress_bars():
        source = LlamaForCausalLM.from_pretrained(source_dir, dtype=torch.float32, local_files_only=True)
        wide = widen(source, r)
    record = {
        "source_sha256": _sha256(source_dir / "model.safetensors"), "r": r,
        "parameters": parameter_count(wide), "source_parameters": parameter_count(source),
    }
    staged = make_staging(out_dir, "partial")
    try:
        with _no_progress_bars():
            wide.save_pretrained(staged)
        for f in sorted(source_dir.iterdir()):
            if f.name.startswith(("tokenizer", "special_tokens")) and f.is_file():
                shutil.copy2(f, staged / f.name)
        (staged / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if out_dir.exists():
            old = make_staging(out_dir, "old")
            os.replace(out_dir, old / out_dir.name)
            shutil.rmtree(old)
        (staged / MARKER).unlink()
        os.replace(staged, out_dir)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return {**record, "seconds": round(time.perf_counter() - t0, 2)}


def _is_current(target: Path, source_dir: Path, r: int) -> bool:
    """A cached widening made from the current shipped weights with the same r."""
    try:
        record = json.loads((target / RECORD).read_text())
    except (OSError, ValueError):
        return False
    return (
        record.get("r") == r
        and record.get("source_sha256") == _sha256(source_dir / "model.safetensors")
        and (target / "config.json").is_file()
        and (target / "model.safetensors").is_file()
    )


def wide_model_dir(name: str) -> Path:
    """The checkpoint folder of a widened builtin model, built into the cache on first use.

    Rebuilt when the shipped source weights change (the record keeps their sha256).
    """
    source_name, r = WIDE_MODELS[name]
    source_dir = shipped_model_dir(source_name)
    target = cache_root() / "builtin" / name
    if not _is_current(target, source_dir, r):
        build(source_dir, r, target)
    return target


def main(argv: list[str] | None = None) -> None:
    """Build the widened stdlib TLM and print its size and build time."""
    parser = argparse.ArgumentParser(prog="python -m recipes.widen", description=main.__doc__)
    parser.add_argument("--r", type=int, default=WIDE_R, help=f"width multiplier (default {WIDE_R})")
    parser.add_argument("--out", type=Path, help="default: the builtin cache folder of stdlib-tlm-wide (r = 4 only)")
    args = parser.parse_args(argv)
    if args.r < 1:
        parser.error("--r must be >= 1")
    out = args.out
    if out is None:
        if args.r != WIDE_R:
            parser.error(f"--r {args.r} needs --out (the cache folder holds the r = {WIDE_R} model)")
        out = cache_root() / "builtin" / "stdlib-tlm-wide"
    record = build(shipped_model_dir("stdlib-tlm"), args.r, out)
    print(f"{out}: r={args.r}, {record['parameters']:,} parameters "
          f"(from {record['source_parameters']:,}), built in {record['seconds']:.1f} s")


if __name__ == "__main__":
    main()
