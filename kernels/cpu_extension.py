"""Builds and loads the native CPU kernels (``csrc/*.cpp``) as one torch extension, once per process.

Every source registers its ops under ``torch.ops.kubellm_cpu``. The extension is compiled with
``torch.utils.cpp_extension.load`` the first time :func:`available` is called and cached on disk under
``<kubellm cache>/torch_extensions/`` (``$KUBELLM_CACHE`` or ``~/.cache/kubellm``), in a folder keyed by the
torch/Python versions, the CPU (it is compiled with ``-march=native``) and the sources' hash. It needs a C++
compiler and ninja; without them, or with ``KUBELLM_DISABLE_CPU_KERNELS=1``, :func:`available` is False and
callers use the plain-PyTorch references that sit beside each kernel's wrapper.

Images without a compiler ship prebuilt libraries instead: ``kubellm kernels build --out DIR --march x86-64-v4``
(and ``x86-64-v3``) at image build time, then ``KUBELLM_CPU_KERNELS_DIR=DIR`` at run time makes
:func:`available` load ``DIR/<level>/kubellm_cpu_ops.so`` for the best x86-64 level this CPU supports before
it considers compiling; a CPU the folder has no library for compiles as usual, or, with no compiler either,
falls back with one warning. ``KUBELLM_CPU_MARCH`` overrides ``-march=native`` for local builds.

``KUBELLM_CPU_ISA=<level>`` (e.g. ``x86-64-v3``) caps the x86-64 level everything here treats this CPU as having:
the kernels build for that level and every ISA query answers as on such a CPU, so an AVX-512 host runs exactly
what an AVX2-only host runs (CI runs the suite's kernel tests both ways). Set ``ONEDNN_MAX_CPU_ISA=AVX2`` and
``ATEN_CPU_CAPABILITY=avx2`` beside it to cap oneDNN and PyTorch's own kernels too (they read them at start-up).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "KUBELLM_DISABLE_CPU_KERNELS"
PREBUILT_ENV = "KUBELLM_CPU_KERNELS_DIR"
MARCH_ENV = "KUBELLM_CPU_MARCH"
ISA_ENV = "KUBELLM_CPU_ISA"
LIBRARY_NAME = "kubellm_cpu_ops.so"
# x86-64 micro-architecture levels, best first, with the /proc/cpuinfo flags each needs (a subset that tells
# them apart; compilers target exactly these levels with -march=x86-64-vN). x86-64-v4-bf16 is v4 plus
# AVX512-BF16 (AMD Zen 4+, Intel Cooper Lake and Sapphire Rapids+): the bf16 prefill attention and the int8,
# int4 and FP8 GEMMs need it; every such CPU also has AVX512-VNNI, which the int4 GEMM's int8 activations use.
X86_LEVELS = {
    "x86-64-v4-bf16": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "bmi2",
                       "avx512_bf16", "avx512_vnni"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "bmi2"},
    "x86-64-v3": {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"},
    "x86-64-v2": {"sse4_2", "popcnt", "ssse3"},
}
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCE_NAMES = ("paged_attention_cpu.cpp", "layer_ops_cpu.cpp", "prefill_attention_cpu.cpp", "int8_gemm_cpu.cpp",
                 "int4_gemm_cpu.cpp", "grouped_int8_gemm_cpu.cpp", "moe_cpu.cpp", "bf16_gemm_cpu.cpp",
                 "fp8_gemm_cpu.cpp", "decode_layer_cpu.cpp")
# Part of the build's cache key, not compiled on their own.
_HEADER_NAMES = ("scalar_math.h", "gemm_tiles.h", "int4_tiles.h", "int8_tiles.h", "w4a8_tiles.h", "bf16_linear.h",
                 "shared_items.h", "avx2_tiles.h", "gemm_checks.h")
OP_NAMESPACE = "kubellm_cpu"
# One op per source: the extension counts as loaded when all of them are registered.
_OPS = ("paged_decode_attention", "prefill_attention", "rms_norm", "add_rms_norm_", "silu_and_mul", "rotary_embedding_",
        "int8_gemm", "int4_gemm", "grouped_int8_gemm", "moe_experts", "bf16_linear", "fp8_gemm", "decode_layer_")
_BUILD_WAIT_S = 600.0  # a real build takes about a minute on 2 cores

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ok": False, "error": None, "build_seconds": None, "library": None}


def sources() -> list[Path]:
    return [_CSRC / name for name in _SOURCE_NAMES]


def _cache_root() -> Path:
    # Same rule as kubellm.runtime.models.store.cache_root (kept local: kernels do not import the runtime).
    if env := os.environ.get("KUBELLM_CACHE"):
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kubellm"


# Levels that are not a compiler -march of their own.
_LEVEL_CFLAGS = {"x86-64-v4-bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"]}


def isa_cap() -> str | None:
    """The level ``KUBELLM_CPU_ISA`` caps this CPU at, or None; raises ValueError for an unknown level."""
    cap = os.environ.get(ISA_ENV, "").strip()
    if not cap:
        return None
    if cap not in X86_LEVELS:
        raise ValueError(f"{ISA_ENV}={cap!r} is not an x86-64 level: use one of {', '.join(X86_LEVELS)}")
    return cap


def _march() -> str:
    """``KUBELLM_CPU_MARCH``, else under a cap the best level left (x86 CPUs), else ``native``."""
    if march := os.environ.get(MARCH_ENV, "").strip():
        return march
    capped = supported_levels() if isa_cap() else []
    return capped[0] if capped else "native"


def _march_cflags(march: str) -> list[str]:
    return _LEVEL_CFLAGS.get(march, [f"-march={march}"])


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.split(":", 1)[0].strip() in ("flags", "Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_levels(flags: set[str] | None = None) -> list[str]:
    """The x86-64 levels this CPU runs, best first (empty on other architectures), none above ``KUBELLM_CPU_ISA``."""
    flags = cpu_flags() if flags is None else flags
    levels = [level for level, needs in X86_LEVELS.items() if needs <= flags]
    if (cap := isa_cap()) is not None:  # X86_LEVELS is ordered best first
        order = list(X86_LEVELS)
        levels = [level for level in levels if order.index(level) >= order.index(cap)]
    return levels


def _load_prebuilt() -> str | None:
    """Load ``$KUBELLM_CPU_KERNELS_DIR/<best level>/kubellm_cpu_ops.so``; its path, or None (after a warning)
    if the folder has none for this CPU and a compiler can build one. Raises if there is no compiler either,
    so :func:`available` logs a single warning, not a second one for the build that cannot run."""
    root = os.environ.get(PREBUILT_ENV, "").strip()
    if not root:
        return None
    levels = supported_levels()
    for level in levels:
        path = Path(root) / level / LIBRARY_NAME
        if path.is_file():
            torch.ops.load_library(str(path))
            if not _op_registered():
                raise RuntimeError(f"{path} loaded but torch.ops.{OP_NAMESPACE} lacks one of {_OPS}")
            return str(path)
    missing = f"{PREBUILT_ENV}={root} holds no library for this CPU (x86-64 levels: {', '.join(levels) or 'none'})"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError(f"{missing} and there is no C++ compiler to build one")
    logger.warning("%s; compiling instead", missing)
    return None


def _cpu_fingerprint() -> str:
    """A short hash of what -march=native depends on, so a shared cache never serves a foreign CPU's build."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part"):
                    parts.append(line.strip())
                    if key in ("flags", "Features"):
                        break
    except OSError:
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _build_directory(root: Path | None = None) -> Path:
    """``<root>/torch_extensions/cpu_ops-<python>-<torch>-<cpu>-<sources hash>``."""
    digest = hashlib.sha256()
    for path in sources() + [_CSRC / name for name in _HEADER_NAMES]:
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(b"missing:" + path.name.encode())
    march = _march()
    tag = (
        f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.replace('+', '_')}"
        f"-{_cpu_fingerprint() if march == 'native' else march}-{digest.hexdigest()[:8]}"
    )
    return (root or _cache_root()) / "torch_extensions" / f"cpu_ops-{tag}"


def _ninja_on_path() -> bool:
    if shutil.which("ninja"):
        return True
    try:  # the PyPI `ninja` package; its binary may sit in a venv bin/ that is not on PATH
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


def _op_registered() -> bool:
    try:
        ns = getattr(torch.ops, OP_NAMESPACE)
        return all(hasattr(ns, op) for op in _OPS)
    except (AttributeError, RuntimeError):
        return False


@contextlib.contextmanager
def _build_guard(build_dir: Path):
    """One build per folder at a time, across processes, that a killed builder cannot wedge.

    torch's own guard is a lock *file* that a build killed midway (a timed-out test, a stopped pod) leaves
    behind, and every later build of that folder then waits on it forever. An flock is dropped by the kernel
    when its holder dies, so holding ours means nobody is building and any torch lock file is a leftover.
    A build still running elsewhere after _BUILD_WAIT_S is given up on (callers fall back to the references)."""
    with open(build_dir / "kubellm-build.lock", "a") as handle:
        deadline = time.monotonic() + _BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another process has been building {build_dir} for over "
                                       f"{_BUILD_WAIT_S:.0f} s") from None
                time.sleep(0.2)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing a build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stage_sources(build_dir: Path) -> list[Path]:
    """Copies of the sources and headers under ``build_dir/src``, what the build compiles.

    ninja records each source's path: compiled from two checkouts of the same sources (the folder is keyed by
    their content), each checkout's build would look stale to the other and rebuild over it. The copies keep
    that path the same; a copy is rewritten only when its bytes differ, so ninja's timestamps stay put."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for path in sources() + [_CSRC / name for name in _HEADER_NAMES]:
        target = staged / path.name
        data = path.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            target.write_bytes(data)
    return [staged / p.name for p in sources()]


def _build(load: bool = True) -> Path:
    """Compile (or load the cached build of) the extension into this process; returns the library's path.
    With ``load=False`` it only compiles (for a -march this CPU may not run)."""
    from torch.utils import cpp_extension

    missing = [str(p) for p in sources() + [_CSRC / name for name in _HEADER_NAMES] if not p.is_file()]
    if missing:
        raise RuntimeError(f"kernel sources {missing} are missing (not shipped with the package?)")
    if not _ninja_on_path():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not found)")
    build_dir = _build_directory()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home (e.g. a locked-down pod): build in the temp dir instead
        build_dir = _build_directory(Path(tempfile.gettempdir()) / f"kubellm-{os.getuid()}")
        build_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", *_march_cflags(_march()), "-fopenmp", "-DNDEBUG"]
    # cpp_extension.load always loads what it built, through this (private, long-stable) helper; swapping it
    # for one that only names the file is the way to compile without loading.
    import_library = cpp_extension._import_module_from_library
    if not load:
        cpp_extension._import_module_from_library = lambda name, path, is_python_module: os.path.join(
            path, name + ".so")
    fresh = not (build_dir / LIBRARY_NAME).is_file()
    if fresh:
        logger.info("building native CPU kernels for this CPU (-march=%s; first run only, about %d s) in %s",
                    _march(), _build_estimate_s(), build_dir)
    start = time.perf_counter()
    try:
        with _build_guard(build_dir):
            built = cpp_extension.load(
                name="kubellm_cpu_ops",
                sources=[str(p) for p in _stage_sources(build_dir)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    finally:
        cpp_extension._import_module_from_library = import_library
    if fresh:
        logger.info("built the native CPU kernels in %.0f s (cached for later starts)", time.perf_counter() - start)
    if load and not _op_registered():
        raise RuntimeError(f"the extension loaded but torch.ops.{OP_NAMESPACE} lacks one of {_OPS}")
    return Path(built) if isinstance(built, str) else build_dir / LIBRARY_NAME


def _build_estimate_s() -> int:
    """A full build's wall time: about 200 CPU-seconds (measured: 100 s on 2 cores), spread over at most one
    core per source."""
    return round(200 / max(1, min(os.cpu_count() or 1, len(_SOURCE_NAMES))))


def build_portable(out_dir: str | Path, march: str) -> Path:
    """Compile for ``march`` (e.g. x86-64-v3) and copy the library to ``out_dir/<march>/`` for
    ``KUBELLM_CPU_KERNELS_DIR``. One march per process: a process can load the ops only once.

    The library is loaded (which checks that every op registers) only when this CPU runs ``march``: a build
    for a level it lacks is compiled but not loaded, since even its op registration, run at load time, uses
    that level's instructions (the x86-64-v4 build's uses AVX-512 registers) and would kill the process."""
    if _op_registered():
        raise RuntimeError("the kernels are already loaded in this process; build each march in its own process")
    os.environ[MARCH_ENV] = march
    built = _build(load=march == "native" or march in supported_levels())
    target = Path(out_dir) / march / LIBRARY_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(built, target)
    return target


def available() -> bool:
    """True when the native kernels are usable; builds/loads them on the first call (thread-safe, once).

    False when ``KUBELLM_DISABLE_CPU_KERNELS=1`` is set, or (after one logged warning) when the build
    fails: no compiler, no ninja, compile error. Callers then use the PyTorch references.
    """
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return False
    if _state["tried"]:
        return bool(_state["ok"])
    with _lock:
        if not _state["tried"]:
            start = time.perf_counter()
            try:
                if not _op_registered():
                    library = _load_prebuilt()
                    _state["library"] = library or str(_build())
                _state["ok"] = True
            except Exception as e:  # noqa: BLE001 - any build/load failure means "fall back"
                _state["error"] = f"{type(e).__name__}: {e}"
                logger.warning("kubellm native CPU kernels unavailable, using the PyTorch references: %s",
                               _state["error"])
            _state["build_seconds"] = time.perf_counter() - start
            _state["tried"] = True
    return bool(_state["ok"])


def build_info() -> dict[str, object]:
    """Diagnostics: whether the kernels loaded, the failure if not, seconds spent building/loading, folder."""
    return {**_state, "build_directory": str(_build_directory())}
