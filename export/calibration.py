"""What the quantizer's error feedback needs from the float model: each linear's input second moments.

GPTQ-style quantization (quant/error_feedback.py) rounds a weight's columns so that the error of the
layer's *output* on typical inputs is small, not the error of each weight alone; the inputs enter
only through H = sum_t x_t x_t^T over calibration tokens. This module runs transformers' float32
model of a checkpoint over a calibration text and collects H for every weight the quant pass stores
in MX, keyed by the graphs' weight names (`layers.0.mlp.up_proj.weight.T`). Linears that read the
same input (q/k/v, gate/up) share one matrix. The whole float32 model is held in memory, which is
checked first (a 7B model's layer-by-layer calibration is not built). The statistics come from the
float model's own activations, not from the partly quantized model's as in GPTQ's sequential form;
each chunk starts at position 0, as every request does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from common.manifest import sha256_file
from common.recipe import MIN_CALIBRATION_TOKENS as MIN_TOKENS
from common.resources import check_memory
from export.loader import read_config, resolve_calibration_text
from export.onnx_export import short_name
from export.weights import checkpoint_tensors

log = logging.getLogger("mxspd.export")
CHUNK = 512  # tokens per forward call: attention over a chunk, not the whole text


class CalibrationError(ValueError):
    """A calibration text that cannot be used (unreadable, too few tokens)."""


def float_model(model_dir: Path, context_length: int) -> PreTrainedModel:
    """The checkpoint's float32 model, its weights read as the exporter reads them (safetensors or GGUF),
    with the LM head a copy of its own (a tied head is quantized apart from the embedding, as exported)."""
    config = read_config(model_dir, context_length)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    source = checkpoint_tensors(model_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(source(name))
        embedding = model.get_input_embeddings().weight
        if model.lm_head.weight.data_ptr() == embedding.data_ptr():
            model.lm_head.weight = torch.nn.Parameter(embedding.detach().clone())
    return model


def calibration_tokens(text_file: Path, model_dir: Path, limit: int) -> np.ndarray:
    """The first `limit` tokens of a calibration text (special-token markup such as a chat template's is
    read as those tokens)."""
    try:
        text = Path(text_file).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"calibration text {text_file} cannot be read: {exc}") from None
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tok(text, add_special_tokens=False)["input_ids"][:limit]
    if len(ids) < MIN_TOKENS:
        raise CalibrationError(f"calibration text {text_file} has {len(ids)} tokens; at least {MIN_TOKENS} needed")
    return np.asarray(ids, dtype=np.int64)


def input_hessians(model: PreTrainedModel, tokens: np.ndarray, wanted: Callable[[str], bool],
                   progress: bool = True) -> dict[str, np.ndarray]:
    """H = X^T X (float32 [K, K], summed in float64) of the input of every linear whose graph weight name
    `wanted` selects, over `tokens` in chunks of CHUNK from position 0."""
    names = {m: short_name(n) + ".weight.T" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = {m: w for m, w in names.items() if wanted(w)}
    totals: dict[str, torch.Tensor] = {}  # per input's first reader
    follows: dict[str, str] = {}  # a linear reading the same input as an earlier one -> that one
    readers: dict[int, tuple[torch.Tensor, str]] = {}  # within one call; holding x keeps its id unique

    def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        x, name = inputs[0], names[module]
        first = readers.setdefault(id(x), (x, name))[1]
        if first != name:
            follows[name] = first
            return
        flat = x.reshape(-1, x.shape[-1]).double()
        totals[name] = totals[name] + flat.T @ flat if name in totals else flat.T @ flat

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        chunk = min(CHUNK, getattr(model.config, "max_position_embeddings", CHUNK))
        for start in tqdm(range(0, len(tokens), chunk), desc="calibrate", unit="chunk", disable=not progress):
            with torch.no_grad():
                model(torch.from_numpy(tokens[None, start : start + chunk]))
            readers.clear()
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name in list(totals):  # one float64 sum at a time becomes float32
        out[name] = totals.pop(name).float().numpy()
    return out | {name: out[first] for name, first in follows.items()}


def check_fits(model_dir: Path, context_length: int) -> None:
    """Refuse a calibration whose float32 model (and its copy of a tied head), activations and input
    statistics (K x K per linear, float64 while summed and float32 after) would not fit in memory."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(read_config(model_dir, context_length))
    params = sum(p.numel() for p in model.parameters())
    statistics = sum(12 * m.in_features**2 for m in model.modules() if isinstance(m, torch.nn.Linear))
    check_memory(int(4 * params * 1.5) + statistics, f"calibrating {model_dir} ({params / 1e9:.2f}B parameters)",
                 "its float32 model, activations, and every linear's K x K input statistics; without a calibration "
                 "text (mx_calibration = \"\", or `python -m export --mx-calibration none`) MX rounds to nearest")


def calibrate(text_reference: str, tokens: int, model_dir: Path, context_length: int,
              wanted: Callable[[str], bool], progress: bool = True, model: PreTrainedModel | None = None
              ) -> tuple[dict[str, np.ndarray], str]:
    """Input statistics of the weights `wanted` selects over the first `tokens` tokens of a recipe's
    calibration text (through `model`, or the checkpoint's float model), and a line saying what they
    came from (with the text's digest, so that a changed text is a changed build)."""
    text = resolve_calibration_text(text_reference)
    if model is None:
        check_fits(model_dir, context_length)
    ids = calibration_tokens(text, model_dir, tokens)
    if len(ids) < tokens:
        log.info("calibration text %s has %d tokens, fewer than the %d asked for: using them all", text, len(ids),
                 tokens)
    model = model or float_model(model_dir, context_length)
    digest = sha256_file(text)[:16]
    return input_hessians(model, ids, wanted, progress), f"{len(ids)} tokens of {text_reference} (sha256 {digest})"
