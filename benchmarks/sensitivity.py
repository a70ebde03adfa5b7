"""Which weights MXFP6 costs most: each group of decoder linears' KL gain when kept in MXINT8, per byte.

    python -m benchmarks.sensitivity [--recipe smollm2-135m-chat] [--text FILE|pydoc:topics] [--tokens 1024]
                                     [--by kind|layer|tensor] [--base-int8 lm_head] [--out reports]

How a recipe's `mx_int8` list is chosen (docs/benchmarks-history.md, Accuracy). transformers' float32
model of the recipe's TLM (streamed from its checkpoint or GGUF as the exporter reads it) scores the
first --tokens tokens of a calibration text; then the same model with its linears fake-quantized by the
project's quantizer as the quant pass would store them: the recipe's format, exponent choice and rounding
(with error feedback over its `mx_calibration` text where it names one), MXINT8 for the weights named by
--base-int8 (fragments, as `mx_int8`; the LM head by default), the LM head float32 unless named there or
the recipe says `mx_lm_head = "format"`. That base's mean KL divergence from float32 (nats per token) and
top-1 agreement are the reference; then each group (a kind of linear over all layers, a layer's linears,
or one tensor) goes to MXINT8 alone, and its KL gain, extra bytes (8 bits per weight less the format's: 2
for MXFP6, 4 for MXFP4) and gain per extra MB are printed, best first, and written to
OUT/RECIPE/sensitivity.json. Default text: the Apache-2.0 licence Debian ships, which benchmarks.accuracy
does not evaluate on (but which smollm2-135m-chat's calibration text begins with: score such a recipe on
another --text). Deterministic: one run. """

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedModel

from benchmarks.accuracy import held_out_texts
from export.calibration import calibrate, float_model
from export.loader import resolve_model_dir
from export.onnx_export import short_name
from quant import element_values, fake_quantize
from quant.error_feedback import feedback_factor, quantize_with_feedback
from quant.onnx_pass import MXPass, selected
from recipes import DEFAULT_RECIPE, get_recipe

CALIBRATION = Path("/usr/share/common-licenses/Apache-2.0")
GROUPINGS = ("kind", "layer", "tensor")
_LAYER = re.compile(r"^(?:layers|h)\.(\d+)\.")


def linears(model: PreTrainedModel, lm_head: bool) -> dict[str, torch.nn.Linear]:
    """The weights the quant pass stores in MX formats, by the graphs' weight names
    (`layers.0.mlp.up_proj.weight.T`): decoder linears, and the LM head where the recipe quantizes it."""
    out = {}
    for name, m in model.named_modules():
        weight = short_name(name) + ".weight.T"
        if isinstance(m, torch.nn.Linear) and selected(weight, lm_head):
            out[weight] = m
    return out


def group_of(name: str, by: str) -> str:
    if by == "tensor":
        return name.removesuffix(".weight.T")
    if by == "layer":
        return f"layers.{_LAYER.match(name).group(1)}."
    return name.removesuffix(".weight.T").rsplit(".", 1)[-1]  # q_proj, k_proj, ..., down_proj


class Scorer:
    """Float32's next-token distribution once; then any weight assignment's KL and top-1 agreement with it."""

    def __init__(self, model: PreTrainedModel, tokens: torch.Tensor) -> None:
        self.model, self.tokens = model, tokens
        self.log_p = self._log_probs()
        self.p, self.top1 = self.log_p.exp(), self.log_p.argmax(-1)

    def _log_probs(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.model(self.tokens[None]).logits[0].double(), -1)

    def score(self) -> tuple[float, float]:
        """Mean KL(float32 || now) in nats per token, and the share of tokens whose argmax agrees."""
        q = self._log_probs()
        kl = (self.p * (self.log_p - q)).sum(-1)
        return float(kl.mean()), float((q.argmax(-1) == self.top1).double().mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=DEFAULT_RECIPE)
    ap.add_argument("--text", type=Path, default=CALIBRATION, help="calibration text file, or pydoc:topics")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--by", choices=GROUPINGS, default="kind", help="what goes to MXINT8 together")
    ap.add_argument("--base-int8", default="lm_head", help="comma-separated name fragments in MXINT8 in every "
                    "run, as a recipe's mx_int8 ('' for none)")
    ap.add_argument("--out", type=Path, default=Path("reports"))
    args = ap.parse_args(argv)
    if args.tokens < 2:
        ap.error("--tokens must be at least 2")
    recipe = get_recipe(args.recipe)
    if recipe.tlm.mx_format is None:
        ap.error(f"recipe {recipe.name!r} keeps its TLM in {recipe.tlm.dtype}: no MX format to weigh MXINT8 against")
    try:
        text = "\n\n".join(held_out_texts(args.text))
    except OSError:
        ap.error(f"no calibration text at {args.text}: pass --text FILE, or pydoc:topics (shipped with Python)")
    base_int8 = tuple(f for f in args.base_int8.split(",") if f)
    quant = MXPass(recipe.tlm.mx_format, recipe.tlm.mx_lm_head == "format", scale=recipe.tlm.mx_scale, int8=base_int8)
    t0 = time.perf_counter()
    model_dir = resolve_model_dir(recipe.tlm.model, "tlm")
    model = float_model(model_dir, recipe.context_length)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
    scorer = Scorer(model, torch.tensor(ids))
    mods = linears(model, quant.lm_head)
    if not any(_LAYER.match(name) for name in mods):
        ap.error(f"no decoder linears found in {recipe.tlm.model} (layers.N. or h.N. weights)")
    base = {name for name in mods if quant.format_of(name) == "int8"}
    if unused := [f for f in base_int8 if ("int8", f) not in quant.matched]:
        ap.error(f"--base-int8 fragment(s) {unused} match no quantized weight (e.g. {sorted(mods)[:2]})")

    spec = recipe.tlm
    hessians = (calibrate(spec.mx_calibration, spec.mx_calibration_tokens, model_dir, recipe.context_length,
                          lambda name: name in mods, progress=False, model=model)[0] if spec.mx_calibration else {})
    factors = {id(h): feedback_factor(h) for h in hessians.values()}

    def quantized(name: str, m: torch.nn.Linear, fmt: str) -> torch.Tensor:  # as the quant pass stores it
        w = m.weight.detach().numpy()  # [out, in]: blocks run along `in` (K), the graph's W^T [K, out]
        if name in hessians:
            order, u = factors[id(hessians[name])]
            return torch.from_numpy(quantize_with_feedback(w.T, u, fmt, spec.mx_scale, order=order).T.copy())
        return torch.from_numpy(fake_quantize(w, fmt, axis=1, scale=spec.mx_scale))

    numel = {name: m.weight.numel() for name, m in mods.items()}
    extra_bits = 8 - np.log2(len(element_values(spec.mx_format)))  # MXINT8's element bits less the format's
    stored = {name: quantized(name, m, "int8" if name in base else spec.mx_format) for name, m in mods.items()}
    int8 = {name: quantized(name, m, "int8") for name, m in mods.items() if name not in base and _LAYER.match(name)}

    def assign(in_int8: set[str]) -> None:
        with torch.no_grad():
            for name, m in mods.items():
                m.weight.copy_(int8[name] if name in in_int8 else stored[name])

    assign(set())
    base_kl, base_top1 = scorer.score()
    groups: dict[str, list[str]] = {}
    for name in int8:
        groups.setdefault(group_of(name, args.by), []).append(name)
    rows = []
    for key, names in groups.items():
        assign(set(names))
        kl, top1 = scorer.score()
        extra_mb = sum(numel[n] for n in names) * extra_bits / 8 / 1e6
        rows.append({"group": key, "tensors": len(names), "kl": round(kl, 5), "kl_gain": round(base_kl - kl, 5),
                     "top1": round(top1, 4), "extra_MB": round(extra_mb, 3),
                     "gain_per_MB": round((base_kl - kl) / extra_mb, 5)})
    rows.sort(key=lambda r: -r["gain_per_MB"])
    fmt = recipe.tlm.mx_format
    report = {"recipe": recipe.name, "text": str(args.text), "tokens": len(ids), "format": fmt,
              "scale": spec.mx_scale, "calibration": spec.mx_calibration,
              "lm_head": "int8" if "lm_head.weight.T" in base else (fmt if quant.lm_head else "float32"),
              "base_int8": list(base_int8), "base_kl": round(base_kl, 5),
              "base_top1": round(base_top1, 4), "by": args.by, "seconds": round(time.perf_counter() - t0, 1),
              "rows": rows}
    out = args.out / recipe.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "sensitivity.json").write_text(json.dumps(report, indent=2))
    print(f"{recipe.name}: {len(ids)} tokens of {args.text}; base ({fmt}, {recipe.tlm.mx_scale}; LM head "
          f"{report['lm_head']}; MXINT8: {list(base_int8)}) KL {base_kl:.5f} nats/token, top-1 {base_top1:.2%}")
    print(f"{'group':<24}{'tensors':>8}{'KL gain':>10}{'top-1':>9}{'extra MB':>10}{'gain/MB':>10}")
    for r in rows:
        print(f"{r['group']:<24}{r['tensors']:>8}{r['kl_gain']:>10.5f}{r['top1']:>9.2%}{r['extra_MB']:>10.3f}"
              f"{r['gain_per_MB']:>10.5f}")
    print(f"written to {out / 'sensitivity.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
