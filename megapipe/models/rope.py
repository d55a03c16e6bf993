"""Rotary position embeddings (rotate-half layout, as in the Hugging Face Llama checkpoints), with Llama-3 scaling.

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


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions [S] or [B, S] -> cos, sin of shape [1 or B, 1, S, head_dim] (broadcast over heads)."""
    if positions.dim() == 1:
        positions = positions[None]
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, head_dim]; the result keeps x's dtype (cos/sin may be float32 under autocast)."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)
