"""Builds the artifact folder: optimised fixed-shape graphs, shared weights, tokenizer, manifest.

Written into a temporary sibling folder and renamed into place only when complete, with the
manifest written last, so an interrupted build never leaves a folder that loads.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import onnx
import onnxruntime as ort
import torch
import transformers
from tqdm import tqdm

from common.graph_io import INITIALIZERS_FILE, KV_STORE_FILE, ModelDims
from common.manifest import MANIFEST_NAME, GraphEntry, Manifest, ModelEntry, sha256_file
from common.ngram_table import FILE as NGRAM_TABLE_FILE
from common.onnx_store import SharedFile, merge_external, read_tensor, save_graph, shared_file
from common.recipe import Recipe
from common.staging import MARKER, check_output, make_staging
from common.targets import Target, get_target, platform_signature, session_options
from compiler.costs import graph_costs_ms
from compiler.float16 import KV_DTYPE, to_float16
from compiler.greedy_outputs import add_greedy_outputs
from compiler.half_kv import half_kv_cache
from compiler.invariance import check_invariant, inline_attention, make_invariant
from compiler.kv_store import store_graph
from compiler.layouts import fold_layouts, tensor_shapes
from compiler.matmul_prologue import fuse_matmul_prologues
from compiler.mx_lowering import (
    ACCURACY_LEVEL,
    KERNEL_OPS,
    NATIVE_ACTIVATION_BITS,
    NATIVE_DOMAIN,
    NATIVE_SCALE_SUFFIX,
    Memo,
    lower_model,
)
from compiler.output_casts import drop_output_casts
from compiler.pack_matmuls import SEPARATOR, pack_matmuls
from compiler.rotary import fuse_rotary
from compiler.rotary_attention import fuse_rotary_attention
from compiler.skip_norm import fuse_skip_norms
from compiler.split_heads import fuse_split_heads
from compiler.swiglu import fuse_swiglu
from kernels import GPU_LOWERING, MX_MATMUL, MX_MATMUL_GPU, library_path

EXPORT_INFO = "export.json"


def _optimize(graph: Path, target: Target, workdir: Path) -> Path:
    """Run ONNX Runtime's graph optimisers once, now, and keep the result.

    Constant subgraphs (MX unpacking, float16 Casts) fold here, and on the CPU target the session
    also writes every weight's prepacked form beside it, so a loading session maps those blobs
    instead of repacking a private copy per graph. The weights only mxspd's kernels read are graph
    inputs meanwhile (`_lift`): ONNX Runtime has nothing to do with them, and would otherwise load
    each and write its own copy (a 7B model's 5.3 GB on disk beside the lowered weights).
    """
    model = onnx.load(str(graph), load_external_data=False)
    lifted = _lift(model, floats=not target.float16)
    if lifted:
        graph = save_graph(model, workdir / f"lifted-{graph.stem}.onnx")  # beside the lowered weights it names
    so = session_options()
    so.graph_optimization_level = target.offline_level
    out = workdir / f"opt-{graph.stem}.onnx"
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{out.stem}.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    if target.prepacked:
        so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
    if lifted:
        optimised = onnx.load(str(out), load_external_data=False)
        names = {t.name for t in lifted}
        inputs = [i for i in optimised.graph.input if i.name not in names]
        del optimised.graph.input[:]
        optimised.graph.input.extend(inputs)
        optimised.graph.initializer.extend(lifted)
        save_graph(optimised, out)
    return out


def _lift(model: onnx.ModelProto, floats: bool) -> list[onnx.TensorProto]:
    """Turn the external initializers that only mxspd's ops read (MX codes and scales; with `floats`,
    RowMatMul's float panels too: not where the float16 pass follows, which would convert them as
    inputs) into graph inputs of the same type and shape, in place; return them, to be put back."""
    readers = _readers(model.graph)
    outputs = {o.name for o in model.graph.output}
    float_types = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                   onnx.TensorProto.DOUBLE}
    lifted = [t for t in model.graph.initializer
              if t.data_location == onnx.TensorProto.EXTERNAL and _native_only(readers.get(t.name, set()))
              and t.name not in outputs and (floats or t.data_type not in float_types)]
    if lifted:
        names = {t.name for t in lifted}
        kept = [t for t in model.graph.initializer if t.name not in names]
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        model.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                 for t in lifted)
    return lifted


def _lower(export_dir: Path, name: str, lowering: str | None, invariant: bool, shared: SharedFile, memo: Memo,
           half_kv: bool = False) -> tuple[Path, dict[str, str], dict[str, list[int | None]]]:
    """Lower the MX ops of one graph for ONNX Runtime, weight by weight, and make it batch-invariant
    (or inline its attention), into the model's lowered weights file (shared by its graphs: equal
    tensors are stored once); returns the graph's path, the MX weights lowered and the exported
    graph's tensor shapes (the later passes' evidence that a pattern is what they fuse)."""
    model = onnx.load(str(export_dir / f"{name}.onnx"), load_external_data=False)
    exported = {t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    here = Path(shared.f.name)

    def read(t: onnx.TensorProto) -> bytes:  # exported weights, or ones this lowering has written
        shared.f.flush()
        located = {e.key: e.value for e in t.external_data}.get("location")
        return read_tensor(t, here.parent if located == shared.name else export_dir)

    shapes = tensor_shapes(model)
    if invariant:  # mxspd's kernels are there
        fuse_rotary(model, read, shapes)
        fold_layouts(model, shapes)

    def store(t: onnx.TensorProto) -> onnx.TensorProto:
        """The kernels' scales wait until every weight's codes are written: the codes of q, k and v (gate and
        up) then lie back to back in the file, and so do their scales, and packing them copies nothing."""
        return t if t.name.endswith(NATIVE_SCALE_SUFFIX) else shared.external(t)

    lowered = lower_model(model, lowering, read=read, store=store, memo=memo) if lowering else {}
    for t in [*model.graph.initializer, *memo.values()]:  # in the order they were made
        if t.name.endswith(NATIVE_SCALE_SUFFIX) and t.data_location != onnx.TensorProto.EXTERNAL:
            shared.store(t)
    if invariant:
        make_invariant(model, read=read, store=shared.external)
    else:
        model = inline_attention(model)
    pack_matmuls(model, read, shared.external, concat=shared.span)
    if invariant:
        fuse_split_heads(model, shapes)
        fuse_rotary_attention(model)
    if half_kv:
        half_kv_cache(model)
    for t in model.graph.initializer:  # weights the passes left alone (embeddings, norms)
        if t.name in exported:
            data = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, raw_data=read(t))
            t.CopyFrom(shared.external(data))
    shared.f.flush()
    return save_graph(model, here.parent / f"lowered-{name}.onnx"), lowered, shapes


SHARED_MIN_BYTES = 1 << 20  # weights; small constants (shapes, norms) may be planned on the host: left alone


def _shared(consumers: set[tuple[str, str]], length: int, target: Target) -> bool:
    """Whether the runtime hands each session one shared copy of this initializer (common/shared_weights.py).
    On the CPU (a view of one mapping of the weights file, in 2 MiB pages, all mapped at load) only where
    every op that reads it is mxspd's: a decode step reads those whole. ONNX Runtime prepacks its own ops'
    weights (MatMul, MatMulNBits) into blobs the artifact carries, and would repack a tensor it is handed
    into a private copy; a Gather reads a row of the embedding table per token, which its own mapping
    keeps in the pages those rows touch."""
    if not target.prepacked:
        return length >= SHARED_MIN_BYTES
    return _native_only(consumers)


def _readers(graph: onnx.GraphProto) -> dict[str, set[tuple[str, str]]]:
    """The (domain, op type) of the nodes that read each tensor."""
    readers: dict[str, set[tuple[str, str]]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add((node.domain, node.op_type))
    return readers


def _native_only(readers: set[tuple[str, str]]) -> bool:
    """Read, and only by mxspd's ops."""
    return bool(readers) and all(domain == NATIVE_DOMAIN for domain, _ in readers)


def _initializer_index(graph: Path, weights_name: str, target: Target) -> list[list]:
    """The graph's initializers in the model's weights file that its sessions share: [name, numpy dtype,
    dims, offset, length] (common/graph_io.py's INITIALIZERS_FILE)."""
    model = onnx.load(str(graph), load_external_data=False)
    consumers = _readers(model.graph)
    out = []
    for t in model.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        if info.get("location") == weights_name and _shared(consumers.get(t.name, set()), int(info["length"]), target):
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name
            out.append([t.name, dtype, list(t.dims), int(info.get("offset", 0)), int(info["length"])])
    return out


def effective_lowering(lowering: str, target: Target) -> str:
    """mxspd's native kernel where its library was built: MXMatMul on the CPU target, MXMatMulGPU (its CUDA
    kernel; the CPU library's reference runs the build's optimiser) on the GPU target; else `fused`, said aloud."""
    if lowering not in NATIVE_ACTIVATION_BITS:
        return lowering
    if library_path() is None:
        warnings.warn(f"MX lowering {lowering!r} (mxspd's native MX kernel) is unavailable: its library was not "
                      "built at install (no C++ compiler?); falling back to 'fused' (MatMulNBits: 8-bit codes and a "
                      "scale per block of 32)", stacklevel=2)
        return "fused"
    return GPU_LOWERING if target.device == "cuda" else lowering


def _check_lowered(graph: onnx.ModelProto, name: str, lowering: str, lowered: dict[str, str]) -> None:
    """Fused and native: every lowered weight must still run through its kernel, never full precision
    silently. (Exact folds to the MX values themselves in float32 at build time.)"""
    lost = []
    if lowering in KERNEL_OPS:
        domain, op, suffix = KERNEL_OPS[lowering]
        kept = {w for n in graph.graph.node if n.op_type == op and n.domain == domain
                for w in n.input[1].split(SEPARATOR)}  # packed weights name their members
        lost = [w for w in lowered if w + suffix not in kept]
    if lost or not lowered:
        raise RuntimeError(f"graph {name!r}: MX lowering {lowering!r} did not survive optimisation for "
                           f"{len(lost) or 'all'} weights (first: {lost[:3]})")


def effective_invariance(wanted: bool, target: Target) -> bool:
    """Batch-invariant graphs where mxspd's kernels run (built, CPU target); else not, said aloud."""
    if not wanted:
        return False
    why = ("its library was not built at install (no C++ compiler?)" if library_path() is None
           else f"they run on the CPU only, and the target is {target.name}" if not target.prepacked else None)
    if why is not None:
        warnings.warn(f"batch-invariant graphs need mxspd's kernels, and {why}: this artifact's speculation and "
                      "batching may differ from autoregressive decoding in the last bits (near-ties can flip)",
                      stacklevel=2)
    return why is None


def _compile_model(export_dir: Path, out_dir: Path, target: Target, lowering: str, invariant: bool, progress: bool,
                   consume_export: bool = False, kv_cache: str = "") -> ModelEntry:
    """`consume_export`: delete the export's weights file once every graph is lowered (its exports are
    temporary: the disk then holds the lowered weights and the artifact, not the export's too).
    `kv_cache`: the recipe's (common.recipe.KV_CACHES)."""
    info = json.loads((export_dir / EXPORT_INFO).read_text())
    quant = dict(info.get("quant", {}))
    lowering = effective_lowering(lowering, target) if quant else None
    invariant = effective_invariance(invariant, target)
    half_kv = kv_cache == "float16" and not target.float16
    if half_kv and not invariant:  # as the native lowering falls back to fused: said aloud, not refused
        warnings.warn('kv_cache = "float16" on the CPU needs mxspd\'s attention kernels (their library built at '
                      'install, and batch_invariant on): this artifact\'s KV cache is float32 (twice the memory)',
                      stacklevel=2)
        half_kv = False

    def optimized(work: Path, lowered_graphs: dict[str, tuple]) -> Iterator[tuple[str, Path]]:
        """Each lowered graph optimised in turn; its optimised copy goes once it is merged."""
        for name, (graph, lowered, shapes) in tqdm(lowered_graphs.items(), desc=f"compile {out_dir.name}",
                                                   disable=not progress):
            path = _optimize(graph, target, work)
            if target.float16:
                to_float16(path)
            optimised = onnx.load(str(path), load_external_data=False)
            changed = 0
            if not target.float16:  # fusions of the optimised graph: ONNX Runtime's CPU ops, and mxspd's
                changed = fuse_skip_norms(optimised, shapes) + drop_output_casts(optimised)
                if invariant:
                    changed += fuse_swiglu(optimised)
                    changed += fuse_matmul_prologues(optimised)
            if target.greedy_outputs:
                add_greedy_outputs(optimised)
                changed += 1
            if changed:
                save_graph(optimised, path)
            if quant:
                _check_lowered(optimised, name, lowering, lowered)
                quant["lowered_weights"] = len(lowered)  # the same weights in every graph
            if invariant:
                check_invariant(optimised, name)
            yield name, path
            for f in work.glob("opt-*"):
                f.unlink()

    with tempfile.TemporaryDirectory(dir=out_dir.parent) as work:
        # Every graph lowered first: its graphs share the exported weights, so each MX weight is lowered
        # once (`memo`), and then the export's weights file can go before the artifact's is written.
        with shared_file(Path(work) / "lowered.bin") as shared:
            memo: Memo = {}
            lowered_graphs = {name: _lower(export_dir, name, lowering, invariant, shared, memo, half_kv)
                              for name in tqdm(info["graphs"], desc=f"lower {out_dir.name}", disable=not progress)}
        if consume_export:
            (export_dir / info["weights"]).unlink()
        paths = merge_external(optimized(Path(work), lowered_graphs), out_dir, info["weights"])
    # one copy of the weights for all the graphs' sessions (on the CPU: one mapping, in 2 MiB pages)
    index = {g: _initializer_index(p, info["weights"], target) for g, p in paths.items()}
    (out_dir / INITIALIZERS_FILE).write_text(json.dumps(index))
    dims = ModelDims(**info["dims"] | ({"kv_dtype": KV_DTYPE} if target.float16 or half_kv else {}))
    onnx.save(store_graph(dims, info["context_length"]), str(out_dir / KV_STORE_FILE))
    if quant:
        quant["lowering"] = lowering
        bits = NATIVE_ACTIVATION_BITS.get(lowering)
        quant["kernel"] = {
            "fused": f"com.microsoft.MatMulNBits bits=8 block_size=32 accuracy_level={ACCURACY_LEVEL}",
            "exact": "float32 MatMul on the MX values",
            GPU_LOWERING: f"{NATIVE_DOMAIN}.{MX_MATMUL_GPU} (CUDA) 6-bit codes, float16 activations",
        }.get(lowering) or (f"{NATIVE_DOMAIN}.{MX_MATMUL} 4-bit codes with int8 activations per block of 32 "
                            f"(MXINT8 weights: int{bits})" if quant.get("format") == "fp4_e2m1"
                            else f"{NATIVE_DOMAIN}.{MX_MATMUL} 6-bit codes, activations int{bits} per block of 32")
    entry = ModelEntry(
        source=info["source"],
        model_type=info["model_type"],
        dims=dims,
        graphs={g: GraphEntry(file=f"{out_dir.name}/{g}.onnx", tokens=t) for g, t in info["graphs"].items()},
        weights=f"{out_dir.name}/{info['weights']}",
        dtype=info.get("storage_dtype", "float32"),
        quant=quant,
        eos_token_ids=tuple(info["eos_token_ids"]),
        batch_invariant=invariant,
    )
    costs = graph_costs_ms(out_dir.parent, entry, info["context_length"], target)  # run as the runtime runs them
    return replace(entry, graphs={g: replace(e, cost_ms=costs.get(g, 0.0)) for g, e in entry.graphs.items()})


def _tools() -> dict[str, str]:
    return {
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def compile_artifact(
    exports: dict[str, Path], recipe: Recipe, out_dir: Path, progress: bool = True, force: bool = False,
    ngram_table: Path | None = None, consume_exports: bool = False,
) -> Path:
    """Compile exported models ({"tlm": dir, "dlm": dir}) into the artifact folder out_dir, with
    prompt lookup's n-gram table file if given (checked against the TLM's tokenizer by the exporter).
    `consume_exports`: the exports are temporary; each model's weights file goes once it is lowered.

    An existing out_dir is replaced only if it is empty or one of our artifacts (or `force`).
    """
    target = get_target(recipe.target)  # resolved once; an unknown one is refused before anything is written
    start = time.perf_counter()
    check_output(Path(out_dir), force)  # before resolving: a symlink at --out is refused, not followed
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = make_staging(out_dir, "partial")
    try:
        specs = {"tlm": recipe.tlm, "dlm": recipe.dlm}
        models = {
            role: _compile_model(Path(d), staging / role, target, specs[role].mx_lowering,
                                 recipe.batch_invariant, progress, consume_exports, recipe.kv_cache)
            for role, d in exports.items()
        }
        shutil.copytree(Path(exports["tlm"]) / "tokenizer", staging / "tokenizer")
        if ngram_table is not None:
            shutil.copyfile(ngram_table, staging / NGRAM_TABLE_FILE)
        files = {
            str(p.relative_to(staging)): sha256_file(p)
            for p in sorted(staging.rglob("*")) if p.is_file() and p.name != MARKER
        }
        manifest = Manifest(
            name=recipe.name,
            target=recipe.target,
            context_length=recipe.context_length,
            kv_slots=recipe.capacity,
            prefill_chunk=recipe.prefill_chunk,
            k=recipe.k,
            batch_size=recipe.batch_size,
            models=models,
            tokenizer_dir="tokenizer",
            files=files,
            recipe=recipe.to_dict(),
            tools=_tools(),
            prepacked_for=platform_signature() if target.prepacked else {},
            build_seconds=round(time.perf_counter() - start, 2),
        )
        (staging / MANIFEST_NAME).write_text(manifest.to_json())
        check_output(out_dir, force)  # again: the user may have put files there meanwhile
        _replace_dir(staging, out_dir)
        (out_dir / MARKER).unlink()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Swap the finished staging folder into place; an old artifact is removed only afterwards."""
    old = None
    if out_dir.exists():
        old = make_staging(out_dir, "old")  # marked, so a kill right here leaves nothing unrecognised
        os.replace(out_dir, old / out_dir.name)
    os.replace(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
