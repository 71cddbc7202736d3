"""The GitHub Actions workflows: valid YAML with the shape Actions needs, pinned actions, least privilege, and
the commands the project defines (CI = `bash .ci/run`, end to end = `make e2e`). actionlint itself is not a
dev dependency (its PyPI wrapper downloads the binary at install time), so these are structural checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
PINNED_ACTION = re.compile(r"^[\w.-]+/[\w./-]+@(v\d+(\.\d+)*|[0-9a-f]{40})$")


def _load(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())
    if True in doc:  # YAML 1.1 reads the bare key `on` as a boolean
        doc["on"] = doc.pop(True)
    return doc


def _steps(doc: dict, job: str) -> list[dict]:
    return doc["jobs"][job]["steps"]


def _runs(doc: dict, job: str) -> str:
    return "\n".join(step.get("run", "") for step in _steps(doc, job))


def test_both_workflows_exist():
    assert {p.name for p in WORKFLOWS} >= {"ci.yaml", "e2e.yaml"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_shape_pins_and_permissions(path: Path):
    doc = _load(path)
    assert doc.get("name") and doc.get("on") and doc.get("jobs"), f"{path.name}: needs name, on and jobs"
    assert doc.get("permissions") == {"contents": "read"}, f"{path.name}: give the token read access only"
    for name, job in doc["jobs"].items():
        assert job.get("runs-on"), f"{path.name}: job {name} has no runs-on"
        assert isinstance(job.get("timeout-minutes"), int), f"{path.name}: job {name} has no timeout-minutes"
        for step in job["steps"]:
            assert ("uses" in step) != ("run" in step), f"{path.name}: {name}: a step needs uses or run: {step}"
            if "uses" in step:
                assert PINNED_ACTION.match(step["uses"]), f"{path.name}: pin {step['uses']} to a release or commit"


def test_ci_runs_the_projects_ci_script_on_python_3_11():
    doc = _load(ROOT / ".github" / "workflows" / "ci.yaml")
    assert set(doc["on"]) >= {"push", "pull_request"}
    (job,) = doc["jobs"]
    steps = _steps(doc, job)
    assert doc["jobs"][job]["runs-on"] == "ubuntu-latest"
    python = [s for s in steps if s.get("uses", "").startswith("actions/setup-python@")]
    assert python and str(python[0]["with"]["python-version"]) == "3.11"
    (ci,) = [s for s in steps if s.get("run") == "bash .ci/run"]
    assert ci["env"]["CI"] == "true"


def test_e2e_runs_make_e2e_on_kind_and_keeps_the_logs_of_a_failure():
    doc = _load(ROOT / ".github" / "workflows" / "e2e.yaml")
    steps = _steps(doc, "kind")
    assert any(s.get("uses", "").startswith("helm/kind-action@") for s in steps)
    assert any(s.get("uses", "").startswith("azure/setup-helm@") for s in steps)
    assert "make e2e" in _runs(doc, "kind")
    (upload,) = [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert upload["if"] == "failure()" and upload["with"]["path"] == "e2e/artifacts"
    assert "e2e/artifacts" in doc["jobs"]["kind"]["env"]["KUBELLM_E2E_ARTIFACTS"]


def test_e2e_builds_every_image_target():
    doc = _load(ROOT / ".github" / "workflows" / "e2e.yaml")
    dockerfile = (ROOT / "Dockerfile").read_text()
    targets = doc["jobs"]["images"]["strategy"]["matrix"]["target"]
    assert set(targets) == {"runtime-cpu", "runtime-cuda", "operator"}
    for target in targets:
        assert f" AS {target}\n" in dockerfile
    assert 'docker build --target "$TARGET"' in _runs(doc, "images")
