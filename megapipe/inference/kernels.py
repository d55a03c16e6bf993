"""CPU kernels of the engine that torch has no operator for, compiled at first use for the CPU they run on.

- ``paged_attention`` (csrc/paged_attention.cpp): every row of a step (decodes and prefill chunks) attending to
  its keys and values in place in the paged pool, through the block tables;
- ``rms_norm``, ``add_rms_norm`` and ``rope_and_cache`` (csrc/layer_ops.cpp): a dense layer's elementwise work in
  one pass each (the residual add fused into the next norm; the rotary embedding fused with storing k and v);
- ``linear_bf16`` (csrc/linear_bf16.cpp, only on CPUs with AVX512-BF16): bf16 linear layers on weights packed by
  ``pack_bf16_weight``, with the bias, SiLU and a product fused into the epilogue.

They land in ``torch.ops.megapipe``. ``ops()`` returns that namespace, or None when the kernels cannot be built here
(no C++ compiler, a torch without its headers, ``MEGAPIPE_CPU_KERNELS=0``): the engine then keeps its pure-torch
path, which gives the same results up to round-off, and says so once in the log. The build goes through
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

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "layer_ops.cpp"]
BF16_SOURCES = [CSRC / "linear_bf16.cpp"]  # vdpbf16ps: built where the CPU has AVX512-BF16
# ATen's own flags for its vectorized kernels at each capability (what at::vec::Vectorized selects on)
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
VEC_WIDTH = {"AVX512": 16, "AVX2": 8}  # floats per vector; the attention kernel needs head_dim a multiple of it
SUPPORTED_VECTORS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)  # head_dim / vector_width() the attention is instantiated for
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def capability() -> str:
    """The instruction set torch dispatches to on this CPU ("AVX512", "AVX2", ...; "DEFAULT" for none)."""
    return torch.backends.cpu.get_cpu_capability()


def vector_width() -> int:
    return VEC_WIDTH.get(capability(), 8)


@functools.lru_cache(maxsize=None)
def ops():
    """``torch.ops.megapipe`` once the kernels are built and loaded, else None (the reason is logged)."""
    if os.environ.get("MEGAPIPE_CPU_KERNELS", "1") == "0":
        return None
    isa = capability()
    # -fopenmp: at::parallel_for is OpenMP inlined into the caller; -ffp-contract=off: no a * b + c fused into one
    # rounding where torch rounds twice
    flags = ["-O3", "-DNDEBUG", "-fopenmp", "-ffp-contract=off"]
    sources = list(SOURCES)
    if isa in ISA_FLAGS:
        flags += ISA_FLAGS[isa] + [f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    if has_avx512_bf16():
        flags.append("-mavx512bf16")
        sources += BF16_SOURCES
    digest = hashlib.sha1(" ".join(flags).encode())
    for source in sources:
        digest.update(source.read_bytes())
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name=f"megapipe_cpu_{isa.lower()}_{digest.hexdigest()[:10]}",
                           sources=[str(s) for s in sources], extra_cflags=flags, is_python_module=False,
                           verbose=False)
        return torch.ops.megapipe
    except Exception as exc:  # no compiler, no headers, a failed build: the torch path serves instead
        lines = str(exc).strip().splitlines()
        errors = [line.strip() for line in lines if "error" in line.lower()]
        log.warning("megapipe's CPU kernels could not be built (%s: %s); using the torch path",
                    type(exc).__name__, (errors or lines or [""])[0])
        return None


def has_avx512_bf16() -> bool:
    return capability() == "AVX512" and bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


def bf16_linear_built() -> bool:
    """``linear_bf16`` is built and loaded here (it reads its inputs in pairs: even in_features only)."""
    return has_avx512_bf16() and ops() is not None and hasattr(ops(), "linear_bf16")


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K/2, 16, 2]: 64-byte lines of 16 outputs x 2 consecutive inputs (zero rows pad N)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 16) * 16, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach()
    return padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def paged_attention() -> Optional[Callable]:
    found = ops()
    return None if found is None else found.paged_attention


def available(dtype: torch.dtype, device) -> bool:
    """The kernels run for tensors of this dtype on this device."""
    return torch.device(device).type == "cpu" and dtype in DTYPES and ops() is not None


def attention_kernel_for(head_dim: int, dtype: torch.dtype, device) -> Optional[Callable]:
    """The paged attention op for a model of this head size, dtype and device, or None (torch path)."""
    width = vector_width()
    if head_dim % width or head_dim // width not in SUPPORTED_VECTORS or not available(dtype, device):
        return None
    return paged_attention()
