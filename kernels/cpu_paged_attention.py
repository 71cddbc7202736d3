"""Paged-attention decode on CPU: a native C++ kernel (compiled on first use) beside a PyTorch reference.

One query token per sequence attends to that sequence's context, read in place from the paged K/V pool:

* ``q`` ``[B, num_heads, head_dim]``; ``k_cache``/``v_cache``
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the project-wide pool layout); all float32,
  bfloat16 or float16 alike.
* ``block_tables`` ``[B, max_blocks]`` int32 (rows padded; entries past a sequence's blocks are never read);
  ``context_lens`` ``[B]`` int32 (>= 1). Token ``t`` of sequence ``b`` lives in block ``block_tables[b, t //
  block_size]`` at offset ``t % block_size``.
* GQA: query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``.
* Returns ``[B, num_heads, head_dim]`` in ``q``'s dtype; scores, softmax and accumulation are fp32.

The kernel (``csrc/paged_attention_cpu.cpp``) is built with ``torch.utils.cpp_extension.load`` the first time
:func:`available` or :func:`paged_decode_attention` is called, once per process, and cached on disk under
``<kubellm cache>/torch_extensions/`` (``$KUBELLM_CACHE`` or ``~/.cache/kubellm``), in a folder keyed by the
torch/Python versions, the CPU (it is compiled with ``-march=native``) and the source's hash. It needs a C++
compiler and ninja; without them, or with ``KUBELLM_DISABLE_CPU_KERNELS=1``, :func:`available` is False and
callers use :func:`reference_paged_decode_attention`.
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
_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
_OP_NAMESPACE = "kubellm_cpu"
# Tokens per chunk of the kernel's online softmax (scores for the chunk, one rescale, then V accumulation).
_CHUNK_TOKENS = 128
_STALE_LOCK_S = 600.0

_lock = threading.Lock()
_state: dict[str, object] = {"tried": False, "ok": False, "error": None, "build_seconds": None}


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
    """``<root>/torch_extensions/paged_attention_cpu-<python>-<torch>-<cpu>-<source hash>``."""
    try:
        source = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:8]
    except OSError:
        source = "missing"
    tag = (
        f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.replace('+', '_')}"
        f"-{_cpu_fingerprint()}-{source}"
    )
    return (root or _cache_root()) / "torch_extensions" / f"paged_attention_cpu-{tag}"


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
        return hasattr(getattr(torch.ops, _OP_NAMESPACE), "paged_decode_attention")
    except (AttributeError, RuntimeError):
        return False


def _build() -> None:
    from torch.utils import cpp_extension

    if not _SOURCE.is_file():
        raise RuntimeError(f"kernel source {_SOURCE} is missing (not shipped with the package?)")
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
        name="kubellm_paged_attention_cpu",
        sources=[str(_SOURCE)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    if not _op_registered():
        raise RuntimeError("the extension loaded but torch.ops.kubellm_cpu.paged_decode_attention is missing")


def available() -> bool:
    """True when the native kernel is usable; builds/loads it on the first call (thread-safe, once a process).

    False when ``KUBELLM_DISABLE_CPU_KERNELS=1`` is set, or (after one logged warning) when the build
    fails: no compiler, no ninja, compile error. Callers then use :func:`reference_paged_decode_attention`.
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
                logger.warning(
                    "kubellm CPU paged-attention kernel unavailable, using the PyTorch reference: %s",
                    _state["error"],
                )
            _state["build_seconds"] = time.perf_counter() - start
            _state["tried"] = True
    return bool(_state["ok"])


def build_info() -> dict[str, object]:
    """Diagnostics: whether the kernel loaded, the failure if not, seconds spent building/loading, folder."""
    return {**_state, "build_directory": str(_build_directory())}


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    chunk: int | None = None,
    partition: int = 0,
) -> torch.Tensor:
    """Decode attention with the native kernel (see the module docstring for shapes). Raises if unavailable.

    ``chunk`` (tokens per online-softmax chunk, 1..512) and ``partition`` (split each sequence into pieces of
    this many tokens, merged at the end; 0 = only when there are fewer (sequence, kv head) pairs than twice
    the threads) are tuning knobs; the defaults are what the benchmarks chose.
    """
    if not available():
        raise RuntimeError(
            f"the CPU paged-attention kernel is unavailable ({_state['error'] or DISABLE_ENV + ' is set'}); "
            "use reference_paged_decode_attention"
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    if context_lens.dtype != torch.int32 or not context_lens.is_contiguous():
        context_lens = context_lens.to(torch.int32).contiguous()
    return torch.ops.kubellm_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, float(scale), chunk or _CHUNK_TOKENS, partition
    )


def reference_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-PyTorch decode attention, same contract: per sequence, gather its blocks, attend in fp32."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b in range(batch):
        length = int(context_lens[b])
        num_blocks = -(-length // block_size)
        blocks = block_tables[b, :num_blocks].long()
        # [num_blocks, block_size, KVH, D] -> [tokens, KVH, D], cut to the context (the tail may be garbage).
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]: query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, v).to(q.dtype)
    return out
