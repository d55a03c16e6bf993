"""Rotary position embeddings (rotate-half layout, as in the Hugging Face Llama checkpoints), with Llama-3 scaling or
YaRN (transformers' rope_type "yarn", DeepSeek-V3's context extension), and DeepSeek's interleaved pair layout.

Nothing is stored: cos/sin are computed from the positions of each forward, so context parallelism can pass the
global positions of its chunks and a model built on the meta device needs no buffer re-initialisation.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megapipe.errors import ConfigError


def inv_frequencies(head_dim: int, theta: float, scaling: Optional[dict], device=None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "llama3"))
    if kind != "llama3":
        raise ConfigError(f"model.rope_scaling.rope_type = {kind!r} is not supported (allowed: 'llama3')")
    try:
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ConfigError(f"model.rope_scaling is missing the key {e.args[0]!r}") from None
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_frequencies(dim: int, theta: float, factor: float, original_max_positions: int, beta_fast: float,
                         beta_slow: float, device=None, truncate: bool = True) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than ``beta_slow`` times over the original context are
    divided by ``factor`` (interpolated), those turning more than ``beta_fast`` times kept (extrapolated), a linear
    ramp over the dims between (its bounds floored / ceiled with ``truncate``, transformers' default; GPT-OSS's
    are not)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over the context
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if high == low else high
    kept = 1 - ((torch.arange(dim // 2, device=device).float() - low) / (high - low)).clamp(0, 1)
    return interpolated * (1 - kept) + extrapolated * kept


def yarn_attention_factor(cfg) -> float:
    """What YaRN multiplies cos and sin by (transformers' ``attention_factor``): mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set, else mscale(factor)."""
    f = cfg.rotary_scaling_factor
    if cfg.mscale and cfg.mscale_all_dim:
        return yarn_mscale(f, cfg.mscale) / yarn_mscale(f, cfg.mscale_all_dim)
    return yarn_mscale(f)


def model_inv_frequencies(cfg, device=None) -> torch.Tensor:
    """The model's rope frequencies over ``cfg.rope_dim`` dims: YaRN when ``rotary_scaling_factor`` != 1, else
    plain or Llama-3 scaled (``rope_scaling``)."""
    if cfg.rotary_scaling_factor == 1:
        return inv_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, device)
    original = cfg.original_max_position_embeddings or cfg.max_position_embeddings
    return yarn_inv_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rotary_scaling_factor, original, cfg.beta_fast,
                                cfg.beta_slow, device, cfg.yarn_truncate)


def model_rope_parts(cfg, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq, scale): what ``model_rope`` computes its cos and sin from, for a caller that keeps them across
    steps (the decoding engine)."""
    scale = 1.0 if cfg.rotary_scaling_factor == 1 else yarn_attention_factor(cfg)
    return model_inv_frequencies(cfg, device), scale


def model_rope(cfg, positions: torch.Tensor, dtype: torch.dtype, device=None):
    """cos, sin for ``positions`` as the model's layers take them (YaRN's attention factor folded in); [3, B, S]
    positions are M-RoPE's (temporal, height, width), each rotating its ``cfg.mrope_section`` of the frequencies."""
    inv_freq, scale = model_rope_parts(cfg, device)
    return rope_cos_sin(positions, inv_freq, dtype, scale, cfg.mrope_section if positions.dim() == 3 else None)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0,
                 sections: Optional[list[int]] = None):
    """positions [S] or [B, S] -> cos, sin of shape [1 or B, 1, S, head_dim] (broadcast over heads), times
    ``scale``. ``sections``: positions [A, B, S] along A axes, axis a turning the next ``sections[a]`` frequencies
    (multimodal rotary: M-RoPE's temporal / height / width, a vision tower's height / width); equal positions on
    every axis give the 1-D rope."""
    if positions.dim() == 1:
        positions = positions[None]
    inv_freq = inv_freq.to(positions.device)
    if sections is not None:
        axis = torch.repeat_interleave(torch.arange(len(sections), device=positions.device),
                                       torch.tensor(sections, device=positions.device))
        freqs = positions.movedim(0, -1)[..., axis].float() * inv_freq
    else:
        freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, head_dim]; the result keeps x's dtype (cos/sin may be float32 under autocast)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's layout): the even dims then the odd ones, rotated
    as ``apply_rope`` does. The result is in that de-interleaved order, for q and k alike, so their dot products are
    the interleaved rotation's (transformers' ``apply_rotary_pos_emb_interleave`` returns the same)."""
    return apply_rope(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)
