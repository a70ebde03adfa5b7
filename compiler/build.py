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
from pathlib import Path

import onnx
import onnxruntime as ort
import torch
import transformers
from tqdm import tqdm

from common.graph_io import ModelDims
from common.manifest import MANIFEST_NAME, GraphEntry, Manifest, ModelEntry, sha256_file
from common.onnx_store import save_shared
from common.recipe import Recipe
from compiler.targets import OFFLINE_LEVEL, PROVIDERS, session_options

EXPORT_INFO = "export.json"


def _optimize(graph: Path, target: str, workdir: Path) -> onnx.ModelProto:
    """Run ONNX Runtime's graph optimisers once, now, and keep the result."""
    so = session_options()
    so.graph_optimization_level = OFFLINE_LEVEL[target]
    out = workdir / f"opt-{graph.stem}.onnx"
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{out.stem}.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
    return onnx.load(str(out), load_external_data=True)


def _compile_model(export_dir: Path, out_dir: Path, target: str, progress: bool) -> ModelEntry:
    info = json.loads((export_dir / EXPORT_INFO).read_text())
    graphs: dict[str, onnx.ModelProto] = {}
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as work:
        items = tqdm(info["graphs"], desc=f"compile {out_dir.name}", disable=not progress)
        for name in items:
            graphs[name] = _optimize(export_dir / f"{name}.onnx", target, Path(work))
        save_shared(graphs, out_dir, info["weights"])
    return ModelEntry(
        source=info["source"],
        model_type=info["model_type"],
        dims=ModelDims(**info["dims"]),
        graphs={g: GraphEntry(file=f"{out_dir.name}/{g}.onnx", tokens=t) for g, t in info["graphs"].items()},
        weights=f"{out_dir.name}/{info['weights']}",
        quant=info.get("quant", {}),
        eos_token_ids=tuple(info["eos_token_ids"]),
    )


def _tools() -> dict[str, str]:
    return {
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def compile_artifact(
    exports: dict[str, Path], recipe: Recipe, out_dir: Path, progress: bool = True
) -> Path:
    """Compile exported models ({"tlm": dir, "dlm": dir}) into the artifact folder out_dir."""
    if recipe.target not in PROVIDERS:
        raise ValueError(f"unknown target {recipe.target!r}; choose one of {sorted(PROVIDERS)}")
    start = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        models = {
            role: _compile_model(Path(d), staging / role, recipe.target, progress)
            for role, d in exports.items()
        }
        shutil.copytree(Path(exports["tlm"]) / "tokenizer", staging / "tokenizer")
        files = {
            str(p.relative_to(staging)): sha256_file(p)
            for p in sorted(staging.rglob("*")) if p.is_file()
        }
        manifest = Manifest(
            name=recipe.name,
            target=recipe.target,
            context_length=recipe.context_length,
            prefill_chunk=recipe.prefill_chunk,
            k=recipe.k,
            batch_size=recipe.batch_size,
            models=models,
            tokenizer_dir="tokenizer",
            files=files,
            recipe=recipe.to_dict(),
            tools=_tools(),
            build_seconds=round(time.perf_counter() - start, 2),
        )
        (staging / MANIFEST_NAME).write_text(manifest.to_json())
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Swap the finished staging folder into place; an old artifact is removed only afterwards."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(staging, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
