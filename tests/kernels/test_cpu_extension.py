"""How the native CPU kernels are found: x86-64 levels from CPU flags, the build folder's key, prebuilt
libraries from KUBELLM_CPU_KERNELS_DIR (the compiler-free images' path), and `kubellm kernels build` end to end.

Everything but the last test fakes the CPU, the compiler and the loader, so it runs in milliseconds and on any
machine. The last one compiles for x86-64-v4-bf16 (or x86-64-v3) in a subprocess and loads the result in a fresh process whose
kernel cache is empty, so only the prebuilt library can supply the ops.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kubellm.kernels import cpu_extension as cx

# Real /proc/cpuinfo flag lines (trimmed of flags that do not matter here).
SKYLAKE_X = ("fpu vme sse sse2 ssse3 fma cx16 pcid sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand "
             "lahf_lm abm 3dnowprefetch fsgsbase bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx "
             "smap clflushopt clwb avx512cd avx512bw avx512vl xsaveopt xsavec")
ZEN3 = ("fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm abm "
        "sse4a misalignsse 3dnowprefetch fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt "
        "clwb sha_ni xsaveopt xsavec vaes vpclmulqdq")
NEHALEM = "fpu vme sse sse2 ssse3 cx16 sse4_1 sse4_2 popcnt lahf_lm"
GRAVITON2 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
ZEN4 = SKYLAKE_X + " avx512_bf16 avx512_vnni avx512_vbmi2"
ALL_LEVELS = ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64-v2"]


@pytest.fixture(autouse=True)
def _no_isa_cap(monkeypatch):
    """These tests fake the CPU; a cap set for the whole run (CI's x86-64-v3 pass) would cap the fake too."""
    monkeypatch.delenv(cx.ISA_ENV, raising=False)


@pytest.mark.parametrize("flags,levels", [
    (ZEN4, ALL_LEVELS),
    (SKYLAKE_X, ALL_LEVELS[1:]),  # AVX-512 without AVX512-BF16
    (ZEN3, ["x86-64-v3", "x86-64-v2"]),  # AVX2, no AVX-512
    (NEHALEM, ["x86-64-v2"]),
    (GRAVITON2, []),  # aarch64 "Features"
    ("", []),  # /proc/cpuinfo unreadable
], ids=["v4-bf16", "v4", "v3-only", "v2-only", "aarch64", "no-flags"])
def test_supported_levels_from_cpu_flags(flags, levels):
    assert cx.supported_levels(set(flags.split())) == levels


def test_supported_levels_reads_this_cpu_by_default(monkeypatch):
    monkeypatch.setattr(cx, "cpu_flags", lambda: set(ZEN3.split()))
    assert cx.supported_levels() == ["x86-64-v3", "x86-64-v2"]


@pytest.mark.parametrize("cap,levels", [
    ("x86-64-v3", ["x86-64-v3", "x86-64-v2"]),
    ("x86-64-v4", ALL_LEVELS[1:]),
    ("x86-64-v4-bf16", ALL_LEVELS),
    ("x86-64-v2", ["x86-64-v2"]),
])
def test_isa_cap_hides_the_levels_above_it(monkeypatch, cap, levels):
    """KUBELLM_CPU_ISA makes an AVX-512 host answer as a lesser CPU and build its kernels for that level."""
    monkeypatch.setattr(cx, "cpu_flags", lambda: set(ZEN4.split()))
    monkeypatch.delenv(cx.MARCH_ENV, raising=False)
    monkeypatch.setenv(cx.ISA_ENV, cap)
    assert cx.supported_levels() == levels
    assert cx._march() == levels[0]
    assert cx._march_cflags(cx._march())[0] == f"-march={levels[0].removesuffix('-bf16')}"


def test_isa_cap_above_the_cpu_changes_nothing_and_an_unknown_one_is_refused(monkeypatch):
    monkeypatch.setattr(cx, "cpu_flags", lambda: set(ZEN3.split()))
    monkeypatch.delenv(cx.MARCH_ENV, raising=False)
    monkeypatch.setenv(cx.ISA_ENV, "x86-64-v4-bf16")
    assert cx.supported_levels() == ["x86-64-v3", "x86-64-v2"] and cx._march() == "x86-64-v3"
    monkeypatch.setenv(cx.ISA_ENV, "avx2")
    with pytest.raises(ValueError, match="KUBELLM_CPU_ISA='avx2' is not an x86-64 level: use one of x86-64-v4-bf16"):
        cx.supported_levels()


def test_a_first_build_says_so_and_how_long_it_takes(monkeypatch, tmp_path, caplog):
    """A new install's first start compiles for about two minutes on 2 cores: a log line says so up front."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("KUBELLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cx, "_ninja_on_path", lambda: True)
    monkeypatch.setattr(cx, "_op_registered", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: str(Path(kw["build_directory"]) / cx.LIBRARY_NAME))
    with caplog.at_level(logging.INFO, logger=cx.logger.name):
        cx._build()
    first = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("building native CPU kernels for this CPU") and "first run only, about" in m
               for m in first), first
    caplog.clear()
    (cx._build_directory() / cx.LIBRARY_NAME).write_bytes(b"built")
    with caplog.at_level(logging.INFO, logger=cx.logger.name):
        cx._build()
    assert not [r for r in caplog.records if "building" in r.getMessage()]


def test_levels_are_listed_best_first():
    """_load_prebuilt tries the levels in this order and takes the first library it finds."""
    assert list(cx.X86_LEVELS) == ALL_LEVELS
    for i, level in enumerate(ALL_LEVELS):
        flags = set().union(*(cx.X86_LEVELS[lower] for lower in ALL_LEVELS[i:]))
        assert cx.supported_levels(flags) == ALL_LEVELS[i:], level


@pytest.mark.parametrize("unset", [None, "", "  "])
def test_native_build_folder_is_keyed_by_this_cpu(monkeypatch, tmp_path, unset):
    if unset is None:
        monkeypatch.delenv(cx.MARCH_ENV, raising=False)
    else:
        monkeypatch.setenv(cx.MARCH_ENV, unset)
    folder = cx._build_directory(tmp_path)
    assert folder.parent == tmp_path / "torch_extensions"
    assert f"-{cx._cpu_fingerprint()}-" in folder.name
    assert "x86-64" not in folder.name


def test_portable_build_folder_is_keyed_by_the_level_not_the_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("KUBELLM_CACHE", str(tmp_path))
    folders = {}
    for march in ("x86-64-v3", "x86-64-v4"):
        monkeypatch.setenv(cx.MARCH_ENV, march)
        folders[march] = cx._build_directory()
        assert folders[march].parent == tmp_path / "torch_extensions"  # KUBELLM_CACHE is the default root
        assert f"-{march}-" in folders[march].name
        assert cx._cpu_fingerprint() not in folders[march].name
    monkeypatch.delenv(cx.MARCH_ENV)
    assert len({*folders.values(), cx._build_directory()}) == 3, "a level's build would reuse another's"


def _fake_kernels_dir(root: Path, levels: list[str]) -> Path:
    for level in levels:
        (root / level).mkdir(parents=True)
        (root / level / cx.LIBRARY_NAME).write_bytes(b"not really a library")
    return root


@pytest.fixture
def loads(monkeypatch):
    """Records torch.ops.load_library calls instead of loading; the ops then count as registered."""
    loaded: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cx, "_op_registered", lambda: bool(loaded))
    return loaded


def test_load_prebuilt_does_nothing_without_the_env_var(monkeypatch, loads, caplog):
    monkeypatch.delenv(cx.PREBUILT_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger=cx.__name__):
        assert cx._load_prebuilt() is None
        monkeypatch.setenv(cx.PREBUILT_ENV, " ")
        assert cx._load_prebuilt() is None
    assert loads == [] and not caplog.records


@pytest.mark.parametrize("cpu,expected", [
    (ALL_LEVELS, "x86-64-v4"),
    (["x86-64-v3", "x86-64-v2"], "x86-64-v3"),
])
def test_load_prebuilt_takes_the_best_level_this_cpu_runs(monkeypatch, tmp_path, loads, cpu, expected):
    root = _fake_kernels_dir(tmp_path, ["x86-64-v4", "x86-64-v3"])
    monkeypatch.setenv(cx.PREBUILT_ENV, str(root))
    monkeypatch.setattr(cx, "supported_levels", lambda flags=None: cpu)
    path = str(root / expected / cx.LIBRARY_NAME)
    assert cx._load_prebuilt() == path
    assert loads == [path]


@pytest.mark.parametrize("cpu", [["x86-64-v3", "x86-64-v2"], []], ids=["v3-cpu-v4-only-dir", "aarch64"])
def test_load_prebuilt_warns_and_returns_none_without_a_library_for_this_cpu(
        monkeypatch, tmp_path, loads, caplog, cpu):
    root = _fake_kernels_dir(tmp_path, ["x86-64-v4"])
    monkeypatch.setenv(cx.PREBUILT_ENV, str(root))
    monkeypatch.setattr(cx, "supported_levels", lambda flags=None: cpu)
    monkeypatch.setattr(cx.shutil, "which", lambda name: f"/usr/bin/{name}")  # a compiler could build one
    with caplog.at_level(logging.WARNING, logger=cx.__name__):
        assert cx._load_prebuilt() is None
    assert loads == []
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert str(root) in record.getMessage() and "compiling instead" in record.getMessage()
    assert (", ".join(cpu) or "none") in record.getMessage()


def test_no_library_and_no_compiler_is_one_warning_then_the_references(monkeypatch, tmp_path, loads, caplog):
    """What a compiler-free image logs on a CPU its prebuilt libraries do not cover: one line, and no build."""
    monkeypatch.setenv(cx.PREBUILT_ENV, str(_fake_kernels_dir(tmp_path, ["x86-64-v4", "x86-64-v3"])))
    monkeypatch.delenv(cx.DISABLE_ENV, raising=False)
    monkeypatch.setenv("CXX", "kubellm-test-no-such-compiler")
    monkeypatch.setattr(cx, "supported_levels", lambda flags=None: ["x86-64-v2"])
    monkeypatch.setattr(cx, "_state", {"tried": False, "ok": False, "error": None, "build_seconds": None,
                                       "library": None})

    def no_build(load=True):
        raise AssertionError("tried to compile without a compiler")

    monkeypatch.setattr(cx, "_build", no_build)
    with caplog.at_level(logging.WARNING, logger=cx.__name__):
        assert cx.available() is False
    assert loads == []
    [record] = caplog.records
    assert "using the PyTorch references" in record.getMessage()
    assert "no C++ compiler" in record.getMessage() and "x86-64-v2" in record.getMessage()
    assert cx.build_info()["ok"] is False and cx.build_info()["library"] is None


def test_build_portable_loads_only_a_level_this_cpu_runs(monkeypatch, tmp_path):
    """Even op registration runs the level's instructions at load time (the v4 build's uses AVX-512
    registers), so building x86-64-v4 on an AVX2 machine must compile without loading."""
    monkeypatch.setenv(cx.MARCH_ENV, "restored-after-the-test")
    monkeypatch.setattr(cx, "supported_levels", lambda flags=None: ["x86-64-v3", "x86-64-v2"])
    monkeypatch.setattr(cx, "_op_registered", lambda: False)
    calls = []

    def fake_build(load=True):
        calls.append((os.environ[cx.MARCH_ENV], load))
        built = tmp_path / "build" / cx.LIBRARY_NAME
        built.parent.mkdir(exist_ok=True)
        built.write_bytes(os.environ[cx.MARCH_ENV].encode())
        return built

    monkeypatch.setattr(cx, "_build", fake_build)
    out = tmp_path / "kernels"
    for march in ("x86-64-v4", "x86-64-v3"):
        target = cx.build_portable(out, march)
        assert target == out / march / cx.LIBRARY_NAME and target.read_bytes() == march.encode()
    assert calls == [("x86-64-v4", False), ("x86-64-v3", True)]


@pytest.mark.parametrize("march,cflags", [("x86-64-v4", ["-march=x86-64-v4"]),
                                          ("x86-64-v4-bf16", ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"])])
def test_build_without_loading_restores_the_loader(monkeypatch, tmp_path, march, cflags):
    """_build(load=False) goes through cpp_extension.load with its loader swapped out, then puts it back."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("KUBELLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", sys.executable)  # any executable: the fake load below compiles nothing
    monkeypatch.setattr(cx, "_ninja_on_path", lambda: True)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: pytest.fail(f"loaded {path}"))
    original = cpp_extension._import_module_from_library
    seen = {}

    def fake_load(name, sources, extra_cflags, build_directory, is_python_module, **kwargs):
        seen["cflags"] = extra_cflags
        return cpp_extension._import_module_from_library(name, build_directory, is_python_module)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv(cx.MARCH_ENV, march)
    built = cx._build(load=False)
    assert built == cx._build_directory() / cx.LIBRARY_NAME
    assert [f for f in seen["cflags"] if f.startswith(("-march", "-mavx"))] == cflags
    assert cpp_extension._import_module_from_library is original


def _fake_torch_load(monkeypatch, seen):
    """cpp_extension.load as far as its lock goes: torch waits while its lock file exists (for ever, with no
    staleness check), then would compile. Here it waits at most 5 s, then fails the test."""
    from torch.utils import cpp_extension

    def fake_load(name, build_directory, **kwargs):
        lock = Path(build_directory) / "lock"
        deadline = time.monotonic() + 5
        while lock.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"the build waited on {lock}")
            time.sleep(0.05)
        seen.append(build_directory)
        return str(Path(build_directory) / cx.LIBRARY_NAME)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cx, "_ninja_on_path", lambda: True)
    monkeypatch.setenv("CXX", sys.executable)


def test_a_lock_left_by_a_killed_build_does_not_wedge_the_next_one(monkeypatch, tmp_path, caplog):
    """A build killed midway (a timed-out test, a stopped pod) leaves torch's lock file behind, seconds old.
    Nobody holds our flock, so the next build removes it and goes on instead of waiting for ever."""
    monkeypatch.setenv("KUBELLM_CACHE", str(tmp_path))
    seen = []
    _fake_torch_load(monkeypatch, seen)
    build_dir = cx._build_directory()
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    assert cx._build(load=False) == build_dir / cx.LIBRARY_NAME
    assert seen == [str(build_dir)] and not (build_dir / "lock").exists()
    assert "left by a killed build" in caplog.text


def test_a_build_running_elsewhere_is_waited_for_then_given_up_on(monkeypatch, tmp_path):
    """While another process (here: another open file description) holds the flock, a second build waits;
    past _BUILD_WAIT_S it raises, which available() turns into the fallback to the references."""
    import fcntl

    monkeypatch.setenv("KUBELLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cx, "_BUILD_WAIT_S", 0.5)
    seen = []
    _fake_torch_load(monkeypatch, seen)
    build_dir = cx._build_directory()
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # the live builder's own torch lock: must survive
    with open(build_dir / "kubellm-build.lock", "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="another process has been building"):
            cx._build(load=False)
        assert time.monotonic() - start >= 0.5
        assert seen == [] and (build_dir / "lock").exists()
        fcntl.flock(other, fcntl.LOCK_UN)
    (build_dir / "lock").unlink()
    cx._build(load=False)  # released: the next build goes ahead
    assert seen == [str(build_dir)]


def _kubellm() -> str:
    beside = Path(sys.executable).parent / "kubellm"
    return str(beside) if beside.exists() else shutil.which("kubellm") or pytest.fail("no kubellm command")


RMS_NORM_CHECK = """
import torch
from kubellm.kernels import cpu_extension as cx, cpu_layer_ops as ops
assert cx.available(), cx.build_info()
print(cx.build_info()["library"])
g = torch.Generator().manual_seed(0)
x = (torch.randn(7, 576, generator=g) * 3).to(torch.bfloat16)
w = (torch.rand(576, generator=g) + 0.5).to(torch.bfloat16)
torch.testing.assert_close(torch.ops.kubellm_cpu.rms_norm(x, w, 1e-5), ops.reference_rms_norm(x, w, 1e-5))
print(torch.ops.kubellm_cpu.int8_gemm_available())
"""


# The best level this CPU has of the two: x86-64-v4-bf16 also proves that its extra compiler flag
# (-mavx512bf16) reaches the build, since only then does the library carry the int8 GEMM.
PORTABLE = next((lv for lv in ("x86-64-v4-bf16", "x86-64-v3") if lv in cx.supported_levels()), None)


@pytest.mark.skipif(PORTABLE is None, reason="this CPU lacks x86-64-v3 (AVX2/FMA)")
def test_kernels_build_then_a_fresh_process_loads_the_prebuilt_library(tmp_path):
    """`kubellm kernels build --out kernels` (relative: written under the caller's folder), then a process
    with KUBELLM_CPU_KERNELS_DIR and an empty kernel cache: it must load the prebuilt library and compute
    what the reference computes."""
    if not shutil.which(os.environ.get("CXX", "c++")):
        if os.environ.get("CI"):
            pytest.fail("no C++ compiler in CI")
        pytest.skip("no C++ compiler")
    env = {k: v for k, v in os.environ.items() if k not in (cx.PREBUILT_ENV, cx.MARCH_ENV, cx.DISABLE_ENV)}
    build = subprocess.run([_kubellm(), "kernels", "build", "--out", "kernels", "--march", PORTABLE],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    library = tmp_path / "kernels" / PORTABLE / cx.LIBRARY_NAME
    assert build.returncode == 0, build.stdout + build.stderr
    assert library.is_file(), build.stdout + build.stderr
    assert str(library.resolve()) in build.stdout

    empty_cache = tmp_path / "cache"
    empty_cache.mkdir()
    env.update({cx.PREBUILT_ENV: str(tmp_path / "kernels"), "KUBELLM_CACHE": str(empty_cache)})
    info = subprocess.run([_kubellm(), "kernels", "info"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0, info.stdout + info.stderr
    assert "native CPU kernels: loaded" in info.stdout
    int8 = "available" if PORTABLE == "x86-64-v4-bf16" else "no: no AVX512-BF16 int8 kernel in this build"
    assert f"\n  native int8 GEMM: {int8}\n" in info.stdout, info.stdout
    assert f"library: {library}\n" in info.stdout, info.stdout

    check = subprocess.run([sys.executable, "-c", RMS_NORM_CHECK], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.strip().splitlines()[-2:] == [str(library), str(PORTABLE == "x86-64-v4-bf16")]
    assert not any(empty_cache.iterdir()), "something was compiled into the empty cache"
