"""Session fixtures: tiny Hugging Face checkpoints (random weights, trained BPE) built once per test run, and
the native CPU kernels' fixtures with their CI guard (which kernels the session exercised; see NATIVE_SETS)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import tokenizers
import torch

import tiny_checkpoints  # tests/ is on sys.path: pyproject.toml's pytest `pythonpath`
from kubellm.kernels import (
    cpu_bf16_gemm,
    cpu_extension,
    cpu_fp8_gemm,
    cpu_grouped_int8_gemm,
    cpu_int4_gemm,
    cpu_int8_gemm,
    cpu_moe,
)

# Triton kernels run on CPU tensors through Triton's interpreter; @triton.jit reads this when a kernel module
# is imported, so it must be set before any test imports one. With a GPU the kernels run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _default_dtype_kept():
    """Fails a test that leaves torch's default dtype changed (one did: every later test then built bfloat16
    tensors), and restores it so the tests after it still run as written."""
    dtype = torch.get_default_dtype()
    yield
    changed = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    assert changed == dtype, f"the test left torch's default dtype at {changed} (was {dtype})"


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory) -> Callable[..., Path]:
    """``factory(arch="llama", **build_checkpoint_kwargs) -> Path``; the same arguments give the same folder."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[tuple, Path] = {}

    def factory(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in built:
            built[key] = tiny_checkpoints.build_checkpoint(root / f"{arch}-{len(built)}", arch, **kwargs)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama3(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("llama3")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("mistral")


@pytest.fixture(scope="session")
def tiny_llama_sharded(tiny_checkpoint_factory) -> Path:
    """Same weights as ``tiny_llama``, in 3 safetensors shards with model.safetensors.index.json."""
    return tiny_checkpoint_factory("llama", num_shards=3)


@pytest.fixture(scope="session")
def tiny_llama_bf16(tiny_checkpoint_factory) -> Path:
    """``tiny_llama``'s weights rounded to bfloat16 (config torch_dtype "bfloat16")."""
    return tiny_checkpoint_factory("llama", dtype=torch.bfloat16)


@pytest.fixture(params=["llama", "llama3", "qwen2", "mistral"])
def tiny_checkpoint(request, tiny_checkpoint_factory) -> Path:
    """Each single-file architecture in turn (parametrized)."""
    return tiny_checkpoint_factory(request.param)


@pytest.fixture(scope="session")
def tokenizer_corpus() -> list[str]:
    """The sentences the tiny tokenizer was trained on."""
    return tiny_checkpoints.make_corpus(seed=0)


@pytest.fixture
def tiny_tokenizer() -> tokenizers.Tokenizer:
    """A fresh copy of the tokenizer every tiny checkpoint ships (tokenizer.json), safe to mutate."""
    return tiny_checkpoints.train_tokenizer()


# ------------------------------------------------------------------------------------------ native CPU kernels
#
# A test that needs the native kernels requests one of these fixtures (directly, through another fixture, or
# with `pytestmark = pytest.mark.usefixtures(...)`). Where the kernels do not load it skips, except under CI
# (CI=true) on a host that should have them, where it fails: a broken build must not pass as skipped tests.
# At the end of the session a summary says, for each set, what this host offers and how many of its tests ran;
# under CI the session fails if a set the host supports had a test skipped, or, on a whole-suite run (bare
# `pytest`, as `make test` runs it), had no test run at all.

IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _expect_native_kernels() -> str | None:
    """Why this host need not have the extension (None: it must). It compiles anywhere with a C++ compiler
    (the vector paths are chosen at compile time, with scalar fallbacks), and g++ and ninja are what CI
    provides, so under CI nothing excuses it."""
    return None if IN_CI else "not under CI"


def _expect_native_int8() -> str | None:
    """The int8, int4, grouped 8-bit and FP8 GEMMs exist only in builds for CPUs with AVX512-BF16 (-march=native on such a CPU)."""
    if "x86-64-v4-bf16" not in cpu_extension.supported_levels():
        return "this CPU lacks AVX512-BF16"
    march = os.environ.get(cpu_extension.MARCH_ENV, "").strip() or "native"
    if march not in ("native", "x86-64-v4-bf16"):
        return f"{cpu_extension.MARCH_ENV}={march} builds without AVX512-BF16"
    return _expect_native_kernels()


def _expect_native_avx2() -> str | None:
    """The bf16 linear, the int4 GEMM's int8 activations and the grouped 8-bit GEMM exist in builds for AVX512-BF16
    and for AVX2 + FMA (x86-64-v3) CPUs (the AVX2 ones: kernels/csrc/avx2_tiles.h, bf16_linear.h)."""
    if "x86-64-v3" not in cpu_extension.supported_levels():
        return "this CPU lacks AVX2/FMA"
    march = os.environ.get(cpu_extension.MARCH_ENV, "").strip() or "native"
    if march not in ("native", "x86-64-v3", "x86-64-v4", "x86-64-v4-bf16"):
        return f"{cpu_extension.MARCH_ENV}={march} builds without AVX2"
    return _expect_native_kernels()


# fixture name -> (what it covers, why the host need not have it (None: it must), whether it loads here)
NATIVE_SETS: dict[str, tuple[str, Callable[[], str | None], Callable[[], bool]]] = {
    "native_kernels": ("native CPU kernels (paged and prefill attention, layer ops)", _expect_native_kernels,
                       cpu_extension.available),
    "native_int8": ("native int8 GEMM (AVX512-BF16)", _expect_native_int8, cpu_int8_gemm.available),
    "native_int4": ("native int4 GEMM (AVX512-BF16)", _expect_native_int8, cpu_int4_gemm.available),
    "native_int4_int8": ("native int4 GEMM's int8 activations (AVX512-VNNI or AVX2)", _expect_native_avx2,
                         cpu_int4_gemm.int8_available),
    "native_grouped_int8": ("native grouped 8-bit GEMM (AVX512-BF16 or AVX2)", _expect_native_avx2,
                            cpu_grouped_int8_gemm.available),
    "native_moe": ("native mixture-of-experts kernel (AVX512-BF16)", _expect_native_int8, cpu_moe.available),
    "native_bf16_gemm": ("native bf16 linear (AVX512-BF16 or AVX2)", _expect_native_avx2, cpu_bf16_gemm.available),
    "native_fp8": ("native FP8 GEMM (AVX512-BF16)", _expect_native_int8, cpu_fp8_gemm.available),
}


def _require_native(name: str) -> None:
    title, excuse, loads = NATIVE_SETS[name]
    if loads():
        return
    if os.environ.get(cpu_extension.DISABLE_ENV, "") not in ("", "0"):
        why = f"{cpu_extension.DISABLE_ENV} is set"
    else:
        why = cpu_extension.build_info()["error"] or "not in this build"
    reason = f"{title} unavailable: {why}"
    if IN_CI and excuse() is None:
        pytest.fail(f"{reason} (under CI on a host that supports them)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def native_kernels() -> None:
    """The native CPU kernel extension, built or loaded on first use; skip without it (fail under CI)."""
    _require_native("native_kernels")


@pytest.fixture(scope="session")
def native_int8(native_kernels) -> None:
    """The native int8 GEMM (CPUs with AVX512-BF16 only); skip without it (fail under CI where the CPU has it)."""
    _require_native("native_int8")


@pytest.fixture(scope="session")
def native_int4(native_kernels) -> None:
    """The native int4 GEMM (CPUs with AVX512-BF16 only); skip without it (fail under CI where the CPU has it)."""
    _require_native("native_int4")


@pytest.fixture(scope="session")
def native_int4_int8(native_kernels) -> None:
    """The native int4 GEMM's int8 activations (AVX512-VNNI or AVX2); skip without them (fail under CI where the
    CPU has them)."""
    _require_native("native_int4_int8")


@pytest.fixture(scope="session")
def native_grouped_int8(native_kernels) -> None:
    """The native grouped 8-bit GEMM (AVX512-BF16 or AVX2); skip without it (fail under CI where the CPU has
    it)."""
    _require_native("native_grouped_int8")


@pytest.fixture(scope="session")
def native_moe(native_kernels) -> None:
    """The native mixture-of-experts kernel (CPUs with AVX512-BF16 only); skip without it (fail under CI where
    the CPU has it)."""
    _require_native("native_moe")


@pytest.fixture(scope="session")
def native_bf16_gemm(native_kernels) -> None:
    """The native bf16 linear (AVX512-BF16 or AVX2 + FMA); skip without it (fail under CI where the CPU has it)."""
    _require_native("native_bf16_gemm")


@pytest.fixture(scope="session")
def native_fp8(native_kernels) -> None:
    """The native FP8 GEMM (CPUs with AVX512-BF16 only); skip without it (fail under CI where the CPU has it)."""
    _require_native("native_fp8")


_native_tests: dict[str, set[str]] = {name: set() for name in NATIVE_SETS}  # set -> collected node ids
_native_outcomes: dict[str, Counter] = {name: Counter() for name in NATIVE_SETS}  # passed/failed/error/skipped
_native_skipped: dict[str, list[str]] = {name: [] for name in NATIVE_SETS}


def pytest_collection_finish(session) -> None:
    for item in session.items:  # after deselection (-k, -m)
        for name in NATIVE_SETS:
            if name in getattr(item, "fixturenames", ()):
                _native_tests[name].add(item.nodeid)


def _excused_skip(report) -> bool:
    """A skip because another kernel set that this host need not have is missing (a test of the bf16 linear
    and the AVX512-BF16 MoE kernel, on an AVX2 host): no fault of the sets it also uses."""
    longrepr = report.longrepr
    reason = str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)
    reason = reason.removeprefix("Skipped: ")
    return any(reason.startswith(f"{title} unavailable") and excuse() is not None
               for title, excuse, _ in NATIVE_SETS.values())


def pytest_runtest_logreport(report) -> None:
    for name, nodeids in _native_tests.items():
        if report.nodeid not in nodeids:
            continue
        if hasattr(report, "wasxfail"):  # ran, and failed (xfailed) or passed (xpassed) as marked
            _native_outcomes[name]["xfail"] += 1
        elif report.skipped and _excused_skip(report):
            _native_outcomes[name]["skipped (a set not needed here)"] += 1
        elif report.skipped:  # in setup (the fixtures) or in the test itself
            _native_outcomes[name]["skipped"] += 1
            _native_skipped[name].append(report.nodeid)
        elif report.when == "call":
            _native_outcomes[name][report.outcome] += 1
        elif report.failed:  # an error in setup (the fixture under CI) or teardown
            _native_outcomes[name]["error"] += 1


def _ran(name: str) -> int:
    return sum(_native_outcomes[name][outcome] for outcome in ("passed", "failed", "xfail"))


def _native_problems(config) -> list[str]:
    """Under CI: the sets this host supports that did not run as they should."""
    if not IN_CI:
        return []
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    problems = []
    for name, (title, excuse, _) in NATIVE_SETS.items():
        if excuse() is not None:
            continue
        if _native_skipped[name]:
            problems.append(f"{title}: {len(_native_skipped[name])} tests skipped on a host that supports them, "
                            f"e.g. {_native_skipped[name][0]}")
        elif whole_suite and not _ran(name):
            problems.append(f"{title}: no test ran on a host that supports them "
                            f"({len(_native_tests[name])} collected)")
    return problems


def pytest_sessionfinish(session, exitstatus) -> None:
    if _native_problems(session.config) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Which native kernel sets this session exercised, and why any did not run."""
    if not any(_native_tests.values()):
        return
    tr = terminalreporter
    problems = _native_problems(config)
    tr.section("native CPU kernels" + (" (CI)" if IN_CI else ""), red=bool(problems), bold=True)
    info = cpu_extension.build_info()
    cap = f" (capped by {cpu_extension.ISA_ENV}={cpu_extension.isa_cap()})" if cpu_extension.isa_cap() else ""
    tr.write_line(f"x86-64 levels of this CPU: {', '.join(cpu_extension.supported_levels()) or 'none'}{cap}")
    tr.write_line(f"library: {info['library'] or info['error'] or 'not loaded in this session'}")
    for name, (title, excuse, _) in NATIVE_SETS.items():
        why_not = excuse()
        expectation = "required here" if why_not is None else f"not required: {why_not}"
        if not _native_tests[name]:
            tr.write_line(f"{title}: none selected in this run ({expectation})")
            continue
        counts = _native_outcomes[name]
        done = ", ".join(f"{n} {what}" for what, n in sorted(counts.items()) if n) or "none run"
        exercised = ("not exercised" if not _ran(name) else "partly exercised" if counts["skipped"]
                     else "exercised")
        tr.write_line(f"{title}: {exercised.upper()} ({len(_native_tests[name])} tests: {done}; {expectation})")
    for problem in problems:
        tr.write_line(f"CI FAILURE: {problem}", red=True, bold=True)
