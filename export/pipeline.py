"""Recipe -> compiled artifact: resolve the models, trace their graphs, compile, write atomically."""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel

from common import graph_io
from common.ngram_table import NgramTable, NgramTableError
from common.recipe import ModelSpec, Recipe
from common.staging import check_output, clean_stale, make_staging
from compiler.build import compile_artifact
from export.calibration import calibrate
from export.fit import check_export_fits
from export.loader import placeholder_model, resolve_model_dir, resolve_ngram_table
from export.onnx_export import export_model
from export.weights import checkpoint_tensors
from quant.onnx_pass import Float16Pass, MXPass, PassChain, selected

log = logging.getLogger("mxspd.export")


class VocabularyMismatchError(ValueError):
    """A draft model whose tokens do not mean the same as the target's."""


# A serving build's step graphs: 10-40 running requests' rows in one call of about their number, not padded
# to the prefill chunk (a fixed-shape call computes every row it has room for).
SERVING_ROWS = (16, 32)


def graph_plan(recipe: Recipe, role: str) -> dict[str, int]:
    """Which fixed-T graphs each model needs (graphs share their weights, so they cost no memory).

    The TLM scores k+1 tokens for each compiled draft length k, up to the larger of the draft
    model's k and prompt lookup's max_draft, and has a lookahead graph for the recipe's lookahead
    settings (unless a graph of that T exists already); a serving build (kv_slots for two sequences
    or more) has graphs of SERVING_ROWS rows below the prefill chunk too. The DLM catches up on 2.
    """
    if role == "tlm":
        k_max = max(recipe.k, recipe.prompt_lookup.max_draft)
        plan = {graph_io.PREFILL: recipe.prefill_chunk, graph_io.PREFILL_LAST: recipe.prefill_chunk, graph_io.DECODE: 1}
        plan |= {graph_io.score_graph(k): k + 1 for k in graph_io.draft_lengths(k_max)}
        if recipe.capacity >= 2 * recipe.context_length:
            plan |= {graph_io.batch_graph(t): t for t in SERVING_ROWS
                     if t < recipe.prefill_chunk and t not in plan.values()}
        la = recipe.lookahead
        t = graph_io.lookahead_tokens(la.ngram, la.window, la.guesses)
        return plan if t in plan.values() else plan | {graph_io.LOOKAHEAD: t}
    return {graph_io.PREFILL: recipe.prefill_chunk, graph_io.PREFILL_LAST: recipe.prefill_chunk, graph_io.DECODE: 1,
            graph_io.CATCHUP: 2}


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


def weight_passes(spec: ModelSpec, model_dir: Path, context_length: int, progress: bool = True) -> PassChain:
    """How a model's weights are stored: MX blocks for its decoder linears (rounded with error feedback
    if the recipe names a calibration text), then float16 if asked."""
    passes = []
    if spec.mx_format is not None:
        mx = MXPass(spec.mx_format, spec.mx_head, scale=spec.mx_scale, int8=spec.mx_int8_fragments,
                    fp6=spec.mx_fp6_fragments, embedding=spec.mx_table)
        if spec.mx_calibration:
            mx.hessians, mx.calibration = calibrate(spec.mx_calibration, spec.mx_calibration_tokens, model_dir,
                                                    context_length, lambda name: selected(name, mx.lm_head), progress)
        passes.append(mx)
    return PassChain(passes + ([Float16Pass()] if spec.dtype == "float16" else []))


def _checked_table(table: NgramTable, file: Path, tokenizer_dir: Path, vocab_size: int,
                   optional: bool) -> Path | None:
    """The table file to ship: refused if counted with another tokenizer, or left out when `optional`."""
    try:
        table.check_vocabulary(tokenizer_dir, vocab_size, "the TLM")
    except NgramTableError:
        if not optional:
            raise
        log.warning("note: the recipe's n-gram table %s was counted with another tokenizer than this TLM's; "
                    "exporting without it (prompt lookup drafts from the prompt only)", file.name)
        return None
    return file


def build_artifact(
    recipe: Recipe,
    out_dir: Path,
    tlm: str | None = None,
    dlm: str | None = None,
    progress: bool = True,
    force: bool = False,
    ngram_table: str | None = None,
) -> Path:
    """Export and compile a recipe; `tlm`/`dlm`/`ngram_table` override the recipe's references.

    A `dlm` given for a recipe without a draft model becomes its draft model (float32). The recipe's
    n-gram table was counted for the recipe's TLM: with another `tlm` whose tokenizer differs, the
    artifact ships without it (an optimisation nobody asked for), saying so; a table named here or
    in a recipe whose TLM is kept is refused instead. An existing out_dir is replaced only if it is
    empty or one of our artifacts, unless `force`.
    """
    table_optional = ngram_table is None and tlm is not None
    ngram_table = recipe.ngram_table if ngram_table is None else ngram_table
    check_output(Path(out_dir), force)  # before resolving: a symlink at --out is refused, not followed
    out_dir = Path(out_dir).resolve()
    if tlm is not None:
        recipe = replace(recipe, tlm=replace(recipe.tlm, model=tlm))
    if dlm is not None:
        if recipe.dlm is None:
            log.info("recipe %s has no draft model: adding %s as its DLM (float32)", recipe.name, dlm)
        recipe = replace(recipe, dlm=replace(recipe.dlm or ModelSpec(model=dlm), model=dlm))
    specs = {"tlm": recipe.tlm} | ({"dlm": recipe.dlm} if recipe.dlm is not None else {})
    dirs = {role: resolve_model_dir(spec.model, role.upper()) for role, spec in specs.items()}
    table_file = resolve_ngram_table(ngram_table) if ngram_table else None
    table = NgramTable.load(table_file) if table_file else None  # a damaged file is refused before exporting
    check_export_fits(dirs, specs, out_dir, recipe.context_length)
    models = {role: placeholder_model(d, recipe.context_length) for role, d in dirs.items()}
    if "dlm" in models:
        check_same_vocabulary(dirs["tlm"], dirs["dlm"], models["tlm"], models["dlm"])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for folder in clean_stale(out_dir):
        log.info("removed %s, left by an interrupted export", folder)
    tmp = make_staging(out_dir, "export")
    try:
        exports = {}
        for role, model in models.items():
            exports[role] = Path(tmp) / role
            passes = weight_passes(specs[role], dirs[role], recipe.context_length, progress)
            export_model(
                model, checkpoint_tensors(dirs[role]), exports[role], graph_plan(recipe, role),
                recipe.capacity, batch=recipe.batch_size, source=specs[role].model,
                tokenizer_dir=dirs[role], passes=passes, role=role, progress=progress,
            )
            if role == "tlm" and table is not None:
                table_file = _checked_table(table, table_file, exports[role] / "tokenizer",
                                            model.config.vocab_size, table_optional)
        return compile_artifact(exports, recipe, out_dir, progress=progress, force=force, ngram_table=table_file,
                                consume_exports=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
