"""The GPU verification kit (benchmarks/gpu_check.py) tested where it cannot do its real job: on CPU, through
Triton's interpreter at tiny shapes (``--device cpu --tiny``). Pinned here: the same correctness code paths
run and pass on sound kernels, the report's sections and name, the exit status and the report when a kernel is
wrong, raises, or a part of the kit crashes, the greedy-parity rule, and where peak bandwidth comes from.
What only a GPU can show (real shapes, timings, NCCL, vLLM) is not tested here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import gpu_check_engine as engine  # noqa: E402
import gpu_check_kernels as kernels  # noqa: E402
from cuda_graph_stand_ins import RecordingCapture, StaleCapture  # noqa: E402
from gpu_check_report import Report  # noqa: E402

from kubellm.kernels import triton_fp8_gemm, triton_grouped_gemm, triton_int8_gemm  # noqa: E402
from kubellm.kernels import triton_paged_attention as tpa  # noqa: E402


def _report(out: Path) -> str:
    (path,) = out.glob("gpu-check-*.md")
    return path.read_text()


@pytest.mark.slow
def test_tiny_run_passes_on_sound_kernels_and_writes_every_section(tmp_path, capsys):
    """The whole kit (kernels, timing, engine parity, offline throughput) on CPU: exit 0 and a report."""
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("gpu-check-*-cpu-triton-interpreter-tiny.md")
    text = path.read_text()
    assert text.startswith("# kubellm GPU check: CPU Triton interpreter\n\n**PASS**")
    for kernel in ("paged decode attention", "prefill attention", "int8 GEMM", "int4 GEMM", "grouped 4-bit GEMM",
                   "grouped 8-bit GEMM", "FP8 GEMM", "RMSNorm", "residual add + RMSNorm", "SiLU-and-mul",
                   "rotary embedding", "q/k norm + rotary"):
        assert f"| {kernel} |" in text
    for heading in ("## 1. Kernel correctness", "### Paged decode attention", "### Prefill attention",
                    "### Weight-only GEMMs", "### Pre-quantized weight GEMMs", "## 3a. Engine end to end: greedy parity", "### Offline throughput",
                    "## 4. Tensor parallelism", "## 5. Decode step profile", "### Decode step phases"):
        assert heading in text
    assert "cpu float32 (Triton attention) vs CPU float32" in text
    assert "cpu bfloat16 (Triton attention) vs CPU float32" in text
    assert "- skipped: TP=2 needs two GPUs; 0 visible" in text
    assert "FAIL" not in text
    assert "PASS: report written to" in capsys.readouterr().out


def test_a_wrong_decode_kernel_fails_the_kernel_check_and_the_engine_and_exits_1(tmp_path, monkeypatch):
    """1% off: the kernel check names it with its error, and the engine (Triton attention forced) refuses to
    start because the start-up check catches it too."""
    sound = tpa.paged_decode_attention
    monkeypatch.setattr(tpa, "paged_decode_attention", lambda *a, **k: sound(*a, **k) * 1.01)
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--skip", "timing,throughput,graphs,profile,llama8b,peer"]) == 1
    text = _report(tmp_path)
    assert "**FAIL**" in text and "## Failures" in text
    failures = text.split("## Failures")[1].split("## Environment")[0]
    assert "1. Kernel correctness (Triton vs PyTorch reference) / paged decode attention" in failures
    assert "elements out of tolerance" in failures
    assert "greedy parity" in failures and "paged decode kernel differs from its reference" in failures
    assert "prefill attention" not in failures and "GEMM" not in failures


def test_a_kernel_that_raises_fails_its_check_with_the_exception(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly aborted")

    monkeypatch.setattr(triton_int8_gemm, "int8_gemm", broken)
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--skip", "timing,engine,throughput,graphs,profile,llama8b,peer"]
    assert gpu_check.main(argv) == 1
    failures = _report(tmp_path).split("## Failures")[1].split("## Environment")[0]
    assert failures.count("int8 GEMM") == 2  # float32 and bfloat16
    assert "the kernel raised RuntimeError: PTX assembly aborted" in failures


def test_a_wrong_layer_op_fails_its_check_and_nothing_else(tmp_path, monkeypatch):
    """1% off in place (q only): the float32 rotary check fails with its error (1% is inside bfloat16's
    tolerance), the other layer ops and kernels pass."""
    from kubellm.kernels import triton_layer_ops

    sound = triton_layer_ops.rotary_embedding_

    def off(positions, q, k, cos, sin):
        sound(positions, q, k, cos, sin)
        q.mul_(1.01)

    monkeypatch.setattr(triton_layer_ops, "rotary_embedding_", off)
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--skip", "timing,engine,throughput,graphs,profile,llama8b,peer"]
    assert gpu_check.main(argv) == 1
    failures = _report(tmp_path).split("## Failures")[1].split("## Environment")[0]
    assert failures.count("/ rotary embedding (") == 1 and "in place, float32)" in failures
    assert failures.count("elements out of tolerance") == 1


@pytest.mark.parametrize("module,function,failing,form", [
    (triton_grouped_gemm, "grouped_gemm", {"grouped 4-bit GEMM": 2, "grouped 8-bit GEMM": 1, "int4 GEMM": 1},
     "act-order"),
    (triton_fp8_gemm, "fp8_gemm", {"FP8 GEMM": 2}, "128x128 blocks"),
])
def test_a_wrong_pre_quantized_gemm_fails_each_of_its_forms_and_nothing_else(module, function, failing, form,
                                                                            tmp_path, monkeypatch):
    """1% off: every form the kernel serves fails in float32 (act-order and plain 4-bit, 8-bit, and the int4
    check, which is the grouped 4-bit GEMM on --quantization int4's weights; FP8 per channel and per block) with
    its error, and nothing else does (1% is inside bfloat16's tolerance)."""
    sound = getattr(module, function)
    monkeypatch.setattr(module, function, lambda *a, **k: sound(*a, **k) * 1.01)
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--skip", "timing,engine,throughput,graphs,profile,llama8b,peer"]
    assert gpu_check.main(argv) == 1
    failures = _report(tmp_path).split("## Failures")[1].split("## Environment")[0]
    for name, count in failing.items():
        assert failures.count(f"/ {name} (") == count
    assert failures.count("elements out of tolerance") == sum(failing.values())
    assert failures.count(f", {form}, float32)") == 1


def test_a_crash_in_a_part_of_the_kit_fails_the_run_and_is_named(tmp_path, monkeypatch):
    def crash(*args):
        raise KeyError("no such table")

    monkeypatch.setattr(kernels, "time_prefill", crash)
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--skip", "kernels,engine,throughput,graphs,profile,llama8b,peer"]
    assert gpu_check.main(argv) == 1
    text = _report(tmp_path)
    assert "2. Kernel timing / prefill timing (crashed)" in text and "KeyError" in text
    assert "### Paged decode attention" in text  # the other timings still ran


def test_a_time_limit_keeps_what_ran_and_fails_naming_the_interruption(tmp_path, monkeypatch):
    """`timeout` sends SIGTERM mid-run: the report holds the parts that finished and the run exits 1."""
    import signal

    def killed(*args):
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(kernels, "time_prefill", killed)
    argv = ["--device", "cpu", "--tiny", "--out", str(tmp_path), "--skip", "kernels,engine,throughput,graphs,profile,llama8b,peer"]
    try:
        assert gpu_check.main(argv) == 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    text = _report(tmp_path)
    assert "### Paged decode attention" in text  # decode timing ran before the signal
    assert "Interrupted / run completed" in text and "signal 15" in text
    assert "Weight-only GEMMs (bf16 activations)" not in text  # after the signal nothing else ran


def test_without_the_demo_download_the_demo_checks_use_a_random_checkpoint_of_its_shape(tmp_path, monkeypatch):
    """No package index on a GPU machine: the kit never calls pull there; it builds SmolLM2's decoder shape."""
    monkeypatch.setattr(engine, "_demo_cached", lambda: False)
    monkeypatch.setattr(engine, "SMOLLM2_SHAPE", {**engine.SMOLLM2_SHAPE, "num_hidden_layers": 2})
    label, model = engine.demo_model(tmp_path)
    assert label.startswith("random SmolLM2-135M-shaped")
    config = json.loads((Path(model) / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (576, 9, 3)
    assert config["tie_word_embeddings"] is True
    assert engine.demo_hf_folder(tmp_path, torch.bfloat16) == Path(model)
    # With the demo's own config and tokenizer: random weights of exactly that config, its tokenizer beside them.
    files = tmp_path / "demo-files"
    files.mkdir()
    (files / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "vocab_size": 600}))
    (files / "tokenizer.json").write_text((Path(model) / "tokenizer.json").read_text())
    label, random_model = engine.demo_model(tmp_path, files)
    assert label.startswith("SmolLM2-135M config and tokenizer, random weights")
    from safetensors import safe_open

    with safe_open(str(Path(random_model) / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [600, 576]
        assert not any(".layers.1." in k for k in f.keys())  # noqa: SIM118 - safe_open is not iterable
    assert (Path(random_model) / "tokenizer.json").read_text() == (files / "tokenizer.json").read_text()
    monkeypatch.setattr(engine, "_demo_cached", lambda: True)
    assert engine.demo_model(tmp_path, files) == ("smollm2 (SmolLM2-135M Q4_1 GGUF)", "smollm2")


GRAPHS_ONLY = ["--device", "cpu", "--tiny", "--skip", "kernels,timing,engine,throughput,tp,profile,llama8b,peer"]


def test_on_cpu_the_graphs_section_compares_eager_with_eager_and_says_so(tmp_path):
    assert gpu_check.main(GRAPHS_ONLY + ["--out", str(tmp_path)]) == 0
    section = _report(tmp_path).split("## 3c. CUDA graphs (decode)")[1].split("## 4.")[0]
    assert "| greedy, CUDA graphs vs eager | random Llama (tiny), cpu float32, 4 prompts x 6 tokens |" in section
    assert "- skipped: CUDA graphs on cpu: the setting is a no-op there, both runs above were eager" in section
    assert "### Decode throughput with and without CUDA graphs: random Llama (tiny) (float32)" in section
    assert "| 4 | 4 x (4, 6) |" in section and "cpu run: --cuda-graphs is a no-op here" in section


@pytest.mark.parametrize("capture,passed,expect", [
    (RecordingCapture, True, "| CUDA graphs captured | random Llama (tiny), cpu float32, 4 prompts x 6 tokens | "
                             "captured 35 decode batch sizes (1..256)"),
    (StaleCapture, False, "3c. CUDA graphs (decode) / CUDA graphs captured (random Llama (tiny), cpu float32, 4 "
                          "prompts x 6 tokens): off: the start-up check failed (RuntimeError: the replay of batch "
                          "size 4 (3 rows + padding) differs from the eager pass"),
])
def test_where_the_device_captures_graphs_a_run_that_fell_back_fails(capture, passed, expect, tmp_path, monkeypatch):
    """CPU with a stand-in capture plays the GPU: graphs captured pass (and replay the eager tokens); a start-up
    check that falls back fails the kit with the engine's reason."""
    from kubellm.runtime.engine import cuda_graphs
    monkeypatch.setitem(cuda_graphs.CAPTURE_PRIMITIVES, "cpu", capture)
    assert gpu_check.main(GRAPHS_ONLY + ["--out", str(tmp_path)]) == (0 if passed else 1)
    text = _report(tmp_path)
    assert expect in text
    assert "| greedy, CUDA graphs vs eager |" in text and "no-op" not in text.split("## 3c.")[1].split("###")[0]


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu"], "add --tiny"),
    (["--device", "cpu", "--tiny", "--skip", "kernels,gpus"], "--skip: unknown gpus"),
])
def test_bad_command_lines_exit_2_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_how_to_get_a_cuda_torch(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cuda"])
    assert "sees no GPU" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ greedy parity rule


def _gen(tokens, logprobs, tops):
    return engine.Generation([tokens], [logprobs], [tops])


REFERENCE = _gen([5, 7, 9], [-0.5, -1.0, -0.7], [{5: -0.5, 6: -1.5}, {7: -1.0, 8: -1.05}, {9: -0.7, 3: -2.0}])


def test_parity_accepts_equal_tokens_within_tolerance():
    r = engine.compare_greedy(REFERENCE, _gen([5, 7, 9], [-0.52, -0.98, -0.7], [{}] * 3), tol=0.05)
    assert (r.compared, r.equal, r.errors, r.ties) == (3, 3, [], [])
    assert r.max_delta == pytest.approx(0.02)


def test_parity_accepts_a_divergence_at_a_near_tie_and_stops_comparing_there():
    r = engine.compare_greedy(REFERENCE, _gen([5, 8, 1], [-0.5, -1.0, -9.0], [{}] * 3), tol=0.1)
    assert r.errors == [] and r.equal == 1 and r.compared == 2
    assert r.ties == ["prompt 0 token 1 (margin 0.05)"]


def test_parity_fails_a_divergence_at_a_clear_winner_and_a_drifting_logprob():
    clear = engine.compare_greedy(REFERENCE, _gen([6, 7, 9], [-0.5, -1.0, -0.7], [{}] * 3), tol=0.1)
    assert clear.errors == ["prompt 0 token 0: chose 6 where the reference's 5 is 1 nats more likely"]
    unknown = engine.compare_greedy(REFERENCE, _gen([4, 7, 9], [-0.5, -1.0, -0.7], [{}] * 3), tol=0.1)
    assert "inf nats more likely" in unknown.errors[0]  # outside the reference's top 5
    drift = engine.compare_greedy(REFERENCE, _gen([5, 7, 9], [-0.5, -1.3, -0.7], [{}] * 3), tol=0.1)
    assert drift.errors == ["prompt 0 token 1: log-probability -1.3000, reference -1.0000"]
    short = engine.compare_greedy(REFERENCE, _gen([5, 7], [-0.5, -1.0], [{}] * 2), tol=0.1)
    assert short.errors == ["prompt 0: 2 tokens, reference 3"]


# ------------------------------------------------------------------------------------------ peak bandwidth, names


def test_peak_bandwidth_comes_from_the_memory_clock_and_bus_width(monkeypatch):
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=2_619_000, memory_bus_width=5120)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    gbs, source = kernels.peak_bandwidth("cuda")
    assert gbs == pytest.approx(3352.3, abs=0.1)
    assert "from torch device properties (2619 MHz x 5120-bit x 2)" in source


@pytest.mark.parametrize("name,gbs", [("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000),
                                      ("NVIDIA H200", 4800), ("NVIDIA A100-SXM4-80GB", 2039),
                                      ("NVIDIA A100-SXM4-40GB", 1555), ("NVIDIA L4", 300), ("NVIDIA L40S", 864),
                                      ("Tesla T4", None)])
def test_peak_bandwidth_falls_back_to_the_table_by_device_name(name, gbs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(name=name))
    found, source = kernels.peak_bandwidth("cuda")
    assert found == gbs
    assert ("data-sheet table" in source) if gbs else ("unknown" in source)


def test_report_file_name_has_the_date_and_the_device():
    report = Report("NVIDIA H100 80GB HBM3", "full", {})
    assert report.file_name() == f"gpu-check-{report.started:%Y-%m-%d}-nvidia-h100-80gb-hbm3.md"


def test_causal_flops_count_visible_pairs():
    shape = kernels.AttentionShape(2, 1, 8)
    assert kernels.causal_flops(3, 3, shape) == 4 * 2 * 8 * 6  # 1 + 2 + 3 pairs
    assert kernels.causal_flops(2, 5, shape) == 4 * 2 * 8 * (4 + 5)  # a later chunk sees the cached 3 keys


# ------------------------------------------------------------------------------------------------ part 5: profile

PROFILE_ONLY = ["--device", "cpu", "--tiny", "--skip", "kernels,timing,engine,throughput,graphs,tp,llama8b,peer"]


def _phase_table(section: str, batch: int) -> tuple[dict[str, tuple[float, float, str]], list[str]]:
    """{row name: (mean, p90, share)} of the decode-phase table at ``batch`` and its notes."""
    body = section.split("### Decode step phases: ")[1 if batch == 1 else 2].split("###")[0]
    rows, notes = {}, []
    for line in body.splitlines():
        if line.startswith("| ") and not line.startswith("| per step"):
            name, mean, p90, share = (c.strip() for c in line.strip("|").split("|"))
            rows[name] = (float(mean), float(p90), share) if mean != "n/a" else (None, None, share)
        elif line.startswith("- "):
            notes.append(line[2:])
    return rows, notes


def test_the_profile_part_reports_every_phase_and_its_shares_add_up(tmp_path, monkeypatch):
    """On CPU with the stand-in capture (graph replays as on a GPU): per batch a phase table whose host phases tile
    the wall time, the GPU column n/a, the replay count, the reading line, and the profiler's op table."""
    from kubellm.runtime.engine import cuda_graphs, step_timer
    monkeypatch.setitem(cuda_graphs.CAPTURE_PRIMITIVES, "cpu", RecordingCapture)
    assert gpu_check.main(PROFILE_ONLY + ["--out", str(tmp_path)]) == 0
    text = _report(tmp_path)
    assert text.index("## 4. Tensor parallelism") < text.index("## 5. Decode step profile")
    section = text.split("## 5. Decode step profile (where a step's time goes)")[1]
    assert "| prompt tokens | first step (ms) | again (ms) | first / again |" in section
    for batch in (1, 4):
        assert f"### Decode step phases: random Llama (tiny) (float32), batch {batch}, 4-token prompts" in section
        assert f"### torch.profiler, batch {batch}: top 15 ops by self CPU time" in section
        rows, notes = _phase_table(section, batch)
        assert list(rows) == ["step wall time", "GPU time of the forward (CUDA events)"] + [
            f"host: {p}" for p in step_timer.PHASES]
        assert rows["GPU time of the forward (CUDA events)"] == (None, None, "n/a")
        wall = rows["step wall time"][0]
        host = sum(mean for name, (mean, _, _) in rows.items() if name.startswith("host: "))
        assert host == pytest.approx(wall, rel=0.02, abs=0.01)
        assert rows["host: forward call / graph replay"][0] > 0 and rows["host: sampling"][0] > 0
        assert f"6 decode steps at batch {batch}; 6 of them replayed a CUDA graph" in notes
        assert any(n.startswith("reading: GPU time n/a on cpu; the host phases are the whole step") for n in notes)
    assert "self CUDA (ms / step)" in section and "top 15 ops by self CUDA time" not in section


def test_the_profile_reading_says_host_bound_from_the_gpu_time():
    """The CUDA reading, from records as a GPU run makes them: 3 ms steps with 1 ms on the GPU are host-bound."""
    import gpu_check_profile

    from kubellm.runtime.engine.step_timer import PHASES, StepRecord

    def record(wall_ms: float, gpu_ms: float) -> StepRecord:
        phases = dict.fromkeys(PHASES, 0)
        phases[PHASES[0]] = int(wall_ms * 1e6)
        return StepRecord(int(wall_ms * 1e6), phases, gpu_ms, 1, True, True)

    table = gpu_check_profile.step_table("t", [record(3.0, 1.0)] * 9 + [record(4.0, 1.0)], "cuda")
    assert table.rows[0] == ["step wall time", "3.100", "3.000", "100.0%"]
    assert table.rows[1] == ["GPU time of the forward (CUDA events)", "1.000", "1.000", "32.3%"]
    assert "reading: host-bound: 2.10 ms of 3.10 ms per step outside the GPU forward (68%)" in table.notes
    table = gpu_check_profile.step_table("t", [record(3.0, 2.5)] * 4, "cuda")
    assert "reading: GPU-bound: 0.50 ms of 3.00 ms per step outside the GPU forward (17%)" in table.notes


def test_without_a_timer_the_engine_keeps_no_records_and_with_one_every_step_is_tiled(tmp_path):
    """The hook is off by default (runner.step_timer None); attached, each step's phases add up to its wall time."""
    from kubellm.runtime.engine.llm_engine import LLM
    from kubellm.runtime.engine.step_timer import StepTimer
    from kubellm.runtime.sampling.params import SamplingParams

    llama = engine.random_llama(tmp_path / "llama", tiny=True)
    with LLM(str(llama), progress=False, device="cpu", dtype="float32", kv_cache_memory="64MiB", max_model_len=64,
             attention_backend="torch", layer_ops="torch", prepack_weights="off") as llm:
        assert llm.engine.runner.step_timer is None
        timer = StepTimer("cpu")
        llm.engine.runner.step_timer = timer
        llm.generate([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0),
                     use_tqdm=False)
    assert [(r.rows, r.decode) for r in timer.records] == [(2, False), (2, True), (2, True)]
    for r in timer.records:
        assert sum(r.phase_ns.values()) == r.wall_ns and r.gpu_ms is None and not r.replayed
        assert r.phase_ns["forward call / graph replay"] > 0 and r.phase_ns["sampling"] > 0
