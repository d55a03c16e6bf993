"""Keep freed memory inside the process when training on CPU, as PyTorch's caching allocator does on GPUs.

glibc hands every freed block larger than its mmap threshold (32 MB at most) straight back to the kernel, so each
training step faults fresh, zeroed pages back in for its large tensors (the loss's logits buffer, the embedding and
output-weight gradients, big activations): ~80k page faults per step of the benchmark model, 5-10% of its step time
on 2 cores, plus the unmapping in ``zero_grad``. With mmap off for large blocks and no trimming, freed blocks stay in
the heap for the next step. The process does not shrink below its peak, and the peak grows a little from heap
fragmentation (a few %, measured by tools/bench_train.py). Does nothing outside glibc (musl, macOS) or when
jemalloc/tcmalloc is preloaded (they keep their own caches and glibc's settings no longer matter).
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_done = False


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory (process-wide, once); True when the settings took."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return _done
