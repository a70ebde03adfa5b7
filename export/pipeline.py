"""Recipe -> compiled artifact: resolve the models, trace their graphs, compile, write atomically."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel

from common.recipe import Recipe
from compiler import compile_artifact
from export.loader import load_model, resolve_model_dir
from export.onnx_export import export_model
from quant.onnx_pass import float16_export, quantize_export


class VocabularyMismatchError(ValueError):
    """A draft model whose tokens do not mean the same as the target's."""


def graph_plan(recipe: Recipe, role: str) -> dict[str, int]:
    """Which fixed-T graphs each model needs: the TLM scores K+1 tokens; the DLM catches up on 2."""
    if role == "tlm":
        return {"prefill": recipe.prefill_chunk, "decode": 1, "score": recipe.k + 1}
    return {"prefill": recipe.prefill_chunk, "decode": 1, "catchup": 2}


def check_same_vocabulary(tlm_dir: Path, dlm_dir: Path, tlm: PreTrainedModel, dlm: PreTrainedModel) -> None:
    if tlm.config.vocab_size != dlm.config.vocab_size:
        raise VocabularyMismatchError(
            f"TLM vocab_size {tlm.config.vocab_size} != DLM vocab_size {dlm.config.vocab_size}: "
            "speculative decoding needs both models to share one tokenizer"
        )
    t_vocab = AutoTokenizer.from_pretrained(tlm_dir, local_files_only=True).get_vocab()
    d_vocab = AutoTokenizer.from_pretrained(dlm_dir, local_files_only=True).get_vocab()
    if t_vocab != d_vocab:
        diff = sorted(set(t_vocab.items()) ^ set(d_vocab.items()))[:5]
        raise VocabularyMismatchError(
            f"TLM and DLM tokenizers differ ({len(t_vocab)} vs {len(d_vocab)} entries; "
            f"first differences: {diff}): speculative decoding needs one shared tokenizer"
        )


def build_artifact(
    recipe: Recipe,
    out_dir: Path,
    tlm: str | None = None,
    dlm: str | None = None,
    progress: bool = True,
) -> Path:
    """Export and compile a recipe; `tlm`/`dlm` override the recipe's model references."""
    if tlm is not None:
        recipe = replace(recipe, tlm=replace(recipe.tlm, model=tlm))
    if dlm is not None and recipe.dlm is not None:
        recipe = replace(recipe, dlm=replace(recipe.dlm, model=dlm))
    specs = {"tlm": recipe.tlm} | ({"dlm": recipe.dlm} if recipe.dlm is not None else {})
    dirs = {role: resolve_model_dir(spec.model, role.upper()) for role, spec in specs.items()}
    models = {role: load_model(d, recipe.context_length) for role, d in dirs.items()}
    if "dlm" in models:
        check_same_vocabulary(dirs["tlm"], dirs["dlm"], models["tlm"], models["dlm"])
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.export-", dir=out_dir.parent) as tmp:
        exports = {}
        for role, model in models.items():
            exports[role] = Path(tmp) / role
            export_model(
                model, exports[role], graph_plan(recipe, role), recipe.context_length,
                batch=recipe.batch_size, source=specs[role].model,
                tokenizer_dir=dirs[role], progress=progress,
            )
            spec = specs[role]
            if spec.mx_format is not None:
                quantize_export(exports[role], spec.mx_format, spec.mx_lm_head, progress=progress)
            if spec.dtype == "float16":
                float16_export(exports[role], progress=progress)
        return compile_artifact(exports, recipe, out_dir, progress=progress)
