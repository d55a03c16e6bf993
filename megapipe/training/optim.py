"""Optimizer construction with Megatron's weight-decay groups (clipping: megapipe.parallel.step.clip_grad_norm_)."""

from __future__ import annotations

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's rule: biases and 1-D weights (norm scales) get no weight decay; matrices (embeddings too) do."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _is_dtensor(p: torch.Tensor) -> bool:
    return type(p).__name__ == "DTensor"


def build_optimizer(model: nn.Module, optim_cfg, lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, optim_cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    # The fused kernels do one pass over each tensor (CPU and CUDA); DTensor shards take the foreach path.
    impl = {"foreach": True} if any(_is_dtensor(p) for p in params) else {"fused": True}
    if optim_cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.0, **impl)
    return torch.optim.AdamW(
        groups, lr=lr, betas=(optim_cfg.adam_beta1, optim_cfg.adam_beta2), eps=optim_cfg.adam_eps, **impl
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr

