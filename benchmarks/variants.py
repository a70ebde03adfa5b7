"""Artifacts of one recipe with a different TLM precision, built once and reused while unchanged;
and a copy of an artifact without its stored prepacked weights, to measure what they buy."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tokenize
from dataclasses import fields, replace
from pathlib import Path

import onnx

from common.graph_io import INITIALIZERS_FILE
from common.manifest import FORMAT_VERSION, MANIFEST_NAME, read_manifest, sha256_file
from common.ngram_table import FILE as NGRAM_TABLE_FILE
from common.recipe import Recipe, with_mx_format
from common.targets import platform_signature
from export.loader import resolve_calibration_text, resolve_ngram_table
from export.pipeline import build_artifact


def variant(recipe: Recipe, mx_format: str | None, lowering: str | None = "fused", with_dlm: bool = True,
            scale: str | None = None) -> Recipe:
    """The recipe with its TLM in fp32 (mx_format None) or MX, and with or without its DLM; `lowering` None
    and `scale` None keep the recipe's own MX lowering and block exponent choice."""
    tlm = replace(with_mx_format(recipe.tlm, mx_format), mx_lowering=lowering or recipe.tlm.mx_lowering,
                  mx_scale=scale or recipe.tlm.mx_scale)
    dlm = recipe.dlm if with_dlm else None
    return replace(recipe, tlm=tlm, dlm=dlm, speculative=recipe.speculative and dlm is not None)


def with_settings(recipe: Recipe, settings: dict) -> Recipe:
    """`settings` applied: the recipe's own keys (kv_cache) to the recipe, the others to its TLM."""
    own = {k: v for k, v in settings.items() if k in {f.name for f in fields(Recipe)}}
    return replace(recipe, tlm=replace(recipe.tlm, **{k: v for k, v in settings.items() if k not in own}), **own)


REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_CODE = ("common", "export", "quant", "compiler", "kernels")  # the packages whose code writes an artifact


# C++ comments, and the string and character literals a comment marker may sit in (kept as they are)
_CPP_COMMENT = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)


def _code(f: Path) -> bytes:
    """A source file without its comments and blank lines: what an edit of the notes alone leaves the same
    (so it does not force a rebuild of every cached benchmark artifact). Docstrings count: Python keeps them."""
    text = f.read_text()
    if f.suffix == ".py":
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        return repr([(t.type, "" if t.type == tokenize.NEWLINE else t.string)  # "\n", or "" at the end
                     for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL)]).encode()
    code = _CPP_COMMENT.sub(lambda m: m.group() if m.group()[0] in "\"'" else " ", text)
    return "\n".join(line.rstrip() for line in code.splitlines() if line.strip()).encode()


def build_code_digest(root: Path = REPO_ROOT) -> str:
    """A digest of the code of the stages that write an artifact: a cached build made by other code (a
    quantizer fix changes the bytes, not the format version) is not reused. The kernels' C++ counts too:
    the compiler times each graph with them, and the runtime's speculation policy reads those costs."""
    digest = hashlib.sha256()
    for package in BUILD_CODE:
        for f in sorted(f for f in (root / package).rglob("*") if f.suffix in (".py", ".cc", ".h")):
            digest.update(f.relative_to(root).as_posix().encode() + b"\0" + _code(f) + b"\0")
    return digest.hexdigest()[:16]


def build_cached(recipe: Recipe, out_dir: Path, progress: bool = True) -> Path:
    """Build `recipe` into out_dir unless an artifact of exactly this recipe, format, platform, n-gram
    table, calibration text and build code is there (the code's digest in a file beside it)."""
    manifest = Path(out_dir) / MANIFEST_NAME
    code, digest = Path(out_dir).parent / f"{Path(out_dir).name}.build-code", build_code_digest()
    if manifest.is_file() and code.is_file() and code.read_text() == digest:
        data = json.loads(manifest.read_text())
        table = sha256_file(resolve_ngram_table(recipe.ngram_table)) if recipe.ngram_table else None
        text = recipe.tlm.mx_calibration and sha256_file(resolve_calibration_text(recipe.tlm.mx_calibration))[:16]
        calibrated = data.get("models", {}).get("tlm", {}).get("quant", {}).get("calibration", "")
        if (data.get("recipe") == json.loads(json.dumps(recipe.to_dict()))
                and (not text or f"(sha256 {text})" in calibrated)
                and data.get("format_version") == FORMAT_VERSION
                and data.get("prepacked_for") in ({}, platform_signature())
                and data.get("files", {}).get(NGRAM_TABLE_FILE) == table):
            return Path(out_dir)
    built = build_artifact(recipe, Path(out_dir), progress=progress)
    code.write_text(digest)
    return built


def _graph_files(art_dir: Path) -> list[Path]:
    m = read_manifest(art_dir, verify=False)
    return [art_dir / g.file for entry in m.models.values() for g in entry.graphs.values()]


def prepacked_bytes(art_dir: Path, role: str) -> int:
    """Bytes of one model's distinct prepacked blobs plus its weights that have none (one copy in use)."""
    blobs: dict[str, int] = {}
    for path in _graph_files(art_dir):
        if path.parent.name != role:
            continue
        for t in onnx.load(str(path), load_external_data=False).graph.initializer:
            info = {e.key: e.value for e in t.external_data}
            packed = [v for k, v in info.items() if k.startswith("prepacked")]
            for v in packed or [f"raw|{info.get('offset')};{info.get('length', 0)};0"] * bool(info):
                blobs[v.split("|")[1]] = int(v.split("|")[1].split(";")[1])
    return sum(blobs.values())


def small_pages_copy(art_dir: Path, out_dir: Path) -> Path:
    """A copy of the artifact as it loaded before the initializer index: each session maps its own weights
    (ONNX Runtime's 4 KiB-page maps, one per tensor), from weights files written in 64 KiB pieces, as a
    build writes them, so cached in small folios (graphs hard-linked; load it with verify=False)."""
    shutil.copytree(art_dir, out_dir, copy_function=os.link)
    for index in out_dir.rglob(INITIALIZERS_FILE):
        index.unlink()
    for weights in out_dir.rglob("weights.bin"):
        weights.unlink()  # a hard link: replace, never write through to the original
        with open(art_dir / weights.relative_to(out_dir), "rb") as src, open(weights, "wb") as dst:
            while piece := src.read(1 << 16):
                dst.write(piece)
            dst.flush()
            os.fsync(dst.fileno())
    return out_dir


def heap_prepacked_copy(art_dir: Path, out_dir: Path) -> Path:
    """A copy of the artifact whose graphs do not reference their prepacked blobs, so ONNX Runtime
    prepacks a private copy per session (weights files hard-linked; load it with verify=False)."""
    shutil.copytree(art_dir, out_dir, copy_function=os.link)
    for path in _graph_files(out_dir):
        model = onnx.load(str(path), load_external_data=False)
        for t in model.graph.initializer:
            keep = [(e.key, e.value) for e in t.external_data if not e.key.startswith("prepacked")]
            del t.external_data[:]
            for k, v in keep:
                entry = t.external_data.add()
                entry.key, entry.value = k, v
        path.unlink()  # a hard link: replace, never write through to the original
        path.write_bytes(model.SerializeToString())
    return out_dir
