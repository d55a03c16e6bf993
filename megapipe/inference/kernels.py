"""CPU kernels of the engine that torch has no operator for, compiled at first use for the CPU they run on.

``paged_decode_attention()`` returns the op ``torch.ops.megapipe.paged_decode_attention`` (csrc/paged_attention.cpp)
or None when it cannot be built here (no C++ compiler, a torch without its headers): the engine then keeps its
pure-torch path, which gives the same results up to round-off, and says so once in the log. The build goes through
``torch.utils.cpp_extension`` into its cache (``TORCH_EXTENSIONS_DIR``, default ~/.cache/torch_extensions), one per
source version and instruction set, so only the first engine on a machine pays the ~20 s compile.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# ATen's own flags for its vectorized kernels at each capability (what at::vec::Vectorized selects on)
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
VEC_WIDTH = {"AVX512": 16, "AVX2": 8}  # floats per vector; the kernel needs head_dim a multiple of it


def capability() -> str:
    """The instruction set torch dispatches to on this CPU ("AVX512", "AVX2", ...; "DEFAULT" for none)."""
    return torch.backends.cpu.get_cpu_capability()


@functools.lru_cache(maxsize=None)
def paged_decode_attention() -> Optional[Callable]:
    if os.environ.get("MEGAPIPE_CPU_KERNELS", "1") == "0":
        return None
    isa = capability()
    flags = ["-O3", "-DNDEBUG", "-fopenmp"]
    if isa in ISA_FLAGS:
        flags += ISA_FLAGS[isa] + [f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    tag = hashlib.sha1(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:10]
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name=f"megapipe_paged_attention_{isa.lower()}_{tag}", sources=[str(SOURCE)],
                           extra_cflags=flags, is_python_module=False, verbose=False)
        return torch.ops.megapipe.paged_decode_attention
    except Exception as exc:  # no compiler, no headers, a failed build: the torch path serves instead
        log.warning("the paged decode attention kernel could not be built (%s: %s); using the torch path",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


def vector_width() -> int:
    return VEC_WIDTH.get(capability(), 8)


SUPPORTED_VECTORS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)  # head_dim / vector_width() the kernel is instantiated for


def decode_kernel_for(head_dim: int, dtype: torch.dtype, device) -> Optional[Callable]:
    """The paged decode attention op for a model of this head size, dtype and device, or None (torch path)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    width = vector_width()
    if head_dim % width or head_dim // width not in SUPPORTED_VECTORS:
        return None
    return paged_decode_attention()
