"""Normalisation layers. RMSNorm computes in float32 and casts back, so bf16 runs match the fp32 reference closely."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def build_norm(norm_type: str, dim: int, eps: float) -> nn.Module:
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps)
    return nn.LayerNorm(dim, eps=eps)


def init_norm(norm: nn.Module) -> None:
    nn.init.ones_(norm.weight)
    if getattr(norm, "bias", None) is not None:
        nn.init.zeros_(norm.bias)
