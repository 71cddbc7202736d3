"""glibc malloc settings for CPU inference: keep freed activation buffers in the heap instead of unmapping them.

By default glibc serves large blocks (above a dynamic threshold) with mmap and returns them to the kernel on
free. A prefill step allocates and frees activations of several MB per layer, so every step page-faults
(and the kernel zeroes) tens of MB afresh: on 2 cores a 2048-token SmolLM2 step took 1.1-1.4 s instead of
0.68 s. With the mmap threshold at its maximum (32 MiB on 64-bit) and trimming off, those buffers are
recycled from the heap. This is what vLLM's CPU backend gets by preloading tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("kubellm.malloc")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)
TOP_PAD = 64 * 2**20

_done: bool | None = None


def tune() -> bool:
    """Apply the settings once per process; False where the C library is not glibc (nothing changes)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, TOP_PAD)))
    if not ok:
        log.warning("mallopt refused the CPU inference settings; prefill steps may page-fault their activations")
    _done = ok
    return ok
