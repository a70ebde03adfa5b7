"""Decode tokens/s against the peers, as one PNG: a group of bars per benchmark report.

    python -m benchmarks.plot REPORT.json [REPORT.json ...] --out docs/tokens_per_s.png

Each report is what `python -m benchmarks.vs_llamacpp` printed (per system: its median decode tokens/s;
llama.cpp's formats, onnxruntime-genai's builds and our engines) or `python -m benchmarks.serve_peers
--json` wrote (per server: output tokens/s at each closed-loop client count). A group is labelled with
its report's model (recipe or checkpoint) and CPU; bars are labelled with their tokens/s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(report: dict) -> tuple[str, dict[str, float]]:
    """(group label, {bar label: tokens/s}) of one report."""
    cpu = report.get("cpu", "")
    if "servers" in report:  # serve_peers --json
        bars = {f"{server} {clients}c": tps for server, rows in report["servers"].items()
                for clients, tps in rows.items()}
        return f"serving {report['model']}\n{cpu}", bars
    name = Path(report.get("checkpoint") or report["recipe"]).name
    bars = {system.replace("llama.cpp:", "llama.cpp ").replace("ours:", "mxspd ").replace("genai:", "genai "):
            v["median"] for system, v in report["systems"].items()}
    return f"decode {name}, {report['prompt_tokens'][0]}-token prompt\n{cpu}", bars


def panels(count: int, width: float, height: float) -> tuple:
    """A headless figure of `count` panels stacked (each `height` inches high) and their axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(count, 1, figsize=(width, height * count), squeeze=False)
    return fig, axes[:, 0]


def save(fig, out: Path) -> Path:
    """Writes the figure as a PNG at `out` and frees it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def read_reports(ap: argparse.ArgumentParser, paths: list[Path], needs: tuple[str, ...] = ()) -> list[dict]:
    """The JSON reports at `paths`; a clear parser error for one that is unreadable or lacks a key of `needs`."""
    reports = []
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            ap.error(f"{path}: not a readable JSON report: {exc}")
        if needs and not (isinstance(report, dict) and all(k in report for k in needs)):
            ap.error(f"{path}: not the report expected here (it lacks {', '.join(needs)})")
        reports.append(report)
    return reports


def plot(reports: list[dict], out: Path) -> Path:
    groups = [series(r) for r in reports]
    fig, axes = panels(len(groups), 9, 2.6)
    for ax, (label, bars) in zip(axes, groups, strict=True):
        names, values = list(bars), list(bars.values())
        colours = ["tab:orange" if n.startswith("mxspd") else "tab:blue" for n in names]
        drawn = ax.barh(names, values, color=colours)
        ax.bar_label(drawn, fmt="%.1f", padding=2, fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("tokens/s")
        ax.invert_yaxis()
        ax.tick_params(labelsize=8)
    return save(fig, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path, help="JSON reports of vs_llamacpp or serve_peers --json")
    ap.add_argument("--out", type=Path, default=Path("docs/tokens_per_s.png"))
    args = ap.parse_args()
    reports = read_reports(ap, args.reports)
    for path, report in zip(args.reports, reports, strict=True):
        if not isinstance(report, dict) or not ({"systems", "servers"} & report.keys()):
            ap.error(f"{path}: not a report of vs_llamacpp or serve_peers --json (no systems or servers)")
    print(f"wrote {plot(reports, args.out)}")


if __name__ == "__main__":
    main()
