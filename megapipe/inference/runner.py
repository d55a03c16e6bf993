"""Runs the model for one engine step: the flattened batch through the paged cache, logits for the rows asked for.

On CPU the linear layers are swapped for oneDNN ones with the weight pre-packed once into the blocked layout the
kernel reads (what inductor's freezing and IPEX do), q/k/v fused into one matmul, and the swiglu MLP's SiLU and
product done by oneDNN on the matmul results (post-ops): ~1.5x faster matmuls for the small batches of decoding
and no elementwise passes over the MLP's activations. bf16 matmuls run on megapipe's own kernel (csrc/linear_bf16.cpp:
vdpbf16ps, or AMX tiles) at the row counts where a measurement at start finds it faster (kernels.choose_bf16_linear;
on AMX CPUs all of them), fp32 matmuls on megapipe's own kernel where it is built (AVX-512: csrc/linear_f32.cpp),
which streams the weights of a decode step ~1.4x faster than oneDNN's. The values
differ from the plain modules' by round-off only: in fp32 in the last bits (greedy parity with HF and logprobs
within 1e-4 of a full forward hold, tests/inference); in bf16 the fused SiLU and product are taken before rounding
to bf16 rather than after. The model object is the engine's to modify.

Plain dense and MoE blocks (Llama / Qwen2 / Qwen3 / Mistral, Mixtral / Qwen2-MoE / Qwen3-MoE shapes) run through
:class:`DecoderLayer`, the same arithmetic as the module's forward in a third of the operations: decoding a small model on CPU is otherwise dominated by the
per-operation overhead of ~70 small tensor operations per layer, not by the matmuls. Other blocks (multi-latent
attention's, whose cache is the latent pool of megapipe.inference.kv_cache; a hybrid model's Mamba, attention and
MLP layers, whose Mamba mixers keep their state in megapipe.inference.state_cache) run through the model's own
forward, their linears packed all the same (the Mamba mixer calls its projections as modules).

``ModelRunner.execute`` takes the scheduler's plan of a step (megapipe.inference.scheduler.SchedulerOutput), lays
out the flattened batch and which of its rows need logits (the one place that does), runs it, and samples: one
:class:`RunnerOutput`, which the engine applies (``LLMEngine.update_from_output``).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

import megapipe.inference.kernels as kernels  # the module alone: the package's __init__ imports the engine
from megapipe import torch_compat
from megapipe.errors import ConfigError, MegapipeError
from megapipe.inference.compressed_cache import commit_carry
from megapipe.inference.host_memory import collapse_resident_memory, keep_freed_buffers
from megapipe.inference.images import multimodal_step
from megapipe.inference.kv_cache import KVPool, PagedBatch, layer_windows
from megapipe.inference.sampling import SampleRow, greedy_ids, sample, top_logprobs
from megapipe.inference.scheduler import SchedulerOutput
from megapipe.inference.state_cache import StatePool
from megapipe.models.capabilities import capabilities, describe
from megapipe.models.dense import FeedForward, TransformerBlock
from megapipe.models.mamba import Mamba2Mixer
from megapipe.models.moe import GroupedExperts, MoEBlock
from megapipe.models.norms import RMSNorm
from megapipe.models.rope import model_rope_parts, rope_cos_sin


def _pack(weight: torch.Tensor, own: bool) -> torch.Tensor:
    """The weight in the layout its kernel reads: megapipe's linear_bf16 / linear_f32 (``own``) or oneDNN's blocked
    layout (tuned for batches of about 16 rows)."""
    if own:
        return kernels.pack_f32_weight(weight) if weight.dtype == torch.float32 else kernels.pack_bf16_weight(weight)
    return torch_compat.reorder_linear_weight(weight.detach(), 16)


def own_kernel_serves(weight: torch.Tensor) -> bool:
    """megapipe's linear kernel for this weight's dtype is built here (bf16's reads its inputs in pairs: even
    in_features only)."""
    if weight.dtype == torch.float32:
        return kernels.f32_linear_built()
    return weight.shape[1] % 2 == 0 and kernels.bf16_linear_built()


@dataclass
class RowBands:
    """A band of ``width`` columns per row, from start[r] on (int32 [rows]; -1: none): where a row's LoRA low-rank
    sums may be nonzero (its own adapter's), so megapipe's kernels take products there alone."""
    start: torch.Tensor
    width: int

    def kernel_args(self, of: str) -> dict:
        """The kernels' keyword arguments that give them these bands of ``of`` ("x2" or "out")."""
        return {f"{of}_start": self.start, f"{of}_band": self.width}


@dataclass
class ExtraInputs:
    """Values [rows, extra] of a packed weight's extra inputs (PackedLinear.extend: LoRA's low-rank sums), and
    optionally the bands outside which each row's values are zero."""
    values: torch.Tensor
    bands: Optional[RowBands] = None

    @staticmethod
    def kernel_args(extra: Optional[ExtraInputs]) -> dict:
        """The keyword arguments of linear_bf16 / linear_f32 / glu_bf16 that give them ``extra``."""
        if extra is None:
            return {}
        return {"x2": extra.values, **({} if extra.bands is None else extra.bands.kernel_args("x2"))}


class PackedLinear(nn.Module):
    """A linear layer on a pre-packed weight: megapipe's bf16 or fp32 kernel (``own``; kernels.py) or oneDNN's.
    ``own`` is the most rows a call may have to run on megapipe's kernel (True: any; False or 0: none); with a limit
    in between the weight is kept in both layouts and each call takes the kernel its row count is faster on."""

    adapted = None  # the megapipe.inference.lora.AdaptedInput whose LoRA adapters this layer takes, if any

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, own: Union[bool, int] = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        fits = own_kernel_serves(weight)
        self.own_rows = (kernels.OWN_ALWAYS if own is True else int(own)) if fits else 0
        self.own = self.own_rows > 0
        self.wide = None  # the packed weight with room for more inputs (extend)
        self._pack(weight)
        self.bias = None if bias is None else bias.detach()

    def _pack(self, weight: torch.Tensor) -> None:
        packed = _pack(weight, self.own)
        if self.wide is not None:  # extended: the weight's own inputs are the first of the wide one's
            self.packed.copy_(packed)
        else:
            self.packed = packed
        mixed = 0 < self.own_rows < kernels.OWN_ALWAYS
        self.onednn = _pack(weight, False) if mixed else None  # oneDNN's copy for calls over own_rows rows

    def extend(self, extra: int) -> None:
        """Room for ``extra`` more inputs after the weight's own, zero until ``set_extra_inputs``: a call given
        ExtraInputs (their values [rows, extra]) on megapipe's kernel then sums both products in one pass (LoRA's
        low-rank sums, megapipe.inference.lora). ``packed`` stays the weight of the layer's own inputs (a view)."""
        if not self.own:
            raise ValueError("only a layer on megapipe's kernel takes extra inputs")
        dense = self.dense()
        self.wide = _pack(torch.cat([dense, dense.new_zeros(self.out_features, extra)], dim=1), True)
        self.packed = self.wide[:, :self._own_inputs()]

    def set_extra_inputs(self, columns: torch.Tensor) -> None:
        """The extra inputs' weight columns [out_features, extra] (``extend``)."""
        self.wide[:, self._own_inputs():] = _pack(columns.to(self.wide.dtype), True)

    def _own_inputs(self) -> int:
        """Length of the layer's own inputs along the packed layout's input dimension (bf16's holds them in
        pairs)."""
        return self.in_features // 2 if self.packed.dtype == torch.bfloat16 else self.in_features

    def weight_for(self, extra: Optional[ExtraInputs]) -> torch.Tensor:
        """The packed weight a call with ``extra`` inputs (or none) multiplies."""
        return self.packed if extra is None else self.wide

    def dense(self) -> torch.Tensor:
        """The weight [out_features, in_features] read back from its packed layout."""
        if not self.own:
            return self.packed.to_dense()
        unpack = kernels.unpack_f32_weight if self.packed.dtype == torch.float32 else kernels.unpack_bf16_weight
        return unpack(self.packed, self.out_features)

    def _on_own(self, x: torch.Tensor) -> bool:
        return self.own and (self.onednn is None or x.numel() <= self.own_rows * self.in_features)

    def _onednn_weight(self) -> torch.Tensor:
        return self.packed if self.onednn is None else self.onednn

    def forward(self, x: torch.Tensor, activation: str = "none",
                extra: Optional[ExtraInputs] = None) -> torch.Tensor:
        """act(x W^T + b); with ``extra`` the extra inputs' products too (``extend``: megapipe's kernel only)."""
        if extra is not None or self._on_own(x):
            if activation not in ("none", "swish"):
                raise ValueError(f"megapipe's linear fuses no {activation!r} (only 'none' and 'swish')")
            return self._own(x, activation == "swish", None, extra)
        return torch_compat.linear_pointwise(x, self._onednn_weight(), self.bias, activation)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x).float() (a head's logits for the sampler): on megapipe's bf16 kernel the rounded outputs are
        stored widened in the same pass, with no widening pass of its own (at 64 rows of a 49k vocabulary that pass
        took half as long as the matmul)."""
        if self.packed.dtype == torch.bfloat16 and self._on_own(x):
            rows, out = self.rows_and_out(x, torch.float32)
            torch.ops.megapipe.linear_bf16(rows, self.packed, self.out_features, self.bias, False, None, out)
            return out.view(*x.shape[:-1], self.out_features)
        return self(x).float()

    def greedy_ids(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The argmax of forward_float(x) over the last dim (sampling.greedy_ids' rule) without the logits, on
        megapipe's bf16 kernel; None where that kernel does not serve x."""
        if self.packed.dtype != torch.bfloat16 or not self._on_own(x):
            return None
        rows = self.as_rows(x)
        out = torch.empty(rows.shape[0], dtype=torch.long, device=x.device)
        torch.ops.megapipe.linear_bf16_argmax(rows, self.packed, self.out_features, self.bias, out)
        return out

    def times(self, x: torch.Tensor, other: torch.Tensor, extra: Optional[ExtraInputs] = None,
              out_bands: Optional[RowBands] = None) -> torch.Tensor:
        """(x W^T + b) * other, the product taken on the matmul's result before rounding (``extra`` as in
        forward). With ``out_bands`` (megapipe's kernel only), where ``other`` is zero outside each row's band:
        megapipe's loop then multiplies only the outputs' tiles that meet the bands."""
        if extra is not None or out_bands is not None or self._on_own(x):
            return self._own(x, False, other, extra, out_bands)
        return torch_compat.linear_pointwise_binary(x, other, self._onednn_weight(), self.bias, "mul")

    def _own(self, x: torch.Tensor, swish: bool, other: Optional[torch.Tensor],
             extra: Optional[ExtraInputs] = None, out_bands: Optional[RowBands] = None) -> torch.Tensor:
        rows, out = self.rows_and_out(x)
        other = None if other is None else other.reshape(-1, self.out_features)
        bands = {} if out_bands is None else out_bands.kernel_args("out")
        self.own_op()(rows, self.weight_for(extra), self.out_features, self.bias, swish, other, out,
                      **ExtraInputs.kernel_args(extra), **bands)
        return out.view(*x.shape[:-1], self.out_features)

    def own_op(self):
        """megapipe's linear kernel for the packed weight's dtype: linear_bf16 or linear_f32 (one signature)."""
        return torch.ops.megapipe.linear_f32 if self.packed.dtype == torch.float32 else torch.ops.megapipe.linear_bf16

    def as_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as [rows, in_features] with contiguous rows."""
        rows = x.reshape(-1, self.in_features)
        return rows if rows.stride(-1) == 1 else rows.contiguous()

    def rows_and_out(self, x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``as_rows(x)`` and an empty output [rows, out_features] for it (of ``dtype``, default x's)."""
        rows = self.as_rows(x)
        return rows, torch.empty(rows.shape[0], self.out_features, dtype=dtype or x.dtype, device=x.device)


def plain_greedy(seq) -> bool:
    """``seq``'s next token is the argmax of its logits as they are: greedy, with no penalty, restriction, logprobs,
    grammar or suppressed id (min_tokens) to apply first (the sampler's rules: ModelRunner.sample_row, sampling.sample)."""
    p = seq.params
    return (p.greedy and not p.penalised and not p.restricted and p.logprobs is None and seq.matcher is None
            and (p.min_tokens == 0 or len(seq.output_ids) >= p.min_tokens))


def packing_works(dtype: torch.dtype) -> bool:
    """oneDNN is built in and its packed linear equals F.linear here (checked on a probe)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        lin = nn.Linear(64, 48, dtype=dtype)
        x = torch.randn(5, 64, dtype=dtype)
        with torch.inference_mode():
            return bool(torch.allclose(PackedLinear(lin.weight, lin.bias)(x).float(), lin(x).float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, AttributeError):
        return False


class PackedSwiGLU(nn.Module):
    """A swiglu FeedForward as packed matmuls, w2(silu(x w1) * (x w3)), the SiLU and the product taken on the fp32
    sums before rounding: no elementwise passes over the hidden activations, which in a long prefill cost as much as
    a fifth of the MLP. On megapipe's bf16 kernel the first half is one call where it is the faster (``glu_bf16``:
    each block multiplies the gate's and the up projection's tiles of the same outputs, so neither half is written
    out and read back; always on AMX tiles, by a measurement on the loop: kernels.glu_choice); elsewhere (oneDNN,
    biases) it is two, the SiLU and the product in their epilogues."""

    adapted = None  # the megapipe.inference.lora.AdaptedInput of its gate and up projections' adapters, if any

    def __init__(self, ff: nn.Module, own: Union[bool, int] = False):
        super().__init__()
        self.w1, self.w3, self.w2 = (PackedLinear(w.weight, w.bias, own) for w in (ff.w1, ff.w3, ff.w2))
        w1, w3 = self.w1, self.w3  # the same shape and row limit: w1's kernel choice is w3's
        own_bf16 = w1.own and w1.packed.dtype == torch.bfloat16
        self.glu = own_bf16 and w1.bias is None and w3.bias is None and kernels.glu_fused(w1.out_features,
                                                                                           w1.in_features)
        if own_bf16:
            say_once(kernels.glu_choice(w1.out_features, w1.in_features)[1])

    def forward(self, x: torch.Tensor, extra: Optional[ExtraInputs] = None) -> torch.Tensor:
        """``extra``: w1's and w3's extra inputs (PackedLinear.extend), as the rows of x."""
        w1, w3 = self.w1, self.w3
        if self.glu and (extra is not None or w1._on_own(x)):
            rows, out = w1.rows_and_out(x)
            torch.ops.megapipe.glu_bf16(rows, w1.weight_for(extra), w3.weight_for(extra), w1.out_features, out,
                                        **ExtraInputs.kernel_args(extra))
            return self.w2(out.view(*x.shape[:-1], -1))
        gate = w1(x, "swish", extra)
        return self.w2(w3.times(x, gate, extra))

    @staticmethod
    def fits(ff: nn.Module) -> bool:
        """``ff`` computes exactly FeedForward's SwiGLU (not a subclass that scales inside it, as Falcon-H1's
        multipliers do, nor DeepSeek-V4's clamped one: their linears are packed one by one under their own
        forward)."""
        return (getattr(ff, "swiglu", False) and isinstance(getattr(ff, "w1", None), nn.Linear)
                and type(ff).forward is FeedForward.forward and getattr(ff, "limit", None) is None)


class PackedQKV(nn.Module):
    """Projections of one input as one packed matmul (``parts``: names of ``owner``'s nn.Linear children; an
    attention layer's wq, wk, wv by default); returns their outputs, views of its result."""

    def __init__(self, owner: nn.Module, own: Union[bool, int] = False, parts: Sequence[str] = ("wq", "wk", "wv")):
        super().__init__()
        linears = [getattr(owner, n) for n in parts]
        self.parts, self.sizes = tuple(parts), [p.out_features for p in linears]
        bias = None if linears[0].bias is None else torch.cat([p.bias for p in linears]).detach()
        self.wqkv = PackedLinear(torch.cat([p.weight for p in linears]).detach(), bias, own)

    def forward(self, x: torch.Tensor):
        return self.wqkv(x).split(self.sizes, dim=-1)


class PackedMambaIn(PackedQKV):
    """A Mamba-2 mixer's five in-projections as one packed matmul, in place of its ``project``: (z, xbc, dt) as views
    of the result, the muP multipliers (Falcon-H1's) applied as the mixer's own fused path applies them."""

    PARTS = ("in_z", "in_x", "in_B", "in_C", "in_dt")

    def __init__(self, mixer: nn.Module, own: Union[bool, int] = False):
        super().__init__(mixer, own, self.PARTS)
        self.in_multiplier = mixer.in_multiplier
        self.scale = mixer.projection_scale(self.sizes, mixer.in_z.weight)
        z, x, b, c, dt = self.sizes
        self.split_sizes = [z, x + b + c, dt]

    def forward(self, x: torch.Tensor):
        out = self.wqkv(x if self.in_multiplier == 1 else x * self.in_multiplier)
        if self.scale is not None:
            out = out * self.scale
        return out.split(self.split_sizes, dim=-1)


class PackedExperts(nn.Module):
    """An MoE layer's experts (megapipe.models.moe.GroupedExperts, same ``forward(x, counts)``) on megapipe's bf16
    kernel: each 3-D weight [E, F, H] packed once as one [E*F, H] matmul, expert e's rows being a contiguous slice of
    it (the kernel's 16-output lines; F and H multiples of 16). Every expert that got rows runs as PackedSwiGLU does
    (gate and up in one glu_bf16 call where kernels.glu_fused says so) on its slice of the sorted rows, writing its part of one output;
    an expert that got none costs nothing. On CPU, torch._grouped_mm reorders each group's bf16 weight for a plain
    GEMM on every call: at decode batch sizes (a few rows per expert) it takes 2-5x as long as this kernel, which
    streams each weight once (tools/bench_generate.py on a Mixtral-like model: the decode step 4x faster)."""

    def __init__(self, experts: nn.Module, own: Union[bool, int] = True):
        super().__init__()
        self.num_experts, self.ffn, self.hidden = experts.w1.shape
        # own's row limit does not apply: each expert's slice runs on megapipe's kernel at whatever rows it got
        self.w1, self.w3, self.w2 = (PackedLinear(w.detach().reshape(-1, w.shape[-1]), None, bool(own))
                                     for w in (experts.w1, experts.w3, experts.w2))
        self.glu = kernels.glu_fused(self.ffn, self.hidden)  # decided (measured) here, not at the first forward
        self._views_of = None

    @staticmethod
    def fits(experts: nn.Module, own: Union[bool, int]) -> bool:
        """The weights can take this form: megapipe's bf16 kernel (``own``) and widths in whole 16-output lines; plain
        SwiGLU experts without biases (GPT-OSS's biased, clamped ones keep their grouped GEMM)."""
        w = experts.w1
        return (bool(own) and experts.w1_bias is None and experts.activation == ("swiglu",) and kernels.bf16_linear_built() and w.dtype == torch.bfloat16 and type(w) is nn.Parameter
                and w.shape[1] % 16 == 0 and w.shape[2] % 16 == 0)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1 or x.dtype != torch.bfloat16:
            x = x.contiguous().to(torch.bfloat16)
        out = torch.empty(len(x), self.hidden, dtype=x.dtype, device=x.device)
        hidden = torch.empty(len(x), self.ffn, dtype=x.dtype, device=x.device)
        gate = None if self.glu else torch.empty_like(hidden)
        sizes = counts.tolist()
        gates = [None] * len(sizes) if gate is None else gate.split(sizes)
        w1, w3, w2 = self._experts()
        ops = torch.ops.megapipe
        parts = zip(sizes, x.split(sizes), gates, hidden.split(sizes), out.split(sizes), strict=True)
        for e, (n, xe, ge, he, oe) in enumerate(parts):
            if not n:
                continue
            if ge is None:
                ops.glu_bf16(xe, w1[e], w3[e], self.ffn, he)
            else:  # no AMX: two calls, the SiLU and then the product in their epilogues
                ops.linear_bf16(xe, w1[e], self.ffn, None, True, None, ge)
                ops.linear_bf16(xe, w3[e], self.ffn, None, False, ge, he)
            ops.linear_bf16(he, w2[e], self.hidden, None, False, None, oe)
        return out

    def _experts(self) -> tuple:
        """Each expert's slices of the three packed weights (views, made again when load_weights re-packed them)."""
        packed = (self.w1.packed, self.w3.packed, self.w2.packed)
        if self._views_of is None or any(a is not b for a, b in zip(self._views_of, packed, strict=True)):
            self._views = tuple(w.chunk(self.num_experts) for w in packed)
            self._views_of = packed
        return self._views


def pack_linears(model: nn.Module, own: Union[bool, int] = False) -> int:
    """Replace every nn.Linear (and swiglu FeedForward) under ``model`` by its packed form (for megapipe's bf16
    kernel with ``own``, else oneDNN's); returns matmuls packed. A module's ``plain_linears`` (names of its children,
    e.g. an MoE router it reads in fp32) stay as they are. MoE experts become PackedExperts where megapipe's bf16
    kernel serves them (else they keep their grouped GEMM)."""

    count = 0
    keep = set(getattr(model, "plain_linears", ()))
    fused = None
    if hasattr(model, "project_qkv") and all(isinstance(getattr(model, n, None), nn.Linear) for n in ("wq", "wk", "wv")):
        fused, method = PackedQKV(model, own), "project_qkv"
    elif isinstance(model, Mamba2Mixer) and all(type(getattr(model, n)) is nn.Linear for n in PackedMambaIn.PARTS):
        fused, method = PackedMambaIn(model, own), "project"
    if fused is not None:
        model.add_module("fused_qkv", fused)
        # an instance attribute wins over the class method: the model's forward now calls the fused matmul
        object.__setattr__(model, method, fused)
        for n in fused.parts:
            setattr(model, n, None)
        count += len(fused.parts)
    for name, child in list(model.named_children()):
        if child is None or name == "fused_qkv" or name in keep:
            continue
        if PackedSwiGLU.fits(child):
            setattr(model, name, PackedSwiGLU(child, own))
            count += 3
        elif isinstance(child, GroupedExperts):
            if PackedExperts.fits(child, own):
                setattr(model, name, PackedExperts(child, own))
                count += 3
        elif isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child.weight, child.bias, own))
            count += 1
        else:
            count += pack_linears(child, own)
    return count


def packed_parts(model: nn.Module):
    """Every packed matmul under ``model`` with the state-dict names of the weights it fuses (rows in that order),
    of their biases, and their row counts: (PackedLinear, [weight names], [bias names], [rows])."""
    fused = set()
    for name, module in model.named_modules():
        prefix = name + "." if name else ""
        if isinstance(module, PackedQKV):
            owner = prefix[: -len("fused_qkv.")]
            parts = [f"{owner}{p}" for p in module.parts]
            yield module.wqkv, [f"{p}.weight" for p in parts], [f"{p}.bias" for p in parts], module.sizes
            fused.add(prefix + "wqkv")
        elif isinstance(module, PackedSwiGLU):
            for part_name in ("w1", "w3", "w2"):
                part = getattr(module, part_name)
                yield part, [f"{prefix}{part_name}.weight"], [f"{prefix}{part_name}.bias"], [part.out_features]
                fused.add(prefix + part_name)
        elif isinstance(module, PackedExperts):  # one packed matmul per 3-D weight [E, rows, in], as [E * rows, in]
            for part_name in ("w1", "w3", "w2"):
                part = getattr(module, part_name)
                yield part, [f"{prefix}{part_name}"], [f"{prefix}{part_name}.bias"], [part.out_features]
                fused.add(prefix + part_name)
        elif isinstance(module, PackedLinear) and name not in fused:
            yield module, [f"{prefix}weight"], [f"{prefix}bias"], [module.out_features]


def repack(linear: PackedLinear, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """New values for a packed matmul of the same shape (its bias updated in place)."""
    if tuple(weight.shape) != (linear.out_features, linear.in_features):
        raise ValueError(f"a packed linear of {linear.out_features}x{linear.in_features} got a {tuple(weight.shape)} "
                         "weight")
    linear._pack(weight)
    if linear.bias is not None:
        linear.bias.copy_(bias)


class DecoderLayer:
    """One pre-norm block (RMSNorm, rotary attention with optional per-head q/k RMSNorms as Qwen3's, a swiglu MLP or
    an MoE layer) run on the flattened batch [T, H] with far fewer operations than the module's forward: fused
    RMSNorm, q/k norms and rotary embedding in place on the fused q/k projection, attention through ``PagedBatch.attend_flat``, residual adds in place, the MLP's residual add left to
    the next layer's norm (``__call__`` takes and returns it as ``delta``). With ``ops`` (megapipe's CPU kernels,
    megapipe.inference.kernels) the residual add goes into that norm's pass, and the rotary embedding into storing
    k and v in the pool. Every rounding step is the module's own (same dtype, same order), so without ``ops`` the
    values are those of ``TransformerBlock.forward`` bit for bit; with them the RMSNorm sums its squares in another
    order (an ulp of its fp32 variance)."""

    def __init__(self, block: nn.Module, ops=None):
        attn = block.attention
        self.norm1, self.norm2 = block.attention_norm, block.ffn_norm
        self.layer_id, self.head_dim = attn.layer_id, attn.head_dim
        self.qkv = attn.project_qkv
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.wo, self.sinks = attn.wo, attn.sinks
        self.ffn = block.moe if hasattr(block, "moe") else block.feed_forward
        self.ops = ops
        self.direct_rows = self._direct_rows()

    def _direct_rows(self) -> int:
        """The most rows a step may have for ``direct`` to run this layer (0: never): the kernels' path with a fused
        q/k/v projection, no q/k norms and a packed SwiGLU, every matmul on megapipe's kernel at that row count."""
        if (self.ops is None or not isinstance(self.qkv, PackedQKV) or self.q_norm is not None
                or not isinstance(self.ffn, PackedSwiGLU) or not isinstance(self.wo, PackedLinear)):
            return 0
        linears = (self.qkv.wqkv, self.wo, self.ffn.w1, self.ffn.w3, self.ffn.w2)
        if not all(lin.own for lin in linears):
            return 0
        return min(kernels.OWN_ALWAYS if lin.onednn is None else lin.own_rows for lin in linears)

    @staticmethod
    def supports(block: nn.Module) -> bool:
        """A dense block with a swiglu MLP, or an MoE block (its MoE layer takes the flattened batch as it is); RMSNorms
        throughout (the q/k norms too, where there are any)."""

        attn = getattr(block, "attention", None)
        if type(block) is TransformerBlock:
            mlp_ok = isinstance(block.feed_forward, PackedSwiGLU) or block.feed_forward.swiglu
        else:
            mlp_ok = type(block) is MoEBlock
        return (mlp_ok and isinstance(block.attention_norm, RMSNorm) and isinstance(block.ffn_norm, RMSNorm)
                and all(n is None or isinstance(n, RMSNorm) for n in (attn.q_norm, attn.k_norm)))

    def __call__(self, h: torch.Tensor, delta: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] the residual stream, delta the previous layer's MLP output still to be added to it (or None);
        cos/sin [T, D]. Returns (h, this layer's MLP output)."""
        d = self.head_dim
        x = self.norm(h, delta, self.norm1)
        if isinstance(self.qkv, PackedQKV):
            qkv = self.qkv.wqkv(x)
            nq, nk, _ = (n // d for n in self.qkv.sizes)
            q, k, v = (t.view(len(x), -1, d) for t in qkv.split(self.qkv.sizes, dim=-1))
            if self.q_norm is not None:  # in place, before the rotary embedding (which the kernel applies in place)
                q.copy_(rms_norm(q, self.q_norm))
                k.copy_(rms_norm(k, self.k_norm))
            if self.ops is not None:
                pool, layer = batch.pool, self.layer_id
                self.ops.rope_and_cache(qkv, cos, sin, pool.k[layer], pool.v[layer], batch.slots_of(layer), nq, nk)
                attended = batch.attend_flat(self.layer_id, q, k, v, stored=True, sinks=self.sinks)
            else:
                rope_(qkv[:, :(nq + nk) * d].view(len(x), nq + nk, d), cos[:, None], sin[:, None])
                attended = batch.attend_flat(self.layer_id, q, k, v, sinks=self.sinks)
        else:
            q, k, v = (t.view(len(x), -1, d) for t in self.qkv(x))
            if self.q_norm is not None:
                q, k = rms_norm(q, self.q_norm), rms_norm(k, self.k_norm)
            rope_(q, cos[:, None], sin[:, None])
            rope_(k, cos[:, None], sin[:, None])
            attended = batch.attend_flat(self.layer_id, q, k, v, sinks=self.sinks)
        x = self.norm(h, self.wo(attended), self.norm2)
        return h, self.ffn(x)

    def direct(self, h: torch.Tensor, delta: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
               batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``__call__``'s values (the same kernels on the same inputs, bit for bit) as direct kernel calls, none of
        the modules' per-call checks and reshapes, which a decode step pays ~10 times a layer (SmolLM2, 64 rows:
        69.9 -> 67.7 ms a step). For steps of at most ``direct_rows`` rows whose batch attends on the kernel; LoRA
        adapters' low-rank sums (megapipe.inference.lora) enter as the matmuls' extra inputs, as in their
        forwards."""
        ops, d, rows = self.ops, self.head_dim, len(h)
        wqkv, wo, ffn = self.qkv.wqkv, self.wo, self.ffn
        op = wqkv.own_op()  # every linear of the layer: the same dtype

        def linear(lin: PackedLinear, x: torch.Tensor, extra: Optional[ExtraInputs], swish: bool = False,
                   other: Optional[torch.Tensor] = None) -> torch.Tensor:
            out = h.new_empty(rows, lin.out_features)
            op(x, lin.weight_for(extra), lin.out_features, lin.bias, swish, other, out,
               **ExtraInputs.kernel_args(extra))
            return out

        x = self.norm(h, delta, self.norm1)
        qkv = linear(wqkv, x, extra_inputs(wqkv, x))
        nq, nk = self.qkv.sizes[0] // d, self.qkv.sizes[1] // d
        pool, layer = batch.pool, self.layer_id
        ops.rope_and_cache(qkv, cos, sin, pool.k[layer], pool.v[layer], batch.slots_of(layer), nq, nk)
        attended = batch.attend_flat(layer, qkv[:, :nq * d].view(rows, nq, d), None, None, stored=True,
                                     sinks=self.sinks)
        x = self.norm(h, linear(wo, attended, extra_inputs(wo, attended)), self.norm2)
        w1, w3, w2 = ffn.w1, ffn.w3, ffn.w2
        extra = extra_inputs(ffn, x)  # the gate's and the up projection's: one input
        if ffn.glu:
            gated = h.new_empty(rows, w1.out_features)
            ops.glu_bf16(x, w1.weight_for(extra), w3.weight_for(extra), w1.out_features, gated,
                         **ExtraInputs.kernel_args(extra))
        else:
            gated = linear(w3, x, extra, other=linear(w1, x, extra, swish=True))
        return h, linear(w2, gated, extra_inputs(w2, gated))

    def norm(self, h: torch.Tensor, delta: Optional[torch.Tensor], norm: nn.Module) -> torch.Tensor:
        """h += delta in place (when given), then RMSNorm(h)."""
        if self.ops is None:
            return rms_norm(h if delta is None else h.add_(delta), norm)
        out = torch.empty_like(h)
        if delta is None:
            self.ops.rms_norm(h, norm.weight, norm.eps, out)
        else:
            self.ops.add_rms_norm(h, delta, norm.weight, norm.eps, out)
        return out


def extra_inputs(module: nn.Module, x: torch.Tensor) -> Optional[ExtraInputs]:
    """The extra inputs LoRA adapters give ``module`` (a linear, or a SwiGLU for its gate and up projections) on
    the rows x this step, on megapipe's kernel (None: no adapter on it, or no row with one)."""
    adapted = module.adapted
    if adapted is None:
        return None
    low, extra = adapted.low(x)
    if low is not None and extra is None:
        raise MegapipeError("an adapted layer's direct call ran off megapipe's kernel")  # direct_rows' rule broken
    return extra


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``RMSNorm.forward`` in two kernels: the normalisation in fp32 cast back to x's dtype, then the weight."""
    return F.rms_norm(x, (x.shape[-1],), None, norm.eps).mul_(norm.weight)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``apply_rope`` in place on x [T, heads, D] (cos/sin [T, 1, D] in x's dtype), the same roundings."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    x.mul_(cos).add_(rotated)


HUGE_PAGES_MIN_WEIGHTS = 64 << 20  # below this the weights stay in the CPU's caches: huge pages gain nothing


def widest_linear(model: nn.Module) -> tuple[int, int]:
    """[out, in] of the largest nn.Linear in the model's first layer: the matmul a kernel choice is measured on."""
    first = next(iter(model.layers.values()))
    return max((m.weight.shape for m in first.modules() if isinstance(m, nn.Linear)), key=lambda s: s[0] * s[1],
               default=(256, 256))


@functools.lru_cache(maxsize=None)
def say_once(message: str) -> None:
    print(f"megapipe: {message}", file=sys.stderr, flush=True)


@dataclass
class RunnerOutput:
    """What a step computed, by seq_id. ``sampled``: the tokens each sequence that reached its end emits, in the
    order they were drawn (verified sequences first): one, or under speculative decoding its accepted drafts and the
    token after them (``num_accepted`` of them drafts, for every verified sequence). ``logprobs``: (logprob, top
    alternatives) per sampled token, for sequences that asked. ``prompt_logprobs``: (p, entries) where entry i is
    prompt token p + 1 + i's, for sequences whose chunk covered prompt positions and that asked."""

    sampled: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[int, list]] = field(default_factory=dict)
    num_accepted: dict[int, int] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, pool: KVPool, pack: Optional[bool] = None, huge_pages: Optional[bool] = None,
                 cpu_kernels: Optional[bool] = None, states: Optional[StatePool] = None,
                 bf16_linear: str = "auto", eos_token_ids: Sequence[int] = ()):
        self.model, self.pool, self.states = model, pool, states
        self.eos_token_ids = list(eos_token_ids)  # suppressed before a sequence's min_tokens
        self.speculator = None  # the drafter and verifier under speculative decoding (megapipe.inference.speculative)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
        # a fake-quantized model (ModelOpt quantizers on its linears) must run through its own modules: packed
        # matmuls and the fast layer path would skip the quantizers
        self.quantized = any(hasattr(mod, "weight_quantizer") or hasattr(mod, "input_quantizer")
                             for mod in model.modules())
        if pack is None:
            pack = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16, torch.float32)
        self.packed = (bool(pack) and not self.quantized and self.device.type == "cpu"
                       and packing_works(self.dtype))
        self.ops = None  # torch.ops.megapipe when megapipe's CPU kernels serve this model
        if cpu_kernels is not False:
            self.ops = kernels.ops() if kernels.available(self.dtype, self.device) else None
            if cpu_kernels and self.ops is None:
                raise ConfigError(f"EngineConfig.cpu_kernels = True but megapipe's CPU kernels do not run here "
                                  f"({self.device.type}, {self.dtype}, {kernels.capability()}; see the log)")
        self.attention_kernel = None
        self.mamba_step = self.ops.mamba_step if self.ops is not None and states else None  # fused decode step
        if cpu_kernels and "cpu_kernels" not in capabilities(model.cfg).engine:
            raise ConfigError(f"EngineConfig.cpu_kernels = True: megapipe's CPU attention kernel does not serve "
                              f"{describe(model.cfg)} models (megapipe/models/capabilities.py)")
        if self.ops is not None and "cpu_kernels" in capabilities(model.cfg).engine:
            self.attention_kernel = kernels.attention_kernel_for(pool.head_dim, self.dtype, self.device)
        # bf16 matmuls on megapipe's own kernel or oneDNN's, whichever is faster on this CPU at a call's row count:
        # own_linears is the most rows megapipe's kernel takes (kernels.choose_bf16_linear)
        self.own_linears = 0
        if self.packed and self.ops is not None and self.dtype == torch.bfloat16:
            n, k = widest_linear(model)
            self.own_linears, why = kernels.choose_bf16_linear(bf16_linear, n, k)
            say_once(why)
        elif self.packed and self.ops is not None and self.dtype == torch.float32 and kernels.f32_linear_built():
            self.own_linears = kernels.OWN_ALWAYS  # fp32: no AMX for oneDNN, megapipe's loop streams faster
        head = model.output_weight().detach()
        self.head = None
        if self.packed:
            pack_linears(model.layers, self.own_linears)
            self.head = PackedLinear(head, own=self.own_linears)
        self.head_weight = head
        self.window = layer_windows(model.cfg)
        self.adapters = None  # LoRA adapters the engine serves (megapipe.inference.lora.AdapterSlots)
        self._build_fast_path()
        if huge_pages is None:
            huge_pages = weight_bytes >= HUGE_PAGES_MIN_WEIGHTS
        self.huge_page_bytes = self._use_huge_pages() if huge_pages and self.device.type == "cpu" else 0

    @staticmethod
    def _use_huge_pages() -> int:
        """Weights and KV pool (both resident by now) on transparent huge pages (megapipe.inference.host_memory);
        returns bytes advised."""
        keep_freed_buffers()
        return collapse_resident_memory()

    def _build_fast_path(self) -> None:
        """The layers as DecoderLayer when every block is one it runs (else the model's own forward)."""

        m, cfg = self.model, self.model.cfg
        self.layers = None
        if (not self.quantized and cfg.position_embedding == "rope" and isinstance(m.norm, RMSNorm) and m.tok_embeddings is not None
                and all(DecoderLayer.supports(b) for b in m.layers.values())):
            self.layers = [DecoderLayer(b, self.ops) for b in m.layers.values()]
            self.direct_rows = min(layer.direct_rows for layer in self.layers)
            self.inv_freq, self.rope_scale = model_rope_parts(cfg, self.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The fast path's cos, sin [T, head_dim] for the flattened batch's positions [1, T] (YaRN's factor in)."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, dtype, self.rope_scale)
        return cos[0, 0], sin[0, 0]

    @torch.inference_mode()
    def load_weights(self, state: dict) -> None:
        """Take new weights (a full, unsharded state dict of the model: names as ``Transformer.state_dict()``),
        cast to the engine's dtype; packed layers are rebuilt from them."""
        mine = self.model.state_dict()  # packed: the tensors left plain (embeddings, norms)
        parts = list(packed_parts(self.model)) if self.packed else []
        wanted = set(mine) | {n for _, weights, _, _ in parts for n in weights}
        missing = sorted(wanted - set(state))
        if missing:
            raise KeyError(f"load_weights: the state dict lacks {missing[:3]}")
        for name, t in mine.items():
            t.copy_(state[name])
        for linear, weights, biases, _ in parts:  # re-packed in place of the old values: no second model in memory
            w = [state[n].to(self.device, self.dtype) for n in weights]
            w = w[0] if len(w) == 1 else torch.cat(w)
            w = w.reshape(-1, w.shape[-1])  # experts' 3-D weights as one matmul of their stacked rows
            b = torch.cat([state[n] for n in biases]) if linear.bias is not None else None
            repack(linear, w, b)
        self.head_weight = self.model.output_weight().detach()
        if self.head is not None:
            repack(self.head, self.head_weight, None)

    def sample_row(self, seq, ahead: Sequence[int] = ()) -> SampleRow:
        """What the sampler needs of ``seq`` for its next token, as if the ids ``ahead`` (drafts) were output."""
        p = seq.params
        output = seq.output_ids + list(ahead) if ahead else seq.output_ids
        suppressed = ()
        if len(output) < p.min_tokens:
            suppressed = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
        return SampleRow(p, seq.generator, seq.tokens[:seq.prompt_len], output, suppressed, seq.matcher)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run the step ``plan``: its decodes (those with a lookahead verify drafts the speculator proposes now, as a
        chunk of the last token and its drafts), then its chunks, flattened in that order; logits of the rows that
        are sampled, verified or scored for prompt logprobs; then drafts verified and tokens sampled. Reads the
        sequences, changes none of their tokens or counts (drafters keep their own state). With LoRA adapters the
        decodes run in adapter order (rows are independent: only the order of a step's outputs, and of unseeded
        random draws, follows it)."""
        spec = self.speculator
        decodes, verify = plan.decodes, []
        if self.adapters is not None:  # rows of one adapter side by side: the kernels' blocks then share its band
            decodes = sorted(decodes, key=lambda s: self.adapters.slot(s.request.lora))
        if spec is not None:
            verify = [s for s in decodes if s.num_lookahead]
            decodes = [s for s in decodes if not s.num_lookahead]
            spec.propose(verify, plan.tables)
        # (sequence, first position, tokens) of each part of the flattened batch, and its first row there
        work = [(s, s.num_computed, [s.tokens[s.num_computed]]) for s in decodes]
        work += [(s, s.num_computed, s.tokens[s.num_computed:] + s.draft.tokens) for s in verify]
        work += [(s, s.num_computed, s.tokens[s.num_computed:s.num_computed + n]) for s, n in plan.chunks]
        rows, samplers, prompt_rows, checked, at = [], [], [], [], []
        offset = 0
        for i, (seq, start, toks) in enumerate(work):
            at.append(offset)
            n = len(toks)
            if len(decodes) <= i < len(decodes) + len(verify):
                checked.append((seq, len(rows), offset))
                rows.extend(range(offset, offset + n))
            else:
                if seq.params.prompt_logprobs is not None:  # position p predicts prompt token p + 1
                    last = min(start + n, seq.prompt_len - 1)
                    if start < last:
                        prompt_rows.append((seq, start, last, len(rows)))
                        rows.extend(range(offset, offset + last - start))
                if start + n == len(seq.tokens):
                    samplers.append((seq, len(rows)))
                    rows.append(offset + n - 1)
            offset += n
        want_hidden = spec is not None and spec.needs_hidden
        lora_rows = None
        if self.adapters is not None:  # each row's adapter slot
            lora_rows = [r for s, _, toks in work for r in [self.adapters.slot(s.request.lora)] * len(toks)]
        images = [s.request.images for s, _, _ in work]
        # rows that are all plain greedy want their argmax only: the head then never writes the logits
        greedy = (not checked and not prompt_rows and not want_hidden and len(samplers) == len(rows)
                  and all(plain_greedy(s) for s, _ in samplers))
        logits = self.run([(plan.tables[s.seq_id], start, toks[0]) for s, start, toks in work[:len(decodes)]],
                          [(plan.tables[s.seq_id], start, toks) for s, start, toks in work[len(decodes):]], rows,
                          hidden=want_hidden, state_slots=[s.state_slot for s, _, _ in work] if self.states else None,
                          images=images if any(i is not None for i in images) else None, lora_rows=lora_rows,
                          deferred=[s.state_slot for s in verify] if self.states else (), greedy=greedy)
        if greedy:
            out = RunnerOutput()
            for (seq, _), token in zip(samplers, logits.tolist(), strict=True):
                out.sampled[seq.seq_id] = [token]
            return out
        hidden = None
        if want_hidden:
            logits, hidden = logits
            verified = range(len(decodes), len(decodes) + len(verify))  # those keep theirs once verified
            for i, ((seq, start, toks), first) in enumerate(zip(work, at, strict=True)):
                if i not in verified:  # a decode without drafts (budget, last token) keeps the chain going
                    spec.record(seq, start, hidden[first:first + len(toks)])
        out = RunnerOutput()
        for seq, start, last, row in prompt_rows:
            scored = logits[row:row + last - start].log_softmax(dim=-1)
            targets = torch.tensor(seq.tokens[start + 1:last + 1], device=logits.device)
            picked, tops = top_logprobs(scored, targets, seq.params.prompt_logprobs)
            ranks = (scored > scored.gather(-1, targets[:, None])).sum(-1).add_(1).tolist()  # 1: the argmax
            out.prompt_logprobs[seq.seq_id] = (start, list(zip(picked, tops, ranks, strict=True)))
        for seq, row, first in checked:
            self._verify(seq, logits[row:row + 1 + len(seq.draft.tokens)],
                         hidden[first:] if hidden is not None else None, out)
        if samplers:
            self._sample([s for s, _ in samplers], logits if len(samplers) == len(rows)
                         else logits[[row for _, row in samplers]], out)
        return out

    def _verify(self, seq, logits: torch.Tensor, hidden: Optional[torch.Tensor], out: RunnerOutput) -> None:
        """``seq``'s drafts checked against its logits [1 + drafts, V]: the tokens it emits (the accepted drafts and
        the one after them)."""
        emitted = self.speculator.verify(seq, logits)
        if self.states:  # DeepSeek-V4's compressors' carry over the kept tokens only
            commit_carry(self.states, seq.state_slot, len(emitted))
        self.speculator.keep(seq, seq.num_computed, hidden[:len(emitted)] if hidden is not None else None)
        out.sampled[seq.seq_id] = emitted
        out.num_accepted[seq.seq_id] = len(emitted) - 1
        if seq.params.logprobs is not None:
            raw = logits[:len(emitted)].log_softmax(dim=-1)
            picked, tops = top_logprobs(raw, torch.tensor(emitted, device=raw.device), seq.params.logprobs)
            out.logprobs[seq.seq_id] = list(zip(picked, tops, strict=True))

    def _sample(self, seqs: list, logits: torch.Tensor, out: RunnerOutput) -> None:
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw = logits[want].log_softmax(dim=-1) if want else None  # before the sampler's processors
        chosen = sample(logits, [self.sample_row(seq) for seq in seqs])
        if want:
            picked, tops = top_logprobs(raw, chosen[want], max(seqs[i].params.logprobs for i in want))
            for j, i in enumerate(want):
                out.logprobs[seqs[i].seq_id] = [(picked[j], tops[j][:seqs[i].params.logprobs])]
        for seq, token in zip(seqs, chosen.tolist(), strict=True):
            out.sampled[seq.seq_id] = [token]

    @torch.inference_mode()
    def run(self, decodes: Sequence[tuple[Sequence[int], int, int]],
            chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]], rows: Sequence[int],
            hidden: bool = False, state_slots: Optional[Sequence[int]] = None, images: Optional[Sequence] = None,
            lora_rows: Optional[Sequence[int]] = None, deferred: Sequence[int] = (), greedy: bool = False):
        """decodes: (block ids, position, token); chunks: (block ids, start, tokens); state_slots: each one's slot
        in the state pool (a hybrid model's); images: each one's PromptImages or None (megapipe.inference.images);
        lora_rows: each row's LoRA adapter slot (``adapters``, 0: none); deferred: the state slots of chunks that
        verify drafts (DeepSeek-V4's carry waits for ``commit_carry``). Returns fp32 logits of the batch rows
        ``rows`` (indices into the flattened batch: decodes first, then the chunks in order); with ``hidden``, also
        what MTP depth 1 takes at every row (the final normed hidden states; DeepSeek-V4: the last layer's
        hyper-connection streams), where MTP drafting starts from. With ``greedy`` (not with ``hidden``), the
        rows' argmax token ids [R] instead of their logits."""
        batch = PagedBatch(self.pool, self.window, self.attention_kernel, self.states, self.mamba_step)
        positions = batch.plan([(b, pos) for b, pos, _ in decodes], [(b, s, len(t)) for b, s, t in chunks],
                               state_slots, deferred)
        ids = [t for _, _, t in decodes]
        for _, _, toks in chunks:
            ids.extend(toks)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.adapters is not None:
            self.adapters.set_rows(lora_rows)
        select = None if len(rows) == len(ids) else torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.layers is None:
            if images is not None:
                raise MegapipeError("images need the engine's layer path, which this model does not take")
            normed, depth1 = self.model(tokens[None], positions, batch, return_hidden=True, mtp_input=True)
            normed, depth1 = normed[0], depth1[0]
        else:
            h = self.model.tok_embeddings(tokens)
            if images is None:
                cos, sin = self.cos_sin(positions, h.dtype)
            else:
                starts = [pos for _, pos, _ in decodes] + [start for _, start, _ in chunks]
                lengths = [1] * len(decodes) + [len(toks) for _, _, toks in chunks]
                cos, sin = multimodal_step(self.model, self.inv_freq, self.rope_scale, images, starts, lengths,
                                           positions, h)
            delta = None
            direct = batch.kernel is not None and len(ids) <= self.direct_rows
            for layer in self.layers:
                h, delta = layer.direct(h, delta, cos, sin, batch) if direct else layer(h, delta, cos, sin, batch)
            h = h.add_(delta)
            if not hidden and select is not None:  # the norm of the rows asked for only (rows are independent)
                h, select = h[select], None
            normed = depth1 = self.layers[-1].norm(h, None, self.model.norm)
        normed = normed if select is None else normed[select]
        if greedy and not hidden:
            return self.greedy_tokens(normed)
        logits = self.logits(normed)
        return (logits, depth1) if hidden else logits

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head.forward_float(h)
        return F.linear(h, self.head_weight).float()

    def greedy_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """The argmax of logits(h)'s rows (sampling.greedy_ids), from the head's kernel where it gives them."""
        ids = self.head.greedy_ids(h) if self.head is not None else None
        return ids if ids is not None else greedy_ids(self.logits(h))
