"""Accuracy against bits per weight, as one PNG: a panel per `benchmarks.accuracy` report.

    python -m benchmarks.accuracy_plot REPORTS/RECIPE/accuracy.json [...] --out docs/accuracy_vs_bits.png

Each report is the accuracy.json that `python -m benchmarks.accuracy` wrote (one model on one held-out
text). A panel plots each build's mean KL divergence from float32 (log scale) against the bits per
weight it reads per token (every matrix a token reads, the head included), ours and llama.cpp's in
two colours, each point labelled: where a format sits between the others shows at a glance what its
bits buy. Rows without both figures are left out (builds that could not run; onnxruntime-genai's, whose
bits the report does not count), and so is each system's float32 reference.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.plot import panels, read_reports, save

FLOAT_REFERENCES = ("none", "fp32", "f32")  # a row's format: ours (none), onnxruntime-genai's, llama.cpp's


def points(report: dict) -> tuple[str, list[tuple[str, float, float, bool]]]:
    """(panel title, [(label, bits per weight, mean KL, ours)]) of one accuracy report."""
    meta = report["meta"]
    found = []
    for row in report["rows"]:
        bits, kl = row.get("bits_per_weight"), row.get("kl_mean")
        if bits is None or kl is None or str(row.get("format")).lower() in FLOAT_REFERENCES:
            continue  # unavailable builds, and float32 (ours and the peers') against itself
        ours = row.get("lowering") not in ("llama.cpp", "genai")
        found.append((row["name"].replace("llama.cpp ", ""), float(bits), float(kl), ours))
    return f"{meta['recipe']}: {meta['text']} ({meta['tokens']} tokens)", found


def plot(reports: list[dict], out: Path) -> Path:
    found_per_report = [points(r) for r in reports]
    fig, axes = panels(len(found_per_report), 10, 4.2)
    for ax, (title, found) in zip(axes, found_per_report, strict=True):
        for i, (label, bits, kl, ours) in enumerate(sorted(found, key=lambda p: p[2])):
            ax.scatter(bits, kl, color="tab:orange" if ours else "tab:blue", s=22, zorder=2)
            # neighbours' labels on alternate sides: the four-bit builds crowd one corner
            ax.annotate(label, (bits, kl), fontsize=6, xytext=(5, 3) if i % 2 else (-5, -8),
                        ha="left" if i % 2 else "right", textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight read per token")
        ax.set_ylabel("mean KL from float32 (nats)")
        ax.set_title(f"{title}\norange: mxspd, blue: llama.cpp", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.tick_params(labelsize=8)
    return save(fig, out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path, help="accuracy.json files of benchmarks.accuracy")
    ap.add_argument("--out", type=Path, default=Path("docs/accuracy_vs_bits.png"))
    args = ap.parse_args(argv)
    print(f"wrote {plot(read_reports(ap, args.reports, ('meta', 'rows')), args.out)}")


if __name__ == "__main__":
    main()
