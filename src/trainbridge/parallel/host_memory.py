"""Host memory of a CPU training process (``build_engine``): glibc's ``malloc`` keeps freed memory for the next step.

A CPU step allocates and frees the same activations and gradients every time.  glibc's defaults hand large
freed blocks back to the kernel (``munmap``, heap trimming), so the next step faults fresh zeroed pages in
again: on the benchmark Llama ~1,500 minor page faults and 2-9 ms of kernel time per step, which a bare
loop pays.  ``keep_freed_host_memory`` raises the trim threshold and the ``mmap`` threshold once (what
``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_`` set at start-up), so a step reuses the previous
step's pages (~50 faults, <1 ms).  Same values bit for bit (torch aligns CPU tensors itself); the peak RSS is
unchanged (the pages kept are the ones the peak step used).  Blocks above ``MMAP_THRESHOLD`` (a full state-dict
copy) are still mapped and returned.  Not applied where the user tunes the allocator (``MALLOC_*_``
variables, an ``LD_PRELOAD``ed allocator) or on a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameter numbers (glibc's ``malloc.h``)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of the heap kept rather than returned to the kernel, bytes."""
MMAP_THRESHOLD = 32 << 20
"""Allocations at least this large are mapped on their own (and unmapped when freed), bytes: the largest
value every glibc accepts (the top of its own dynamic threshold)."""
USER_TUNING = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_applied = False


def allocator_left_alone() -> str | None:
    """Why this process's allocator is not tuned (None: it is tunable)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'unknown libc'})"
    user = [name for name in USER_TUNING if name in os.environ]
    if user:
        return f"the allocator is tuned by the environment ({', '.join(user)})"
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return "another allocator is preloaded (LD_PRELOAD)"
    return None


def keep_freed_host_memory() -> bool:
    """Set glibc's trim and ``mmap`` thresholds for a training process (once); False where it is left alone
    (``allocator_left_alone``) or ``mallopt`` refuses."""
    global _applied
    if _applied:
        return True
    reason = allocator_left_alone()
    if reason is not None:
        logger.debug("host allocator left as it is: %s", reason)
        return False
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _applied = bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    )
    return _applied
