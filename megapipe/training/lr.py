"""Learning-rate schedules with Megatron's formulas: linear warmup, then cosine / linear / WSD / constant to min_lr.

``lr_at(n)`` is the rate for the update that follows ``n - 1`` successful updates (n = 1 for the first one), so a
warmup of W steps reaches the peak rate on update W, and decay ends at ``decay_iters`` with ``min_lr``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from megapipe.errors import CheckpointError


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str  # cosine | linear | wsd | constant
    wsd_decay_iters: int = 0  # wsd: the last this-many of decay_iters anneal
    wsd_decay_style: str = "linear"  # linear | cosine | exponential | minus_sqrt

    @classmethod
    def from_train_config(cls, t, train_iters: int) -> "LRSchedule":
        decay = t.lr_decay_iters or train_iters
        return cls(
            max_lr=t.lr,
            min_lr=t.min_lr,
            warmup_iters=t.lr_warmup_iters,
            decay_iters=decay,
            style=t.lr_decay_style,
            wsd_decay_iters=round(t.lr_wsd_decay_fraction * decay),
            wsd_decay_style=t.lr_wsd_decay_style,
        )

    def lr_at(self, n: int) -> float:
        if self.warmup_iters > 0 and n <= self.warmup_iters:
            return self.max_lr * n / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if n > self.decay_iters:
            return self.min_lr
        delta = self.max_lr - self.min_lr
        if self.style == "wsd":
            return self.min_lr + _wsd_coeff(n, self.decay_iters, self.wsd_decay_iters, self.wsd_decay_style) * delta
        span = self.decay_iters - self.warmup_iters
        ratio = (n - self.warmup_iters) / span if span > 0 else 1.0
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"unknown lr decay style {self.style!r}")
        return self.min_lr + coeff * delta

    def state_dict(self) -> dict:
        return asdict(self)

    def check_resumable(self, saved: dict) -> None:
        """Megatron refuses to resume into a different schedule silently; so do we (names the first differing key)."""
        for key, value in self.state_dict().items():
            if key in saved and saved[key] != value:
                raise CheckpointError(
                    f"the checkpoint's LR schedule has {key} = {saved[key]!r} but this run has {value!r}; "
                    "use --finetune to start a new schedule from its weights"
                )


def _wsd_coeff(n: int, decay_iters: int, anneal_iters: int, style: str) -> float:
    start = decay_iters - anneal_iters
    if n <= start or anneal_iters <= 0:
        return 1.0
    r = (n - start) / anneal_iters
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * r) + 1.0)
    if style == "exponential":
        return 2.0 * 0.5**r - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(r)
    raise ValueError(f"unknown wsd decay style {style!r}")
