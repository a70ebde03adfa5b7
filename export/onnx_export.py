"""Traces a causal LM into fixed-shape ONNX graphs that share one weights file.

One trace per graph (T new tokens each), with the weights as graph inputs: the trace holds no
weight, so a placeholder model with the checkpoint's shapes is enough. Each weight input is named
after the parameter it came from (module structure, not content), so later passes select weights
by module path; the `.T` suffix marks a weight stored as [in, out]. The weights are then streamed
from the checkpoint into one shared file (export/weights.py) and attached to every graph.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from common import graph_io
from common.graph_io import ModelDims
from common.onnx_store import embedding_tables, matmul_weights, rewrite_graph, save_graph, shared_file
from export.split_attention import attention_function
from export.weights import (
    KEEP_WEIGHTS,
    TensorSource,
    WeightPasses,
    WeightRef,
    model_tensors,
    read_weight,
    unique_refs,
    write_weights,
)
from export.wrapper import ExplicitKVWrapper
from kernels import DOMAIN

OPSET = 18
WEIGHTS_FILE = "weights.bin"
EXPORT_INFO = "export.json"
WRAPPED = "model."  # ExplicitKVWrapper holds the model as `.model`: traced names start with it
SHAPE_PARAM_LIMIT = 65536  # elements; larger parameters are weights, never shapes
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


def _example_inputs(dims: ModelDims, tokens: int, context: int, batch: int) -> tuple[torch.Tensor, ...]:
    shapes = graph_io.input_shapes(dims, batch, tokens, context)
    ids = torch.zeros(shapes[graph_io.INPUT_IDS], dtype=torch.int64)
    pos = torch.arange(tokens, dtype=torch.int64).expand(batch, tokens).contiguous()
    mask = torch.ones(shapes[graph_io.ATTENTION_MASK], dtype=torch.bool)
    past = [torch.zeros(shapes[n]) for n in graph_io.input_names(dims)[3:]]
    return (ids, pos, mask, *past)


@contextmanager
def _shape_inference_without_weights() -> Iterator[None]:
    """torch's ONNX shape inference serialises every parameter it is handed to an ONNX tensor (seconds
    and a full copy per layer at 7B); weights never decide a shape, so it is handed only small ones."""
    original = torch._C._jit_pass_onnx_graph_shape_type_inference

    def small_only(graph, params: dict, opset: int):  # noqa: ANN202 - torch's private signature
        return original(graph, {k: v for k, v in params.items() if v.numel() <= SHAPE_PARAM_LIMIT}, opset)

    torch._C._jit_pass_onnx_graph_shape_type_inference = small_only
    try:
        yield
    finally:
        torch._C._jit_pass_onnx_graph_shape_type_inference = original


def short_name(key: str) -> str:
    """A module's name as the graphs name its weights (`model.layers.0.mlp.up_proj` -> `layers.0.mlp.up_proj`)."""
    return key.removeprefix("model.").removeprefix("transformer.")  # Llama family / CodeGen


def _weight_refs(graph: onnx.GraphProto, model: PreTrainedModel, n_io: int) -> list[WeightRef]:
    """Name each weight input of a trace from the module structure.

    A parameter read as it is keeps its state-dict name; a Linear weight that the exporter
    transposed (and called `onnx::MatMul_N`) is named after the module of the MatMul reading it,
    e.g. `/model/model/layers.0/mlp/up_proj/MatMul` -> `layers.0.mlp.up_proj.weight.T`.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}
    for key, p in params.items():
        aliases.setdefault(id(p), []).append(key)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    refs = []
    for inp in graph.input[n_io:]:
        shape = tuple(d.dim_value for d in inp.type.tensor_type.shape.dim)
        users = readers.get(inp.name, [])
        scopes = {".".join(n.name.split("/")[1:-1]).removeprefix(WRAPPED) for n in users}
        if inp.name.startswith("onnx::") and len(scopes) == 1 and all(n.op_type == "MatMul" for n in users):
            key, transpose = f"{scopes.pop()}.weight", True
        else:
            key, transpose = inp.name.removeprefix(WRAPPED), False
        p = params.get(key)
        if p is None or tuple(p.shape)[:: -1 if transpose else 1] != shape:
            raise RuntimeError(f"cannot tell which parameter the traced weight {inp.name!r} {list(shape)} "
                               f"(read by {[n.name for n in users][:2]}) is")
        others = [k for k in aliases[id(p)] if k != key]
        refs.append(WeightRef(short_name(key) + (".T" if transpose else ""), (key, *others), transpose, shape))
    return refs


def trace_structure(
    model: PreTrainedModel, tokens: int, context: int, batch: int = 1, split_attention: bool = True,
    last_row: bool = False,
) -> tuple[onnx.ModelProto, list[WeightRef]]:
    """One fixed-shape graph without its weights, and the weights it reads (initializers to attach).

    Weights are traced as graph inputs, so the model may hold placeholders (see
    loader.placeholder_model): no weight is copied into the graph, whatever the model's size.
    `split_attention=False` (transformers' concat attention) is a benchmark baseline; `last_row`: logits
    for the last row alone (graph_io.PREFILL_LAST).
    """
    dims = model_dims(model)
    wrapper = ExplicitKVWrapper(model, split=split_attention, last_row=last_row).eval()
    io_names = graph_io.input_names(dims)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), _shape_inference_without_weights():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "graph.onnx"
        with torch.no_grad():
            torch.onnx.export(
                wrapper,
                _example_inputs(dims, tokens, context, batch),
                str(path),
                input_names=io_names,
                output_names=graph_io.output_names(dims),
                opset_version=OPSET,
                custom_opsets={DOMAIN: 1},
                dynamo=False,
                do_constant_folding=True,
                export_params=False,
                keep_initializers_as_inputs=True,  # no deduplication by value: it would merge the placeholders
            )
        graph = onnx.load(str(path))
    if any(n.domain == DOMAIN for n in graph.graph.node):
        graph.functions.append(attention_function(OPSET))
    refs = _weight_refs(graph.graph, model, len(io_names))
    rename = {inp.name: ref.name for inp, ref in zip(graph.graph.input[len(io_names):], refs, strict=True)}
    del graph.graph.input[len(io_names):]
    for node in graph.graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    return graph, refs


def attach_weights(model: onnx.ModelProto, refs: list[WeightRef], stored: dict[str, list[onnx.TensorProto]],
                   passes: WeightPasses = KEEP_WEIGHTS) -> onnx.ModelProto:
    """Give a traced graph its weights' stored initializers and the passes' nodes that rebuild them."""
    initializers = [t for ref in refs for t in stored[ref.name]]
    rewrite_graph(model.graph, initializers, passes.nodes(model, [ref.name for ref in refs]))
    return model


def trace_graph(
    model: PreTrainedModel, tokens: int, context: int, batch: int = 1, split_attention: bool = True
) -> onnx.ModelProto:
    """One fixed-shape graph of an in-memory model, its weights inline (tests, benchmarks)."""
    graph, refs = trace_structure(model, tokens, context, batch, split_attention)
    source = model_tensors(model)
    return attach_weights(graph, refs, {ref.name: [read_weight(ref, source, "model")] for ref in refs})


def export_model(
    model: PreTrainedModel,
    tensors: TensorSource,
    out_dir: Path,
    graph_tokens: dict[str, int],
    cache_slots: int,
    batch: int = 1,
    source: str = "",
    tokenizer_dir: Path | None = None,
    passes: WeightPasses = KEEP_WEIGHTS,
    role: str = "model",
    progress: bool = True,
) -> ModelDims:
    """Write out_dir/<graph>.onnx for each graph, one shared weights file, tokenizer and export.json.

    `model` gives the structure (placeholder weights are enough) and `tensors` the weights, read one
    at a time through `passes` (quant.onnx_pass.PassChain) into the weights file.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    traced = {key: trace_structure(model, tokens, cache_slots, batch,
                                   last_row=graph_io.logit_rows(key, tokens) < tokens)
              for key, tokens in tqdm(graph_tokens.items(), desc=f"trace {role}", disable=not progress)}
    refs = unique_refs(r for _, r in traced.values())
    matmul = set().union(*(matmul_weights(graph.graph) for graph, _ in traced.values()))
    tables = set().union(*(embedding_tables(graph.graph) for graph, _ in traced.values()))
    with shared_file(out_dir / WEIGHTS_FILE) as shared:
        stored = write_weights(refs, tensors, shared, passes, matmul, tables, role.upper(), progress)
    for key, (graph, graph_refs) in traced.items():
        path = save_graph(attach_weights(graph, graph_refs, stored, passes), out_dir / f"{key}.onnx")
        onnx.checker.check_model(str(path), full_check=True)
    dims = model_dims(model)
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = model.config.eos_token_id if eos is None else eos
    info = {
        "source": source,
        "model_type": model.config.model_type,
        "dims": dims.to_dict(),
        "graphs": graph_tokens,
        "weights": WEIGHTS_FILE,
        "context_length": cache_slots,  # the graphs' cache dimension
        "batch": batch,
        "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
    } | passes.info()
    (out_dir / EXPORT_INFO).write_text(json.dumps(info, indent=2))
    if tokenizer_dir is not None:
        tok_out = out_dir / "tokenizer"
        tok_out.mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, tok_out / name)
    return dims
