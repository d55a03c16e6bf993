"""Every private PyTorch API megapipe calls, in one place, each with why it is used and what replaces it.

They are checked against the torch this package was tested with (``TESTED_TORCH``): a newer torch still runs, but
``check()`` (called by the test suite) names any of them that disappeared, so an upgrade fails one test with the
culprit rather than a stage deep inside a run.
"""

from __future__ import annotations

import torch

TESTED_TORCH = "2.13"


def reorder_linear_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """oneDNN's blocked layout of a linear weight for ``batch_hint`` rows (what inductor's freezing does): no public
    API packs a weight once for many matmuls on CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def linear_pointwise(x, packed, bias, activation: str = "none") -> torch.Tensor:
    """oneDNN's matmul on a packed weight with a fused post-op (``swish``, ``none``, ...)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, activation, [], "")


def linear_pointwise_binary(x, other, packed, bias, op: str) -> torch.Tensor:
    """oneDNN's matmul on a packed weight, then ``op`` (``mul``, ``add``) with ``other`` before rounding."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, op)


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One GEMM per group of rows of ``a`` (``offs``: cumulative row counts) with the group's matrix of ``b``: MoE
    experts in one call; torch has no public grouped GEMM yet (2.13)."""
    return torch._grouped_mm(a, b, offs=offs)


def unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and set ``found_inf`` when one holds an inf or nan: the fused
    kernel torch.amp.GradScaler uses, which GradScaler itself cannot run on DTensor shards across our layouts."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def replicate(model, **kwargs):
    """DDP as a composable API on a DeviceMesh (torch's replacement of DistributedDataParallel for FSDP2 meshes;
    still under ``_composable`` in 2.13)."""
    from torch.distributed._composable.replicate import replicate as _replicate

    return _replicate(model, **kwargs)


def set_state_dict_element(state: dict, path, value) -> None:
    """Put ``value`` at ``path`` (a DCP object path) in a nested state dict: the helper DCP's DefaultLoadPlanner uses
    for non-tensor entries, which our safe loader (checkpoint/safe_dcp.py) mirrors."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state, path, value)


def check() -> list[str]:
    """The private APIs above that this torch lacks (empty when all are there)."""
    import importlib

    missing = []
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(torch.ops.mkldnn, name):
            missing.append(f"torch.ops.mkldnn.{name}")
    for name in ("_grouped_mm", "_amp_foreach_non_finite_check_and_unscale_"):
        if not hasattr(torch, name):
            missing.append(f"torch.{name}")
    for module, attr in (("torch.distributed._composable.replicate", "replicate"),
                         ("torch.distributed.checkpoint._traverse", "set_element")):
        try:
            if not hasattr(importlib.import_module(module), attr):
                missing.append(f"{module}.{attr}")
        except ImportError:
            missing.append(f"{module}.{attr}")
    return missing
