"""The runtime's layering, read from the imports of its files (module level and inside functions alike):
models reach the kernels only through layers, layers never import models, and layers never import the
quantization formats (formats build layers, not the reverse)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"

# (package whose files are checked, imported package they must not reach, why)
RULES = [
    ("models", "kubellm.kernels", "models reach kernels through runtime/layers (e.g. layers/fused_decode.py)"),
    ("layers", "kubellm.runtime.models", "layers sit below models; move what they need down into layers"),
    ("layers", "kubellm.runtime.quantization", "quantization formats build layers; layers take QuantizedWeight"),
]


def imported_modules(source: str, module: str) -> set[str]:
    """Every module ``source`` (the text of module ``module``, dotted) imports anywhere: ``import a.b``,
    ``from a import b`` (both ``a`` and ``a.b``, since ``b`` may be a module), relative imports resolved."""
    found: set[str] = set()
    package = module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _reaches(imported: str, forbidden: str) -> bool:
    return imported == forbidden or imported.startswith(forbidden + ".")


def violations(package: str, forbidden: str) -> list[str]:
    out = []
    for path in sorted((RUNTIME / package).rglob("*.py")):
        module = "kubellm.runtime." + ".".join(path.relative_to(RUNTIME).with_suffix("").parts)
        for name in sorted(imported_modules(path.read_text(), module)):
            if _reaches(name, forbidden):
                out.append(f"{path.relative_to(RUNTIME.parent)} imports {name}")
    return out


@pytest.mark.parametrize(("package", "forbidden", "why"), RULES)
def test_runtime_packages_keep_their_layer(package, forbidden, why):
    assert (RUNTIME / package).is_dir()
    found = violations(package, forbidden)
    assert not found, f"{why}:\n" + "\n".join(found)


def test_the_import_reader_sees_imports_inside_functions_and_relative_ones():
    source = """
from kubellm import kernels
def f():
    from kubellm.kernels.cpu_decode_layer import decode_layer_
    import kubellm.runtime.models.llama
from .checkpoint import CheckpointError
from .. import layers
"""
    found = imported_modules(source, "kubellm.runtime.models.gguf")
    assert {"kubellm.kernels", "kubellm.kernels.cpu_decode_layer", "kubellm.runtime.models.llama",
            "kubellm.runtime.models.checkpoint", "kubellm.runtime.layers"} <= found
    assert _reaches("kubellm.kernels.cpu_moe", "kubellm.kernels")
    assert not _reaches("kubellm.kernelsx", "kubellm.kernels")
