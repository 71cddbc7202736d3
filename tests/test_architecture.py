"""The layout rules docs/architecture.md states, checked from the source: every module is in the module map, no
import cycles, and the runtime does not depend on the operator at import time."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"operator": "kubellm.operator", "runtime": "kubellm.runtime", "kernels": "kubellm.kernels"}


def _modules() -> dict[str, Path]:
    """Dotted name → file, for every module the distribution installs."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(path: Path, name: str) -> set[str]:
    """The project modules ``name`` imports when it is imported: top-level statements, also under if/try, not
    inside functions or classes and not under ``if TYPE_CHECKING``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in MODULES else base)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text()).body)
    resolved = set()
    for target in targets:  # `import kubellm.runtime.engine.scheduler` also imports the packages above it
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


GRAPH = {name: _module_level_imports(path, name) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_runtime_does_not_import_the_operator_at_import_time():
    """The runtime image and `kubellm serve` must work without the operator's modules being loaded; the
    `kubellm` command reaches the operator's subcommands through imports inside their functions."""
    leaks = {name: sorted(t for t in targets if t.startswith("kubellm.operator"))
             for name, targets in GRAPH.items() if name.startswith("kubellm.runtime")}
    assert {name: t for name, t in leaks.items() if t} == {}


def test_kernels_import_neither_runtime_nor_operator():
    leaks = {name: sorted(t for t in targets if not t.startswith("kubellm.kernels"))
             for name, targets in GRAPH.items() if name.startswith("kubellm.kernels")}
    assert {name: t for name, t in leaks.items() if t} == {}


def _module_map(text: str) -> set[str]:
    """Files named in docs/architecture.md's module map: a row's first cell holds `folder/file.py` and may go
    on with bare `other.py` names in the same folder."""
    section = text.split("\n## Module map", 1)[1]
    named = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for token in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if "/" in token:
                folder = token.rpartition("/")[0]
                named.add(token)
            elif token.endswith(".py") and folder:
                named.add(f"{folder}/{token}")
    return named


def test_every_module_is_in_the_module_map():
    named = _module_map((ROOT / "docs" / "architecture.md").read_text())
    files = {str(path.relative_to(ROOT)) for path in MODULES.values()}
    modules = {f for f in files if not f.endswith("__init__.py")}  # a package's own file may be named, or not
    assert sorted(modules - named) == [], "modules missing from docs/architecture.md's module map"
    assert sorted(named - files) == [], "the module map names files that do not exist"


def test_the_module_map_reader():
    doc = "# A\n\n## Module map\n\n| file | holds |\n| --- | --- |\n| `runtime/models/registry.py`, `qwen3.py` | x |\n"
    assert _module_map(doc) == {"runtime/models/registry.py", "runtime/models/qwen3.py"}
