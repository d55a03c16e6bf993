"""Mixed precision: autocast contexts (weights stay fp32) and a dynamic loss scaler for fp16.

fp16 has a narrow exponent, so small gradients underflow: the loss is multiplied by a large scale before backward,
gradients are divided by it before the update. An inf/nan in any gradient means the scale was too large: the step is
skipped and the scale halved (not below ``min_scale``); after ``growth_interval`` clean steps in a row it doubles.
"""

from __future__ import annotations

import contextlib

import torch

from megapipe import torch_compat
from megapipe.dtypes import PRECISION_DTYPES
from megapipe.parallel.distributed import all_reduce_max_


def autocast(precision: str, device_type: str):
    """Context for the forward pass; fp32 needs none (and must not be touched, for bitwise resume)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=PRECISION_DTYPES[precision])


class DynamicLossScaler:
    def __init__(
        self,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.clean_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, params) -> bool:
        """Divide every gradient by the scale in place; True when a gradient holds an inf or nan."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return False
        found_inf = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        inv = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=grads[0].device)
        by_device: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(_local(g))
        for group in by_device.values():
            torch_compat.unscale_and_check_(group, found_inf, inv)
        all_reduce_max_(found_inf)
        return bool(found_inf.item())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor gradient (unscaling is elementwise, so shards are enough)."""
    return t.to_local() if hasattr(t, "to_local") else t
