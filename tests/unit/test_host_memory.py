"""A CPU training process (every engine on CPU: ``build_engine``) keeps the memory a step frees for the next step
(``parallel.host_memory``): the next step's allocations fault no fresh pages in, unless the user tunes the
allocator."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from trainbridge.parallel.host_memory import allocator_left_alone

# One "step": 400 blocks of 100 KiB (below every mmap threshold: from the heap) written, then all freed.  glibc's
# defaults trim the freed top of the heap back to the kernel, so later steps fault thousands of zeroed pages in again
# (1,100-7,700 a step here, depending on the process's earlier allocations).
STEPS = """
import ctypes, json, resource, sys
if sys.argv[1] == "tuned":
    from trainbridge.parallel.host_memory import keep_freed_host_memory
    assert keep_freed_host_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []
for step in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(100 << 10) for _ in range(400)]
    for block in blocks:
        libc.memset(block, 1, 100 << 10)
    for block in reversed(blocks):
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_a_step_reuses_the_pages_the_previous_step_freed() -> None:
    def faults(mode: str) -> list[int]:
        out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
        return list(json.loads(out.stdout))

    default, tuned = faults("default"), faults("tuned")
    assert sum(default[1:]) > 2_000, default  # glibc's defaults: the freed heap returned, faulted in again
    assert sum(tuned[1:]) < 300, tuned  # kept: the second step on reuses the first step's pages


def test_the_allocator_is_left_alone_where_the_user_tunes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    if platform.libc_ver()[0] != "glibc":
        assert "not glibc" in str(allocator_left_alone())
        return
    assert allocator_left_alone() is None
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert "MALLOC_TRIM_THRESHOLD_" in str(allocator_left_alone())
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert "LD_PRELOAD" in str(allocator_left_alone())
