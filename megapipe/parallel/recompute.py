"""Activation recompute and torch.compile, applied per transformer block in place (parameter names unchanged).

- ``full``: every block's activations are dropped after forward and the block is re-run in backward
  (torch.utils.checkpoint, non-reentrant).
- ``selective``: op-level selective checkpointing: inside a block the outputs of matmuls, attention kernels and
  the tensor-parallel reductions are saved; the cheap memory-bound ops (norms, activations, RoPE, residual adds,
  softmax pieces of non-fused attention) are recomputed. This keeps ~all of the FLOPs saved while dropping the
  element-wise intermediates, the spirit of Korthikanti et al.'s selective recompute.
We patch ``block.forward`` rather than wrapping the module so state-dict keys stay ``layers.N.…`` for checkpoints.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _save_ops() -> set:
    aten = torch.ops.aten
    names = [
        (aten, "mm"), (aten, "addmm"), (aten, "bmm"), (aten, "baddbmm"), (aten, "linear"),
        (aten, "_scaled_dot_product_flash_attention"), (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_flash_attention_for_cpu"), (aten, "_scaled_dot_product_cudnn_attention"),
    ]
    ops = {getattr(ns, n).default for ns, n in names if hasattr(ns, n)}
    func = getattr(torch.ops, "_c10d_functional", None)
    for n in ("reduce_scatter_tensor", "all_reduce"):
        if func is not None and hasattr(func, n):
            ops.add(getattr(func, n).default)
    return ops


def _selective_context():
    save = _save_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, selective: bool):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        extra = {"context_fn": _selective_context} if selective else {}
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    return run


def apply_recompute(model: torch.nn.Module, mode: str) -> None:
    """mode: 'none', 'selective' or 'full' (cfg.train.recompute)."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"unknown recompute mode {mode!r}")
    for block in model.layers.values():
        block.forward = _checkpointed(block.forward, selective=mode == "selective")


def apply_compile(model: torch.nn.Module) -> None:
    """torch.compile each block in place (one graph per block; blocks share it as they have the same code)."""
    for block in model.layers.values():
        block.compile()
