"""The docs stay true to the code: every command they show answers `--help`, every relative link
resolves, and the project's modules import each other in one direction only (no cycles)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "export", "quant", "compiler", "runtime", "serve", "recipes", "kernels", "benchmarks")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def shown_modules() -> list[str]:
    """Every project module the README and docs run as `python -m MODULE`."""
    found = {m for doc in DOCS for m in re.findall(r"python -m ([A-Za-z_][\w.]*)", doc.read_text())}
    return sorted(m for m in found if m.split(".")[0] in PACKAGES)


# Runs each module as `python -m MODULE --help` would, in one process (the imports they share are paid once),
# and prints the modules whose help did not exit 0, with why.
HELP_ALL = """
import contextlib, io, json, runpy, sys
failed = {}
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        failed[module] = "returned without exiting: no --help?"
    except SystemExit as e:
        if e.code not in (0, None):
            failed[module] = f"exit {e.code}: {out.getvalue()[-300:]}"
    except BaseException as e:
        failed[module] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
"""


def test_every_shown_command_answers_help():
    modules = shown_modules()
    assert len(modules) >= 5, "the docs name the project's commands"
    out = subprocess.run([sys.executable, "-c", HELP_ALL, *modules], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_a_command_without_help_is_caught():
    """Negative control: a module that reads its argument by hand (as benchmarks.memory once did) fails."""
    out = subprocess.run([sys.executable, "-c", HELP_ALL, "json.tool", "this_module_does_not_exist"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert set(json.loads(out.stdout.strip().splitlines()[-1])) == {"this_module_does_not_exist"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in doc.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_relative_link_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert not broken, f"{doc.name}: {broken}"


def module_imports() -> dict[str, set[str]]:
    """Each project module and the project modules it imports, at the top or inside a function."""
    modules = {}
    for package in PACKAGES:
        for f in (ROOT / package).rglob("*.py"):
            modules[".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = f
    graph = {}
    for name, f in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names}
        graph[name] = deps - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle():
    """Negative control: a cycle through a late (in-function) import is found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = module_imports()
    assert "runtime.speculative" in graph["runtime.load"]  # the graph sees the project's imports
    assert cycles(graph) == []
