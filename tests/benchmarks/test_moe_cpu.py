"""benchmarks/moe_cpu.py's 8-bit comparison at a tiny size: every 8-bit format's experts stack for the fused kernel
(each checked against its per-expert layers inside the script) and a row per requested row count comes out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kubellm.kernels import cpu_int4_gemm, cpu_moe

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_cpu.py"


def _script():
    spec = importlib.util.spec_from_file_location("moe_cpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not (cpu_moe.available() and cpu_int4_gemm.available()), reason="needs the AVX512-BF16 kernels")
def test_int8_layer_comparison_runs_at_a_tiny_size(capsys):
    assert _script().main(["--int8", "--fresh", "--rows", "1,4", "--experts", "8", "--top-k", "2", "--hidden", "256",
                           "--inter", "128", "--calls", "2", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")][4:] == [
        "Q8_0 (ms)", "GPTQ-8bit (ms)", "W8A16 (ms)", "Q8_0 vs kernel", "GPTQ-8bit vs kernel", "W8A16 vs kernel"]
    rows = [line.strip("|").split("|") for line in lines[2:]]
    assert [int(r[0]) for r in rows] == [1, 4] and all(len(r) == 10 and r[-1].strip().endswith("x") for r in rows)
