"""benchmarks/gpu_gemm_tiles.py (the tiling sweep the lead runs on an H200) where it cannot do its real job: its
pure parts (which candidates, in which order, within which budget) and the whole sweep on CPU through Triton's
interpreter at tiny shapes (``--device cpu --tiny``), which must write a row for every kernel, layer and M.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import gpu_gemm_tiles as sweep  # noqa: E402

from kubellm.kernels import triton_gemm_tiles as gemm_tiles  # noqa: E402
from kubellm.kernels import triton_grouped_gemm, triton_int8_gemm  # noqa: E402

H200_SMS = 132


def _args(kind: str, k: int = 4096) -> dict:
    x = torch.empty(1, k, dtype=torch.bfloat16)
    args = triton_grouped_gemm.tiling_args(x, 32, 4) if kind == "int4" else triton_int8_gemm.tiling_args(x)
    return {**args, "sms": H200_SMS}


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("m", [1, 32, 256])
def test_candidates_start_next_to_the_chosen_tiling_and_all_fit_in_shared_memory(kind, m):
    args = _args(kind)
    chosen = sweep.tiling_of(gemm_tiles.choose(m, 6144, 4096, **args))
    cands = sweep.candidates(m, args, chosen)
    assert cands and chosen not in cands and len({tuple(sorted(c.items())) for c in cands}) == len(cands)
    distances = [sweep._distance(c, chosen)[0] for c in cands]
    assert distances == sorted(distances) and distances[0] == 1
    assert all(sweep.staged_bytes(c, args) <= sweep.SHARED_LIMIT for c in cands)
    assert all(c["block_k"] >= args.get("min_block_k", 16) for c in cands)
    gemv = [c for c in cands if not c["dot"]]
    if m == 1:  # the GEMV form is the first candidate tried at decode, with a one-row tile
        assert not cands[0]["dot"] and cands[0]["block_m"] == 1 and gemv
    else:
        assert not gemv
    if m == 256:
        assert all(c["block_m"] >= 64 for c in cands)


@pytest.mark.parametrize("m", [1, 32, 256])
def test_the_grouped_gemm_is_swept_in_both_forms_the_launched_one_chosen(m):
    """The chosen tiling names the form grouped_gemm launches at m rows (fields at M <= 8, words above); the
    candidates hold both forms, each within its own K-tile bounds (words: the group of 32) and shared memory."""
    x = torch.empty(m, 4096, dtype=torch.bfloat16)
    form = triton_grouped_gemm.form_for(m)
    assert form == ("fields" if m <= 8 else "words")
    args = {f: {**triton_grouped_gemm.tiling_args(x, 32, 4, f), "sms": H200_SMS} for f in triton_grouped_gemm.FORMS}
    chosen = sweep.tiling_of(gemm_tiles.choose(m, 6144, 4096, **args[form]), form)
    cands = [c for f in triton_grouped_gemm.FORMS for c in sweep.candidates(m, args[f], chosen, f)]
    assert {c["form"] for c in cands} == set(triton_grouped_gemm.FORMS)
    for c in cands:
        a = args[c["form"]]
        assert a.get("min_block_k", 16) <= c["block_k"] <= a["max_block_k"]
        assert sweep.staged_bytes(c, a) <= sweep.SHARED_LIMIT
    assert sweep._short(chosen).endswith(form) and sweep._short({**chosen, "dot": 0}).endswith(f"{form} gemv")


@pytest.mark.parametrize("m", [3, 9])
def test_the_sweeps_grouped_call_runs_either_form_to_the_same_product(m):
    """What the sweep calls on CPU (tiny layer, interpreter): the launched form first among its forms, and the
    first candidate of each form computes the launcher's own product."""
    shape = sweep.TINY_SHAPES[1]
    fn, tiling_args, forms = sweep.kernels(sweep.gk.gemm_weights(shape, "cpu"))["int4 g32"]
    x = sweep.gk._activations(m, shape.k, torch.bfloat16, "cpu")
    assert forms(m) == (["fields", "words"] if m <= 8 else ["words", "fields"])
    form = forms(m)[0]
    chosen = sweep.tiling_of(gemm_tiles.choose(m, shape.n, shape.k, **tiling_args(x, form)), form)
    want = fn(x).float()
    for f in forms(m):
        first = sweep.candidates(m, tiling_args(x, f), chosen, f)[0]
        assert first["form"] == f
        torch.testing.assert_close(fn(x, **first).float(), want, atol=0.05, rtol=0.02)


def test_the_explicit_twin_of_the_chosen_tiling_is_the_same_tiling():
    for m in (1, 32, 256):
        for args in (_args("int4", 14336), _args("int8", 14336)):
            chosen = gemm_tiles.choose(m, 4096, 14336, **args)
            assert gemm_tiles.choose(m, 4096, 14336, **args, **sweep.tiling_of(chosen)) == chosen


def test_every_row_gets_an_equal_share_after_its_reserve():
    assert sweep.row_deadline(100.0, 190.0, 3) == 130.0
    assert sweep.row_deadline(100.0, 190.0, 3, reserve_s=10.0) == 120.0
    assert sweep.row_deadline(100.0, 90.0, 3) == 100.0  # past the budget: no candidates, the row still runs


@pytest.mark.slow
def test_the_cpu_self_test_writes_a_row_for_every_kernel_layer_and_m(tmp_path, monkeypatch):
    """With a clock on which the GEMV form is fastest, every row (M 1 and 3) names a GEMV tiling as the best: the
    candidates were compiled, checked against the chosen output, timed and ranked."""
    def fake_bench(fn, device, rep=40):
        return 1.0 if fn.keywords.get("dot") == 0 else 2.0

    monkeypatch.setattr(sweep, "bench", fake_bench)
    out = tmp_path / "tiles.md"
    assert sweep.main(["--device", "cpu", "--tiny", "--budget-s", "60", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line][1:]
    seen = {tuple(cell.strip() for cell in r.split("|")[1:4]) for r in rows}
    want = {(k, s.name, str(m)) for k in ("int4 g32", "int8", "fp8 channel") for s in sweep.TINY_SHAPES
            for m in sweep.TINY_ROWS}
    assert seen == want
    for r in rows:
        cells = [cell.strip() for cell in r.split("|")[1:-1]]
        assert cells[8].endswith("gemv") and cells[11] == "2.00", r


@pytest.mark.slow
def test_the_sm90_compile_check_builds_every_decode_form_within_shared_memory():
    """benchmarks/gpu_gemm_compile.py with Triton's bundled ptxas (a subprocess: it imports the kernels as JIT
    functions, which this interpreter-mode process must not): every form at M=1 on the o layer compiles for sm_90
    and fits, and the report lists the grouped kernel's words form and both scale placements of its fields
    form, each with tl.dot and as a GEMV."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_gemm_compile.py"), "--rows", "1", "--layers", "o"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "0 failed or did not fit" in run.stdout
    for form in ("dot fields, scale per row", "gemv fields, scale per row", "dot fields, scale after",
                 "gemv fields, scale after", "dot words", "gemv words"):
        assert form in run.stdout
