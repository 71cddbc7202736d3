"""benchmarks/gemv_stream.py runs end to end at tiny sizes and prints one table row per layer shape, each a
positive rate with the call cost taken off. Timings mean nothing here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import gemv_stream  # noqa: E402

pytestmark = pytest.mark.usefixtures("native_bf16_gemm")  # tests/conftest.py: skip without it, fail under CI


def test_every_shape_gets_a_row_of_positive_rates(capsys):
    assert gemv_stream.main(["--threads", "1", "--mib", "2", "--sum-mib", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\| [a-z_]+ \| \d+x\d+ \|", line)]
    assert [r.split("|")[1].strip() for r in rows] == [name for name, _, _ in gemv_stream.SHAPES["smollm2-135m"]]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        gemv, net, total = float(cells[4]), float(cells[5]), float(cells[6])
        assert 0 < gemv <= net and total > 0
    assert re.search(r"cost of a call: \d+\.\d+ us", out)
