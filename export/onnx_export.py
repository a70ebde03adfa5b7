"""Traces a causal LM into fixed-shape ONNX graphs that share one weights file.

One trace per graph (T new tokens each). Initializers are renamed after the parameters they
came from (the TorchScript exporter calls pre-transposed Linear weights `onnx::MatMul_N`), so later
passes can select weights by module path; the `.T` suffix marks a weight stored as [in, out].
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnx
import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from common import graph_io
from common.graph_io import ModelDims
from common.onnx_store import save_shared
from export.wrapper import ExplicitKVWrapper

OPSET = 18
WEIGHTS_FILE = "weights.bin"
EXPORT_INFO = "export.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
)


def model_dims(model: PreTrainedModel) -> ModelDims:
    cfg = model.config
    heads = cfg.num_attention_heads
    return ModelDims(
        n_layers=cfg.num_hidden_layers,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        vocab_size=cfg.vocab_size,
    )


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _parameter_names(model: PreTrainedModel) -> dict[str, str]:
    """sha256 of a parameter's bytes (as stored, or transposed for MatMul) -> a readable name."""
    names: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(_digest(p), name)
        if p.dim() == 2:
            transposed = _digest(p.t())
            if transposed not in names or "lm_head" in name:
                names[transposed] = f"{name}.T"
    return names


def _rename_initializers(model: onnx.ModelProto, names: dict[str, str]) -> None:
    import numpy as np
    from onnx import numpy_helper

    mapping: dict[str, str] = {}
    taken = {t.name for t in model.graph.initializer}
    for t in model.graph.initializer:
        if not t.name.startswith("onnx::") and "." in t.name:
            new = t.name.removeprefix("model.")
        else:
            arr = np.ascontiguousarray(numpy_helper.to_array(t))
            found = names.get(hashlib.sha256(arr.tobytes()).hexdigest())
            if found is None:
                continue
            new = found
        new = new.removeprefix("model.").removeprefix("transformer.")  # Llama family / CodeGen
        if new != t.name and new not in taken:
            mapping[t.name] = new
            taken.add(new)
    for t in model.graph.initializer:
        t.name = mapping.get(t.name, t.name)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in mapping:
                node.input[i] = mapping[name]


def _example_inputs(dims: ModelDims, tokens: int, context: int, batch: int) -> tuple[torch.Tensor, ...]:
    shapes = graph_io.input_shapes(dims, batch, tokens, context)
    ids = torch.zeros(shapes[graph_io.INPUT_IDS], dtype=torch.int64)
    pos = torch.arange(tokens, dtype=torch.int64).expand(batch, tokens).contiguous()
    mask = torch.ones(shapes[graph_io.ATTENTION_MASK], dtype=torch.bool)
    past = [torch.zeros(shapes[n]) for n in graph_io.input_names(dims)[3:]]
    return (ids, pos, mask, *past)


def trace_graph(
    model: PreTrainedModel, tokens: int, context: int, batch: int = 1, split_attention: bool = True
) -> onnx.ModelProto:
    """One fixed-shape graph; `split_attention=False` (transformers' concat attention) is a benchmark baseline."""
    dims = model_dims(model)
    wrapper = ExplicitKVWrapper(model, split=split_attention).eval()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "graph.onnx"
        with torch.no_grad():
            torch.onnx.export(
                wrapper,
                _example_inputs(dims, tokens, context, batch),
                str(path),
                input_names=graph_io.input_names(dims),
                output_names=graph_io.output_names(dims),
                opset_version=OPSET,
                dynamo=False,
                do_constant_folding=True,
            )
        return onnx.load(str(path), load_external_data=True)


def export_model(
    model: PreTrainedModel,
    out_dir: Path,
    graph_tokens: dict[str, int],
    context_length: int,
    batch: int = 1,
    source: str = "",
    tokenizer_dir: Path | None = None,
    progress: bool = True,
) -> ModelDims:
    """Write out_dir/<graph>.onnx for each graph, one shared weights file, tokenizer and export.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = _parameter_names(model)

    def traced() -> Iterator[tuple[str, onnx.ModelProto]]:  # one at a time: each is saved before the next
        for key, tokens in tqdm(graph_tokens.items(), desc=f"export {source or 'model'}", disable=not progress):
            graph = trace_graph(model, tokens, context_length, batch)
            _rename_initializers(graph, names)
            yield key, graph

    save_shared(traced(), out_dir, WEIGHTS_FILE)
    dims = model_dims(model)
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = model.config.eos_token_id if eos is None else eos
    info = {
        "source": source,
        "model_type": model.config.model_type,
        "dims": dims.to_dict(),
        "graphs": graph_tokens,
        "weights": WEIGHTS_FILE,
        "context_length": context_length,
        "batch": batch,
        "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
    }
    (out_dir / EXPORT_INFO).write_text(json.dumps(info, indent=2))
    if tokenizer_dir is not None:
        tok_out = out_dir / "tokenizer"
        tok_out.mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, tok_out / name)
    return dims
