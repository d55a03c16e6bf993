"""One quantized linear layer as the TensorRT-LLM exporters need it: real-quantized weights and their scales.

A fake-quantized checkpoint stores each linear's weight (high precision) and its ModelOpt quantizer tensors
(``amax`` per tensor / channel / block, the AWQ/SmoothQuant ``pre_quant_scale``). The exported checkpoint holds
the quantized weight and the scales TensorRT-LLM's kernels read. The numerics follow NVIDIA ModelOpt's exporters
(``modelopt.torch.export``) exactly, so the files are bit-identical to theirs (checked by the oracle tests):

- scale = amax / maxbound, maxbound 448 (FP8 E4M3), 127 (INT8), 7 (INT4); zero amax -> maxbound, then clamped to
  the dtype's positive range (ModelOpt's export_amax; applied to every scale, also to the two its unified exporter
  divides raw: the FP8 weight scale and the KV cache scales, where it writes 0 and NaN weights for a dead tensor); per-tensor scales are ``[1]``, per-channel ``[out]``, INT4 blocks ``[out, in/128]``.
- FP8 weight = E4M3(W / s); INT8 = clamp(round(W / s), -128, 127); INT4 = clamp(round(W / s_block), -8, 7) with two
  consecutive output rows packed per byte (row 2j in the low nibble), stored ``[out/2, in]``.
- Layers that read the same input are fused by the runtime (q/k/v; gate/up), so before export they share one
  input scale (the max), one per-tensor weight scale (the max), and one ``pre_quant_scale``: the mean of theirs,
  each weight re-smoothed ``W * old / new`` in fp32 and its amax recomputed from the new weight.
- The weights and ``pre_quant_scale`` are first cast to the export dtype (as a model loaded in that dtype holds
  them; the activations are multiplied by the scale in that dtype); amax and the scales stay float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

MAXBOUND = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}
# --quant format -> what its weight quantizer(s) and input quantizer are
WEIGHT_KIND = {"fp8": "fp8", "int8_sq": "int8", "int4_awq": "int4", "w4a8_awq": "int4"}
INPUT_KIND = {"fp8": "fp8", "int8_sq": "int8", "int4_awq": None, "w4a8_awq": "fp8"}


@dataclass
class QLinear:
    """One linear: ``weight`` [out, in] (export dtype), its quantizer tensors (None where the quantizer is off)."""

    fmt: Optional[str]  # None: not quantized
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    input_amax: Optional[torch.Tensor] = None
    weight_amax: Optional[torch.Tensor] = None  # fp8 [], int8 [out, 1], int4 blocks [out * in / block, 1]
    weight_amax_2: Optional[torch.Tensor] = None  # w4a8_awq: the FP8 stage, []
    pre_quant_scale: Optional[torch.Tensor] = None  # [in]
    block_size: int = 0

    def replace(self, **kw) -> "QLinear":
        return dataclasses.replace(self, **kw)


def from_state(state: dict[str, torch.Tensor], prefix: str, fmt: Optional[str], enabled: dict[str, bool],
               dtype: torch.dtype, block_size: int = 0) -> QLinear:
    """The linear ``prefix`` (e.g. ``layers.0.attention.wq``) out of a fake-quantized state dict."""

    def get(name: str) -> Optional[torch.Tensor]:
        key = f"{prefix}.{name}"
        return state[key] if key in state and enabled.get(key.rsplit(".", 1)[0], True) else None

    bias = state.get(f"{prefix}.bias")
    q = QLinear(fmt=None, weight=state[f"{prefix}.weight"].to(dtype), bias=None if bias is None else bias.to(dtype))
    weight_on = enabled.get(f"{prefix}.weight_quantizer", False) or enabled.get(f"{prefix}.weight_quantizer.0", False)
    if fmt is None or not weight_on:
        return q
    sequential = fmt == "w4a8_awq"
    return q.replace(
        fmt=fmt,
        input_amax=get("input_quantizer._amax"),
        weight_amax=get("weight_quantizer.0._amax" if sequential else "weight_quantizer._amax"),
        weight_amax_2=get("weight_quantizer.1._amax") if sequential else None,
        pre_quant_scale=_to(state.get(f"{prefix}.input_quantizer._pre_quant_scale"), dtype),
        block_size=block_size if WEIGHT_KIND[fmt] == "int4" else 0,
    )


def _to(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


# --------------------------------------------------------------------------------------------------- scales


def _export_amax(amax: torch.Tensor, kind: str, shape: str, out_features: int = 0) -> torch.Tensor:
    """ModelOpt's TensorQuantizer.export_amax: zeros -> maxbound, clamp, then the layout TensorRT-LLM reads."""
    if shape == "block":
        amax = amax.reshape(out_features, -1)
    amax = positive_amax(amax, kind)
    info = torch.finfo(amax.dtype)
    amax = amax.clamp(min=info.tiny, max=info.max)
    if shape == "tensor":
        return amax.unsqueeze(0)
    if shape == "channel":
        return amax.squeeze()
    return amax


def positive_amax(amax: torch.Tensor, kind: str) -> torch.Tensor:
    """ModelOpt's rule for a dead tensor: a zero (or NaN) amax, which calibration finds where the tensor never held a
    non-zero value, becomes the max bound, so every exported scale is positive (a zero scale would make the
    quantized weight 0 / 0)."""
    return torch.where(amax == 0, torch.full_like(amax, MAXBOUND[kind]), amax).nan_to_num(nan=MAXBOUND[kind])


def scale(amax: torch.Tensor, kind: str, shape: str, out_features: int = 0) -> torch.Tensor:
    return _export_amax(amax, kind, shape, out_features).float() / MAXBOUND[kind]


def weight_scale(q: QLinear) -> torch.Tensor:
    kind = WEIGHT_KIND[q.fmt]
    shape = {"fp8": "tensor", "int8": "channel", "int4": "block"}[kind]
    return scale(q.weight_amax, kind, shape, q.weight.shape[0])


def weight_scale_2(q: QLinear) -> Optional[torch.Tensor]:
    return scale(q.weight_amax_2, "fp8", "tensor") if q.weight_amax_2 is not None else None


def input_scale(q: QLinear) -> Optional[torch.Tensor]:
    if q.input_amax is None or INPUT_KIND[q.fmt] is None:
        return None
    return scale(q.input_amax.float(), INPUT_KIND[q.fmt], "tensor")


def kv_scale_unified(amax: torch.Tensor) -> torch.Tensor:
    """The unified checkpoint's ``k_scale`` / ``v_scale``: amax / 448 as stored (no clamping); a zero amax by the
    rule of ``positive_amax`` (ModelOpt's unified exporter divides the raw amax there, writing a zero scale)."""
    return positive_amax(amax.float(), "fp8") / MAXBOUND["fp8"]


def kv_scale_legacy(amax: torch.Tensor) -> torch.Tensor:
    """The legacy checkpoint's ``*_cache_scaling_factor`` [1]: at least 1, as ModelOpt recommends for FP8."""
    return torch.max(scale(amax, "fp8", "tensor"), torch.tensor([1.0]))


# --------------------------------------------------------------------------------------------------- weights


def pack_int4(weight: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """[out, in] -> uint8 [out/2, in]: rows 2j (low nibble) and 2j+1 (high nibble) of the rounded INT4 values."""
    out_features, in_features = weight.shape
    ints = (weight / scales[:, torch.arange(in_features) // block_size]).round().clamp(-8, 7).to(torch.int8)
    pairs = ints.T.reshape(in_features, out_features // 2, 2)
    packed = (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)
    return packed.T.contiguous().view(torch.uint8)


def quantize_weight(q: QLinear, scales: torch.Tensor) -> torch.Tensor:
    kind = WEIGHT_KIND[q.fmt]
    if kind == "fp8":
        return (q.weight / scales).to(torch.float8_e4m3fn)
    if kind == "int8":
        return (q.weight / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
    return pack_int4(q.weight, scales, q.block_size)


# --------------------------------------------------------------------------------------------------- fusion


def recalibrated_amax(q: QLinear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The weight amax(es) the max calibrator finds on ``q.weight`` (after re-smoothing changed it)."""
    w = q.weight.detach()
    kind = WEIGHT_KIND[q.fmt]
    if kind == "fp8":
        first = w.abs().amax()
    elif kind == "int8":
        first = w.abs().amax(dim=-1, keepdim=True)
    else:
        first = w.reshape(-1, q.block_size).abs().amax(dim=-1, keepdim=True)
    second = w.abs().amax() if q.weight_amax_2 is not None else None
    return first, second


def fuse_group(group: list[QLinear], weight_amax: bool = True) -> list[QLinear]:
    """Prepare linears that read one input for a fused GEMM (ModelOpt's ``preprocess_linear_fusion``)."""
    if not group or group[0].fmt is None:
        return group
    out = list(group)
    if out[0].pre_quant_scale is not None:
        mean = torch.stack([q.pre_quant_scale for q in out]).mean(dim=0)
        for i, q in enumerate(out):
            if torch.equal(q.pre_quant_scale, mean):
                continue
            w = (q.weight.to(torch.float32) * q.pre_quant_scale.to(torch.float32) / mean.to(torch.float32))
            q = q.replace(weight=w.to(q.weight.dtype), pre_quant_scale=mean.to(q.pre_quant_scale.dtype).clone())
            first, second = recalibrated_amax(q)
            out[i] = q.replace(weight_amax=first, weight_amax_2=second)
    if out[0].input_amax is not None:
        shared = torch.max(torch.stack([q.input_amax for q in out]))
        out = [q.replace(input_amax=shared) for q in out]
    if weight_amax:
        if out[0].weight_amax_2 is not None:
            shared = torch.max(torch.stack([q.weight_amax_2 for q in out]))
            out = [q.replace(weight_amax_2=shared) for q in out]
        elif out[0].weight_amax is not None and out[0].weight_amax.numel() == 1:
            shared = torch.max(torch.stack([q.weight_amax for q in out]))
            out = [q.replace(weight_amax=shared) for q in out]
    return out


def fold_into_norm(group: list[QLinear], norm_weight: torch.Tensor, norm_bias: Optional[torch.Tensor]):
    """AWQ: the group's shared ``pre_quant_scale`` multiplied into the norm before it (then dropped)."""
    pqs = group[0].pre_quant_scale
    if pqs is None:
        return group, norm_weight, norm_bias
    weight = (norm_weight * pqs).to(norm_weight.dtype)
    bias = norm_bias * pqs if norm_bias is not None else None
    return [q.replace(pre_quant_scale=None) for q in group], weight, bias
