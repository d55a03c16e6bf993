"""The Mamba-2 mixer's fused tensors in Hugging Face checkpoints (Nemotron-H, Falcon-H1, Mamba2): ``in_proj`` is
[z | x | B | C | dt] (megapipe's ``in_z``, ``in_x``, ``in_B``, ``in_C``, ``in_dt``) and ``conv1d`` runs over the
channels [x | B | C] with a weight [C, 1, K] (megapipe's ``conv_x``, ``conv_B``, ``conv_C``, weights [C, K]); the
conversions split them on import and join them on export. ``time_step_limit`` [lo, hi] is the clamp on dt (after its
bias and softplus), megapipe's ``mamba_dt_limit``; ``time_step_min``/``time_step_max`` are only dt_bias's init range."""

from __future__ import annotations

import math
from typing import Any

import torch

from megapipe.checkpoint.hf.base import Conversion
from megapipe.config import ModelConfig


def _splitter(sizes: list[int], conv: bool):
    """[sum(sizes), ...] (a conv weight: [sum, 1, K]) -> the parts, each [size, ...] (a conv's: [size, K])."""
    def to_mp(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        whole = tensors[0][:, 0] if conv and tensors[0].dim() == 3 else tensors[0]
        return [t.clone() for t in whole.split(sizes, dim=0)]
    return to_mp


def _joiner(conv: bool):
    def to_hf(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        whole = torch.cat(tensors, dim=0)
        return [whole[:, None] if conv and whole.dim() == 2 else whole]
    return to_hf


def fused_mamba_conversions(cfg: ModelConfig, mp: str, hf: str) -> list[Conversion]:
    """The in_proj and conv1d tensors (weights, and biases where the config has them) of the mixer megapipe names
    ``mp`` (e.g. "layers.3.mixer") and the checkpoint ``hf`` (e.g. "model.layers.3.mamba")."""
    inner, gn, heads = cfg.mamba_inner, cfg.mamba_num_groups * cfg.mamba_state_dim, cfg.mamba_heads
    out = []
    for param in ["weight"] + (["bias"] if cfg.mamba_proj_bias else []):
        out.append(Conversion(hf=(f"{hf}.in_proj.{param}",),
                              mp=tuple(f"{mp}.in_{p}.{param}" for p in ("z", "x", "B", "C", "dt")),
                              to_mp=_splitter([inner, inner, gn, gn, heads], False), to_hf=_joiner(False)))
    for param in ["weight"] + (["bias"] if cfg.mamba_conv_bias else []):
        conv = param == "weight"
        out.append(Conversion(hf=(f"{hf}.conv1d.{param}",), mp=tuple(f"{mp}.conv_{p}.{param}" for p in "xBC"),
                              to_mp=_splitter([inner, gn, gn], conv), to_hf=_joiner(conv)))
    return out


def dt_limit_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """``time_step_limit`` (absent: no clamp, [0, inf)) as megapipe's dt limit fields."""
    lo, hi = hf.get("time_step_limit") or (0.0, math.inf)
    return dict(mamba_dt_limit_min=float(lo), mamba_dt_limit_max=None if math.isinf(float(hi)) else float(hi))


def dt_limit_to_hf(cfg: ModelConfig) -> list[float]:
    return list(cfg.mamba_dt_limit)
