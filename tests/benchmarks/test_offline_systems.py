"""benchmarks/offline.py's systems: the weight-format rows run only when named, and vLLM's only with its venv."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import offline  # noqa: E402


def test_format_systems_run_only_when_named():
    assert offline.parse_args([]).systems == [s for s in offline.DEFAULT_SYSTEMS if s != "vllm"]
    named = offline.parse_args(["--systems", "kubellm,kubellm-gguf,kubellm-awq"]).systems
    assert named == ["kubellm", "kubellm-gguf", "kubellm-awq"]
    assert set(offline.FORMAT_SYSTEMS) <= set(offline.RUNNERS) and "vllm-gguf" not in offline.SYSTEMS


def test_a_vllm_format_system_needs_the_vllm_venv(capsys):
    with pytest.raises(SystemExit):
        offline.parse_args(["--systems", "kubellm,vllm-awq"])
    assert "needs --vllm-venv" in capsys.readouterr().err
