"""The import graph of megapipe/ and stages/ (DESIGN.md, Round 3): no circles, and no import runs up the layers.

Every import of megapipe's own modules counts, those inside functions too: ``from megapipe.x import y`` imports the
file of ``y`` when ``y`` is a submodule, else the file of ``megapipe.x``; importing a package imports its
``__init__.py``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megapipe", "stages")

# The layers, bottom to top, by part: a sub-package or top-level module of megapipe, "megapipe" for its __init__.py,
# "stages" for stages/. A module imports its own layer and those below it.
LAYERS = [
    {"megapipe", "errors", "dtypes", "fileio", "omp", "plot", "torch_compat"},  # leaf helpers: exceptions, dtypes, files,
    # OpenMP's wait policy, plots, the private torch APIs
    {"config", "presets"},  # the run configuration and its model presets
    {"data"},  # tokenizers, corpora, datasets, loaders, the chat-template renderer
    {"models"},  # block kinds, LoRA surgery, the loss contract
    {"parallel"},  # process groups, the TP/PP/DP/EP/CP layouts, the train step
    {"checkpoint"},  # storage, HF/TRT/peft writers, quantizer state, the ready-model loader
    {"inference"},  # the engine core and the server front end
    {"posttrain", "eval", "pipeline"},  # post-training methods, evaluation, YAML pipelines
    {"training"},  # the training loop and its recipes
    {"cli"},  # the megapipe command's table
    {"stages"},  # the command functions
]
APART = {"posttrain", "eval", "pipeline"}  # share a layer, but none imports another
UPWARD = {("cli", "stages")}  # the one import that runs up: the CLI loading its commands


class Import(NamedTuple):
    source: str  # file, relative to ROOT
    line: int
    target: str  # file, relative to ROOT


def module_files() -> dict[str, str]:
    """Dotted module name -> file, for every module of PACKAGES."""
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = str(path.relative_to(ROOT))
    return files


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[list[str]]:
    """For each name the statement imports: the dotted names it may be, most specific first."""
    if isinstance(node, ast.Import):
        return [[alias.name] for alias in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
    return [[f"{base}.{alias.name}", base] for alias in node.names]


@functools.cache
def import_graph() -> tuple[Import, ...]:
    files = module_files()
    imports = []
    for module, file in files.items():
        tree = ast.parse((ROOT / file).read_text(), filename=file)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for candidates in imported_names(node, module, file.endswith("__init__.py")):
                target = next((files[name] for name in candidates if name in files), None)
                if target is not None and target != file:
                    imports.append(Import(file, node.lineno, target))
    return tuple(imports)


def part(file: str) -> str:
    """The layer part of a file: megapipe/data/sft.py -> data, megapipe/__init__.py -> megapipe, stages/x.py -> stages."""
    package, *rest = Path(file).with_suffix("").parts
    if package == "stages":
        return "stages"
    return rest[0] if rest and rest[0] != "__init__" else "megapipe"


def layer(file: str) -> int:
    name = part(file)
    for i, parts in enumerate(LAYERS):
        if name in parts:
            return i
    raise AssertionError(f"{file}: its part {name!r} is in no layer; add it to LAYERS in {Path(__file__).name}")


def find_cycle(imports: tuple[Import, ...]) -> list[Import]:
    """One circle of imports (each import's target is the next one's source), or []."""
    edges: dict[str, list[Import]] = {}
    for imp in imports:
        edges.setdefault(imp.source, []).append(imp)
    finished: set[str] = set()  # files from which no circle is reachable

    def visit(file: str, path: list[Import]) -> list[Import]:  # path: the imports that led to file
        sources = [p.source for p in path] + [file]
        for imp in edges.get(file, []):
            if imp.target in sources:
                return path[sources.index(imp.target):] + [imp]
            if imp.target not in finished and (cycle := visit(imp.target, path + [imp])):
                return cycle
        finished.add(file)
        return []

    return next((cycle for file in sorted(edges) if file not in finished and (cycle := visit(file, []))), [])


def describe(imp: Import) -> str:
    return f"{imp.source}:{imp.line} imports {imp.target}"


def test_no_circle():
    cycle = find_cycle(import_graph())
    assert not cycle, "an import circle:\n  " + "\n  ".join(map(describe, cycle))


def test_no_import_runs_up_the_layers():
    wrong = []
    for imp in import_graph():
        src, dst = part(imp.source), part(imp.target)
        if layer(imp.target) > layer(imp.source) and (src, dst) not in UPWARD:
            wrong.append(f"{describe(imp)}: layer {src} imports the higher layer {dst}")
        elif src != dst and {src, dst} <= APART:
            wrong.append(f"{describe(imp)}: {src} and {dst} share a layer but must not import each other")
    assert not wrong, "imports against the layering (tests/test_layers.py: LAYERS):\n  " + "\n  ".join(wrong)


def test_the_graph_sees_every_kind_of_import():
    """The rules above hold only if the graph is complete: check it on imports this repository has today."""
    imports = {(i.source, i.target) for i in import_graph()}
    assert ("megapipe/cli.py", "stages/eval.py") in imports  # from stages import eval as evaluate
    assert ("megapipe/cli.py", "megapipe/__init__.py") in imports  # from megapipe import __version__
    assert ("megapipe/checkpoint/hf/__init__.py", "megapipe/checkpoint/hf/gpt2.py") in imports  # from pkg import mod
    assert ("megapipe/training/recipes/__init__.py", "megapipe/training/recipes/base.py") in imports
