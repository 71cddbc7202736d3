"""Builds and loads the native CPU kernels (``csrc/*.cpp``) as one torch extension, once per process.

Every source registers its ops under ``torch.ops.kubellm_cpu``. The extension is compiled with
``torch.utils.cpp_extension.load`` the first time :func:`available` is called and cached on disk under
``<kubellm cache>/torch_extensions/`` (``$KUBELLM_CACHE`` or ``~/.cache/kubellm``), in a folder keyed by the
torch/Python versions, the CPU (it is compiled with ``-march=native``) and the sources' hash. It needs a C++
compiler and ninja; without them, or with ``KUBELLM_DISABLE_CPU_KERNELS=1``, :func:`available` is False and
callers use the plain-PyTorch references that sit beside each kernel's wrapper.
"""

from __future__ import annotations

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
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCE_NAMES = ("paged_attention_cpu.cpp", "layer_ops_cpu.cpp", "prefill_attention_cpu.cpp")
OP_NAMESPACE = "kubellm_cpu"
# One op per source: the extension counts as loaded when all of them are registered.
_OPS = ("paged_decode_attention", "prefill_attention", "rms_norm", "add_rms_norm_", "silu_and_mul", "rotary_embedding_")
_STALE_LOCK_S = 600.0

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ok": False, "error": None, "build_seconds": None}


def sources() -> list[Path]:
    return [_CSRC / name for name in _SOURCE_NAMES]


def _cache_root() -> Path:
    # Same rule as kubellm.runtime.model_store.cache_root (kept local: kernels do not import the runtime).
    if env := os.environ.get("KUBELLM_CACHE"):
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kubellm"


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
    for path in sources():
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(b"missing:" + path.name.encode())
    tag = (
        f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.replace('+', '_')}"
        f"-{_cpu_fingerprint()}-{digest.hexdigest()[:8]}"
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


def _build() -> None:
    from torch.utils import cpp_extension

    missing = [str(p) for p in sources() if not p.is_file()]
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
    # torch's build lock: a process killed mid-build leaves it behind, and every later build would wait on it
    # forever. A real build takes well under a minute, so a lock older than _STALE_LOCK_S is stale.
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            logger.warning("removing stale extension build lock %s", lock)
            lock.unlink(missing_ok=True)
    except OSError:
        pass
    flags = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
    cpp_extension.load(
        name="kubellm_cpu_ops",
        sources=[str(p) for p in sources()],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    if not _op_registered():
        raise RuntimeError(f"the extension loaded but torch.ops.{OP_NAMESPACE} lacks one of {_OPS}")


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
                    _build()
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
