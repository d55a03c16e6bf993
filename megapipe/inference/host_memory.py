"""Host memory for decoding on CPU: transparent huge pages under the weights, big buffers kept by the allocator.

Every decode step streams all weights from DRAM. With 4 KiB pages, a stream of 270 MB crosses 66 000 pages and the
page walks behind those TLB misses cost about a third of the matmul time of SmolLM2-135M at batch 8 on a 2-vCPU
EPYC (linears of 30 layers 16.5 -> 11.4 ms, decode step 35 -> 28 ms; tools/bench_generate.py). Most distributions
run THP in "madvise" mode: only memory a process asks for gets huge pages, and PyTorch does not ask. So once the
weights are packed, :func:`collapse_resident_memory` asks the kernel: ``MADV_HUGEPAGE`` on the process's resident
anonymous mappings, then ``MADV_COLLAPSE`` (Linux >= 6.1) to turn their pages into huge ones at once rather than
whenever khugepaged gets there. Only mappings already (nearly) fully resident are collapsed, so memory use does not
grow by filling sparse ones; the KV pool is among them (zero-filled when it is allocated).

:func:`keep_freed_buffers` stops glibc from returning every freed activation buffer to the kernel (its default
``mmap`` threshold starts at 128 KiB), which made each prefill step page-fault its temporaries in anew.

Everything here is best effort: on other systems, older kernels or with THP off, the calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from pathlib import Path
from typing import Optional

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=1)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def thp_mode() -> Optional[str]:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"), None where there is none."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def _aligned(lo: int, hi: int) -> tuple[int, int]:
    return (lo + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), hi & ~(HUGE_PAGE - 1)


def mappings(smaps: str):
    """(start, end, permissions, path, {field: bytes}) of each mapping in a /proc/<pid>/smaps text."""
    current = None
    for line in smaps.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:
            if current is not None:
                yield current
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            current = (lo, hi, head[1], head[5] if len(head) > 5 else "", {})
        elif current is not None and len(head) == 3 and head[2] == "kB":
            current[4][head[0].rstrip(":")] = int(head[1]) * 1024
    if current is not None:
        yield current


def _anonymous_mappings(smaps: str):
    """(start, end, resident bytes) of each private, writable mapping without a file behind it."""
    for start, end, perms, path, fields in mappings(smaps):
        if perms.startswith("rw") and perms[3] == "p" and path in ("", "[heap]"):
            yield start, end, fields.get("Rss", 0)


def collapse_resident_memory(min_resident: float = 0.9) -> int:
    """Back the process's resident anonymous memory (mappings of >= 2 MiB, at least ``min_resident`` of them in
    memory) with transparent huge pages now; returns the bytes advised (0 where THP is unavailable)."""
    libc = _libc()
    if libc is None or thp_mode() in (None, "never"):
        return 0
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    done = 0
    for start, end, resident in _anonymous_mappings(smaps):
        lo, hi = _aligned(start, end)
        if hi - lo < HUGE_PAGE or resident < min_resident * (end - start):
            continue
        if libc.madvise(lo, hi - lo, MADV_HUGEPAGE) == 0:
            libc.madvise(lo, hi - lo, MADV_COLLAPSE)  # EINVAL before Linux 6.1: khugepaged collapses them later
            done += hi - lo
    return done


def keep_freed_buffers(threshold: int = 32 << 20) -> bool:
    """Serve allocations below ``threshold`` from the heap and do not trim it: freed activation buffers are reused
    without page faults (glibc only; process-wide, as tcmalloc or jemalloc would be)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
