"""No Python process the project starts may resolve ``import operator`` to the repository's operator/ folder.

``python -m`` and ``python -c`` put the working directory first on sys.path, and a script's folder goes there too.
The repository's ``operator/`` has no ``__init__.py``, so from the root it is at most a namespace portion, and the
standard library's regular module wins over it; ``kubellm.operator`` still maps to the folder (pyproject.toml).
Each kind of process is started here from the repository root as a plain shell would, without safe-path mode.

A development venv hides the problem: the editable install's .pth file imports ``operator`` at start-up,
before the working directory joins sys.path. So each process is probed instead of trusted: a sitecustomize
on PYTHONPATH records, at the process's first import after start-up (sys.path final), where ``operator``
would resolve on that sys.path. PYTHONPATH is inherited, so the processes those processes start are probed too.
"""

from __future__ import annotations

import json
import operator
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STDLIB_OPERATOR = operator.__file__

PROBE = """
import importlib.machinery, json, os, sys


class _Probe:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "usercustomize":  # site's own import, before sys.path is final
            return None
        sys.meta_path.remove(cls)
        spec = importlib.machinery.PathFinder.find_spec("operator")
        with open(os.environ["KUBELLM_OPERATOR_PROBE"], "a") as f:
            f.write(json.dumps({"argv": sys.argv, "operator": spec and spec.origin}) + "\\n")
        return None


sys.meta_path.insert(0, _Probe)
"""


@pytest.fixture
def probe(tmp_path):
    """``run(argv)``: run from the repository root (or ``cwd``) as a plain shell would, probed; returns
    (result, probe records)."""
    hook = tmp_path / "probe"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PROBE)

    def run(argv: list[str], cwd: Path = ROOT, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
        log = tmp_path / f"probe-{len(list(tmp_path.glob('probe-*')))}.jsonl"
        child_env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
        child_env.update(env, PYTHONPATH=str(hook), KUBELLM_OPERATOR_PROBE=str(log))
        result = subprocess.run(argv, cwd=cwd, env=child_env, capture_output=True, text=True, timeout=300)
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        assert records, f"the probe did not run in {argv}: {result.stderr[-2000:]}"
        wrong = [r for r in records if r["operator"] != STDLIB_OPERATOR]
        assert not wrong, f"these processes would import the wrong operator: {wrong}"
        return result, records

    return run


def _kubellm() -> str:
    return str(Path(sys.executable).parent / "kubellm")


def _started_with(records: list[dict], flag: str) -> int:
    return sum(1 for r in records if r["argv"][:1] == [flag])


def test_probe_catches_a_process_that_would_import_the_wrong_operator(probe, tmp_path):
    """The check itself: a folder with an ``operator/__init__.py`` (what the repository must not have) is caught."""
    shadow = tmp_path / "checkout"
    (shadow / "operator").mkdir(parents=True)
    (shadow / "operator" / "__init__.py").write_text("")
    with pytest.raises(AssertionError, match="wrong operator"):
        probe([sys.executable, "-c", "import kubellm.kernels"], cwd=shadow)


def test_python_m_and_c_from_the_repository_root(probe):
    """`python -m kubellm.runtime.cli` and `python -c` from the root: the stdlib's operator, the folder's package."""
    result, records = probe([sys.executable, "-m", "kubellm.runtime.cli", "--help"])
    assert result.returncode == 0, result.stderr
    code = ("import operator, kubellm.operator.api as api; "
            "print(operator.__file__); print(api.__file__); print(operator.itemgetter(1)([0, 7]))")
    result, more = probe([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    stdlib, package, item = result.stdout.split()
    assert stdlib == STDLIB_OPERATOR and Path(package).resolve().is_relative_to(ROOT / "operator") and item == "7"
    assert _started_with(records, "-m") == 1 and _started_with(more, "-c") == 1


def test_operator_folder_is_a_namespace_portion():
    """The fix itself: no ``operator/__init__.py``; every folder below it that holds modules is a regular package."""
    assert not (ROOT / "operator" / "__init__.py").exists(), "operator/__init__.py would shadow the stdlib operator"
    for folder in (p.parent for p in (ROOT / "operator").rglob("*.py")):
        if folder != ROOT / "operator" and "__pycache__" not in folder.parts:
            assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} has no __init__.py"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_recipes(probe, tmp_path):
    """`make` from a plain shell: the first thing `make test` runs on a clean clone, `$(PYTHON) -m venv` from
    the repository root."""
    recipe = f"probe-venv: ; $(PYTHON) -m venv --without-pip {tmp_path / 'venv'}"
    result, records = probe(["make", "-s", "--eval", recipe, "probe-venv", f"PYTHON={sys.executable}"])
    assert result.returncode == 0, result.stderr
    assert _started_with(records, "-m") == 1, records


def test_kubellm_kernel_builds_and_pip(probe, tmp_path):
    """`kubellm` from a plain shell: the command itself (a console script) and the Python processes it starts
    (one per -march for `kernels build`, pip for `models pull`). Both fail fast here, after starting."""
    result, records = probe([_kubellm(), "kernels", "build", "--out", str(tmp_path / "k"), "--march", "x86-64-v3"],
                            CXX="false", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert result.returncode != 0
    assert _started_with(records, "-c") == 1, records  # the build process
    assert len(records) == 2, records
    result, records = probe([_kubellm(), "models", "pull", "smollm2"], KUBELLM_CACHE=str(tmp_path / "cache"), PIP_NO_INDEX="1")
    assert result.returncode != 0
    assert _started_with(records, "-m") == 1, records  # pip
    assert len(records) == 2, records


@pytest.mark.slow
def test_kubellm_tensor_parallel_ranks(probe, tiny_llama):
    """`kubellm generate --tensor-parallel-size 2` from a plain shell: the spawned rank (and multiprocessing's
    resource tracker) start as `python -c`."""
    result, records = probe([_kubellm(), "generate", "--model", str(tiny_llama), "--tensor-parallel-size", "2",
                             "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "128",
                             "--prompt", "hi", "--max-tokens", "2"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert _started_with(records, "-c") >= 1, records


BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if "__main__" in p.read_text())


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_scripts_start_from_the_repository_root(probe, script):
    """`python benchmarks/X.py` from the repository root (its own folder on sys.path, for sibling modules)."""
    result, _ = probe([sys.executable, str(script.relative_to(ROOT)), "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
