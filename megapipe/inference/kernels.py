"""CPU kernels of the engine that torch has no operator for, compiled at first use for the CPU they run on.

- ``paged_attention`` (csrc/paged_attention.cpp): every row of a step (decodes and prefill chunks) attending to
  its keys and values in place in the paged pool, through the block tables; a bf16 prefill's scores and weighted
  values on AMX tiles where the CPU has them (``amx=False`` takes the fp32 loop);
- ``rms_norm``, ``add_rms_norm`` and ``rope_and_cache`` (csrc/layer_ops.cpp): a dense layer's elementwise work in
  one pass each (the residual add fused into the next norm; the rotary embedding fused with storing k and v);
- ``mamba_step`` (csrc/mamba_step.cpp): a Mamba-2 layer's decode token for a batch in one pass over its states;
- ``linear_bf16`` (csrc/linear_bf16.cpp, only on CPUs with AVX512-BF16): bf16 linear layers on weights packed by
  ``pack_bf16_weight``, with the bias, SiLU and a product fused into the epilogue, and optionally a second input
  ``x2`` for the weight's last inputs (LoRA's low-rank sums; with ``x2_start`` / ``out_start``, each row's band of
  x2 or of the outputs, its own adapter's, outside which the loop takes no products); on AMX tiles where the CPU
  has them (built with -mamx-tile/-mamx-bf16 there; ``amx=False`` takes the loop, on vdpbf16ps or fp32 FMAs as
  ``bf16_loop`` measured faster); ``glu_bf16`` a SwiGLU's gate and up projections in one call,
  silu(x Wg^T) * (x Wu^T);
- ``linear_f32`` (csrc/linear_f32.cpp, on AVX-512 CPUs): the same for fp32, on weights packed by ``pack_f32_weight``.

They land in ``torch.ops.megapipe``. ``ops()`` returns that namespace, or None when the kernels cannot be built here
(no C++ compiler, a torch without its headers, ``MEGAPIPE_CPU_KERNELS=0``): the engine then keeps its pure-torch
path, which gives the same results up to round-off, and says so once in the log. The build goes through
``torch.utils.cpp_extension`` into its cache (``TORCH_EXTENSIONS_DIR``, default ~/.cache/torch_extensions, folder
megapipe/), one per source version and instruction set, so only the first engine on a machine pays the compile
(20 s to two minutes), and it says so on stderr while it lasts.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "layer_ops.cpp", CSRC / "mamba_step.cpp"]
BF16_SOURCES = [CSRC / "linear_bf16.cpp"]  # vdpbf16ps: built where the CPU has AVX512-BF16
F32_SOURCES = [CSRC / "linear_f32.cpp"]  # AVX-512 only
HEADERS = [CSRC / "linear_tiles.h", CSRC / "bf16_epilogue.h", CSRC / "parallel_tasks.h", CSRC / "amx_tiles.h",
           CSRC / "bf16_widen.h"]
# ATen's own flags for its vectorized kernels at each capability (what at::vec::Vectorized selects on)
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
VEC_WIDTH = {"AVX512": 16, "AVX2": 8}  # floats per vector; the attention kernel needs head_dim a multiple of it
# head_dim / vector_width() the attention is instantiated for; 36 (AVX512) and 72 (AVX2): multi-latent attention's
# latent row of DeepSeek's widths (kv_lora_rank 512 + rope 64 = 576 values per token)
SUPPORTED_VECTORS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 36, 72)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def capability() -> str:
    """The instruction set torch dispatches to on this CPU ("AVX512", "AVX2", ...; "DEFAULT" for none)."""
    return torch.backends.cpu.get_cpu_capability()


def vector_width() -> int:
    return VEC_WIDTH.get(capability(), 8)


def _build_spec() -> tuple[str, list[Path], list[str]]:
    """(extension name, sources, compiler flags) for this CPU; the name changes with the sources and flags."""
    isa = capability()
    # -fopenmp: at::parallel_for is OpenMP inlined into the caller; -ffp-contract=off: no a * b + c fused into one
    # rounding where torch rounds twice
    flags = ["-O3", "-DNDEBUG", "-fopenmp", "-ffp-contract=off"]
    sources = list(SOURCES)
    if isa in ISA_FLAGS:
        flags += ISA_FLAGS[isa] + [f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}"]
    if isa == "AVX512":
        sources += F32_SOURCES
    if has_avx512_bf16():
        flags.append("-mavx512bf16")
        if has_amx():  # linear_bf16 and the prefill's attention on AMX tiles (built in, used where Linux lets them)
            flags += ["-mamx-tile", "-mamx-bf16"]
        sources += BF16_SOURCES
    digest = hashlib.sha1(" ".join(flags).encode())
    for source in sources + HEADERS:
        digest.update(source.read_bytes())
    return f"megapipe_cpu_{isa.lower()}_{digest.hexdigest()[:10]}", sources, flags


def build_directory(name: str) -> Path:
    """Where the extension ``name`` is built: under TORCH_EXTENSIONS_DIR (default: torch's cache folder)."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / "megapipe" / name


def needs_build(name: Optional[str] = None) -> bool:
    """Loading the kernels compiles them (no library built from these sources yet): what the notice is for."""
    name = name or _build_spec()[0]
    return not (build_directory(name) / f"{name}.so").is_file()


@contextlib.contextmanager
def build_notice(building: bool, every_s: float = 20.0):
    """While ``building``: say so on stderr at the start, every ``every_s`` seconds, and at the end (a first engine
    on a machine is otherwise silent for the minute or two the compiler takes)."""
    if not building:
        yield
        return
    start, done = time.monotonic(), threading.Event()

    def heartbeat():
        while not done.wait(every_s):
            print(f"megapipe: still building CPU kernels ({time.monotonic() - start:.0f} s) ...", file=sys.stderr,
                  flush=True)

    print("megapipe: building CPU kernels (once for this CPU and version; a minute or two) ...", file=sys.stderr,
          flush=True)
    thread = threading.Thread(target=heartbeat, daemon=True)
    thread.start()
    outcome = "failed (the torch path serves instead)"
    try:
        yield
        outcome = "built"
    finally:
        done.set()
        thread.join()
        print(f"megapipe: CPU kernels {outcome} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


@contextlib.contextmanager
def build_lock(build: Path):
    """One megapipe process at a time builds or loads the kernels in ``build``, under an flock the system releases
    when its holder dies. torch's own ``lock`` file is left behind by a build that was killed, and torch then waits
    for it forever (silently); held here, that file can only be such a leftover, so it is removed."""
    import fcntl

    with open(build / "megapipe.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build / "lock"
        if stale.exists():
            log.warning("removing %s, left by a kernel build that was stopped", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.lru_cache(maxsize=None)
def ops():
    """``torch.ops.megapipe`` once the kernels are built and loaded, else None (the reason is logged)."""
    if os.environ.get("MEGAPIPE_CPU_KERNELS", "1") == "0":
        return None
    name, sources, flags = _build_spec()
    try:
        from torch.utils import cpp_extension

        build = build_directory(name)
        build.mkdir(parents=True, exist_ok=True)
        with build_lock(build), build_notice(needs_build(name)):
            cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=flags,
                               build_directory=str(build), is_python_module=False, verbose=False)
        return torch.ops.megapipe
    except Exception as exc:  # no compiler, no headers, a failed build: the torch path serves instead
        lines = str(exc).strip().splitlines()
        errors = [line.strip() for line in lines if "error" in line.lower()]
        log.warning("megapipe's CPU kernels could not be built (%s: %s); using the torch path",
                    type(exc).__name__, (errors or lines or [""])[0])
        return None


# oneDNN's ISA caps (its ONEDNN_MAX_CPU_ISA) under which it uses no AVX512-BF16 / no AMX: megapipe's kernels then
# leave them alone too, so one variable makes an AMX machine run as a CPU without them (and measure that way)
ONEDNN_BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})
ONEDNN_BELOW_AMX = ONEDNN_BELOW_BF16 | {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512"}


def onednn_cap() -> str:
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").strip().upper()


def has_avx512_bf16() -> bool:
    return (capability() == "AVX512" and bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
            and onednn_cap() not in ONEDNN_BELOW_BF16)


def has_amx() -> bool:
    """The CPU has AMX tiles (oneDNN then runs bf16 matmuls on them) and ONEDNN_MAX_CPU_ISA does not exclude them."""
    return (bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
            and onednn_cap() not in ONEDNN_BELOW_AMX)


def isa_summary() -> str:
    """What decides the kernels here, for logs and benchmark output: torch's capability plus the bf16 extensions."""
    extras = [name for name, present in (("avx512_bf16", has_avx512_bf16()), ("amx", has_amx())) if present]
    return "+".join([capability()] + extras)


BF16_LINEAR_CHOICES = ("auto", "own", "onednn")
CHOICE_ROWS = (1, 2, 4, 8, 16, 32, 64)  # decode batches up to prefill chunks: where the two kernels cross over
OWN_ALWAYS = sys.maxsize  # a row limit for megapipe's kernel that every matmul is under


def _fastest_seconds(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """The fastest of ``reps`` calls of each of ``runs``, the calls taking turns: another process sharing the cores
    only ever adds time, and a slice of it (a few ms) then slows one call of each rather than all calls of one (one
    after the other, 15 calls of 150 us fit in one such slice: megapipe's kernel measured 231 us to oneDNN's 112 at
    16 rows on AMD's Zen 4, where it is the faster one)."""
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def measure_bf16_linear(n: int, k: int, reps: int = 15) -> dict[int, dict[str, float]]:
    """Seconds one bf16 matmul on an [n, k] weight takes at each of CHOICE_ROWS rows, on megapipe's kernel (``own``)
    and on oneDNN's packed matmul (``onednn``); the two taking turns so a load change hits both."""
    from megapipe import torch_compat

    weight = torch.randn(n, k).bfloat16()
    own_w, onednn_w = pack_bf16_weight(weight), torch_compat.reorder_linear_weight(weight, 16)

    def runs_at(m: int) -> dict:
        x, out = torch.randn(m, k).bfloat16(), torch.empty(m, n, dtype=torch.bfloat16)
        return {"own": functools.partial(ops().linear_bf16, x, own_w, n, None, False, None, out),
                "onednn": functools.partial(torch_compat.linear_pointwise, x, onednn_w, None, "none")}

    return _fastest_at_rows(CHOICE_ROWS, runs_at, reps)


def _fastest_at_rows(rows, runs_at: Callable[[int], dict], reps: int) -> dict[int, dict[str, float]]:
    """{m: _fastest_seconds of the calls ``runs_at(m)`` returns} for each row count m, each call made once untimed
    first (oneDNN builds its primitive there)."""
    times = {}
    with torch.inference_mode():
        for m in rows:
            runs = runs_at(m)
            for fn in runs.values():
                fn()
            times[m] = _fastest_seconds(runs, reps)
    return times


OWN_EDGE = 1.05  # how much faster oneDNN must measure for a row count to go to it (own_row_limit)


def own_row_limit(times: dict[int, dict[str, float]]) -> int:
    """The most rows a matmul may have and still run on megapipe's kernel: the split of the measured row counts
    (megapipe's kernel up to it, oneDNN's above) that costs least, each row count's time taken relative to its
    faster kernel's, so that one noisy measurement moves the split less than a first-crossover rule would (0: oneDNN
    only; OWN_ALWAYS: megapipe's at every count measured). megapipe's times count OWN_EDGE less: its kernel also
    serves what the measurement does not see (a greedy head's argmax without logits, direct kernel calls per layer,
    LoRA's extra inputs), and on AMD's Zen 4, where the two are within ~5% from 64 rows up (1024 rows: equal), the
    plain rule sent 64-row decode steps to oneDNN in 2 of 4 engine starts on noise alone."""
    rows = sorted(times)

    def cost(limit: int) -> float:
        return sum((times[m]["own"] / OWN_EDGE if m <= limit else times[m]["onednn"]) / min(times[m].values())
                   for m in rows)

    return min([0] + rows[:-1] + [OWN_ALWAYS], key=cost)  # min keeps the first (smallest) of equal costs


def describe_row_limit(limit: int) -> str:
    if limit == OWN_ALWAYS:
        return "megapipe"
    if limit == 0:
        return "oneDNN"
    return f"megapipe up to {limit} rows, oneDNN above"


def choose_bf16_linear(setting: str, n: int, k: int) -> tuple[int, str]:
    """The most rows a bf16 matmul may have to run on megapipe's kernel (above it oneDNN's runs; 0: oneDNN only,
    OWN_ALWAYS: megapipe's only), and why in one line. ``auto`` measures both on the model's widest layer weight
    [n, k] at CHOICE_ROWS rows: on AVX512-BF16 CPUs without AMX the own vdpbf16ps loop wins a decode's few rows
    and oneDNN may win from some row count up (both layouts are then kept: the weights twice); on AMX CPUs the own
    kernel multiplies AMX tiles itself and measured faster than oneDNN at every count (a oneDNN call costs ~20 us
    before any arithmetic). A measurement settles it on whatever CPU this is."""
    if setting not in BF16_LINEAR_CHOICES:
        raise ValueError(f"bf16_linear = {setting!r} must be one of {', '.join(BF16_LINEAR_CHOICES)}")
    if not bf16_linear_built():
        return 0, f"bf16 matmuls on oneDNN (megapipe's kernel needs AVX512-BF16; this CPU: {isa_summary()})"
    if setting != "auto":
        limit = OWN_ALWAYS if setting == "own" else 0
        return limit, f"bf16 matmuls on {describe_row_limit(limit)} (as set)"
    return _measured_choice(n, k)


@functools.lru_cache(maxsize=None)
def _measured_choice(n: int, k: int) -> tuple[int, str]:
    """choose_bf16_linear's measurement, once per process and shape: every engine of a process (RL rebuilds them,
    tests compare two) then runs the same kernels, so their outputs agree to the bit."""
    times = measure_bf16_linear(n, k)
    limit = own_row_limit(times)
    measured = ", ".join(f"{m}: {t['own'] * 1e6:.0f}/{t['onednn'] * 1e6:.0f}" for m, t in times.items())
    loop = "" if has_amx() else "; megapipe's loop on {} ({})".format(*bf16_loop())
    return limit, (f"bf16 matmuls on {describe_row_limit(limit)} ({isa_summary()}; measured on a {n}x{k} weight, "
                   f"rows: megapipe/oneDNN us: {measured}{loop})")


def bf16_loop() -> tuple[str, str]:
    """How megapipe's bf16 loop (the kernel without AMX tiles) multiplies here, and why: ``vdpbf16ps`` (two
    products per lane and instruction) or ``fma`` (the values widened to fp32: on the 2-vCPU AMX Xeon these
    figures come from, run without AMX, that loop makes ~1.5x the products per second; on AMD's Zen 4, whose
    vdpbf16ps retires at the FMAs' rate, the vdpbf16ps loop makes ~2.2x), chosen by a ~2 ms measurement at first
    use."""
    return tuple(ops().bf16_loop(""))


def bf16_linear_built() -> bool:
    """``linear_bf16`` is built and loaded here (it reads its inputs in pairs: even in_features only)."""
    return has_avx512_bf16() and ops() is not None and hasattr(ops(), "linear_bf16")


GLU_ROWS = (8, 64)  # the row counts glu_choice times: a decode's, and a batch's


def _two_calls(x: torch.Tensor, weight: list, n: int, gate: torch.Tensor, out: torch.Tensor) -> None:
    """The gate's SiLU and then the product with the up projection, in the two linear calls' epilogues."""
    ops().linear_bf16(x, weight[0], n, None, True, None, gate)
    ops().linear_bf16(x, weight[1], n, None, False, gate, out)


def glu_fused(n: int, k: int) -> bool:
    """``glu_bf16`` serves a SwiGLU's gate and up projections, [n, k] each, in one call (glu_choice)."""
    return glu_choice(n, k)[0]


@functools.lru_cache(maxsize=None)
def glu_choice(n: int, k: int) -> tuple[bool, str]:
    """Whether a SwiGLU's gate and up projections ([n, k] each) run as one ``glu_bf16`` call (each block both
    halves' tiles of the same outputs: the gate is never written out and read back, and the SiLU and product are
    taken on the fp32 sums before one rounding) rather than two linear calls, and why in one line. On AMX tiles
    (k a multiple of 32) always. On the loop a block holds 8 rows of 2 tiles against the linear's 3, which costs
    where vdpbf16ps is slow (a decode's 8 rows ~1.45x the two calls on the AMX Xeon run without AMX) and gains
    where it is fast (AMD's Zen 4: 1.10x at 8 rows, 1.03x at 64, 1.05x at 1024), so there a measurement at first
    use decides: the fused call where it is the faster at GLU_ROWS, the two kernels taking turns."""
    if not (bf16_linear_built() and hasattr(ops(), "glu_bf16")):
        return False, "SwiGLU gate and up as two calls (no megapipe bf16 kernel here)"
    if has_amx():
        fused = k % 32 == 0
        return fused, f"SwiGLU gate and up {'in one call' if fused else 'as two calls'} on AMX tiles"
    weight = [pack_bf16_weight(torch.randn(n, k).bfloat16() * 0.05) for _ in range(2)]

    def runs_at(m: int) -> dict:
        x = torch.randn(m, k).bfloat16()
        gate, out = (torch.empty(m, n, dtype=torch.bfloat16) for _ in range(2))
        return {"glu": functools.partial(ops().glu_bf16, x, weight[0], weight[1], n, out),
                "two": functools.partial(_two_calls, x, weight, n, gate, out)}

    times = _fastest_at_rows(GLU_ROWS, runs_at, 15)
    fused = all(t["glu"] < t["two"] for t in times.values())
    measured = ", ".join(f"{m}: {t['glu'] * 1e6:.0f}/{t['two'] * 1e6:.0f}" for m, t in times.items())
    return fused, (f"SwiGLU gate and up {'in one call' if fused else 'as two calls'} (measured on {n}x{k} weights, "
                   f"rows: one call/two calls us: {measured})")


def f32_linear_built() -> bool:
    """``linear_f32`` is built and loaded here (AVX-512 CPUs)."""
    return capability() == "AVX512" and ops() is not None and hasattr(ops(), "linear_f32")


def pack_f32_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> [ceil(N/16), K, 16]: 64-byte lines of 16 outputs (zero rows pad N)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 16) * 16, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(-1, 16, k).transpose(1, 2).contiguous()


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K/2, 16, 2]: 64-byte lines of 16 outputs x 2 consecutive inputs (zero rows pad N)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 16) * 16, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach()
    return padded.view(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_bf16_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_bf16_weight's inverse: the [n, K] weight it was packed from."""
    return packed.permute(0, 2, 1, 3).reshape(-1, packed.shape[1] * 2)[:n]


def unpack_f32_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_f32_weight's inverse."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


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
