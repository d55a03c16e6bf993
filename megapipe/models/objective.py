"""What a recipe's loss sees and returns: the loss contract of the one training loop.

A loss is called once per micro-batch with what the model produced (``ModelOutput``: logits, or the final hidden
states plus the output projection's weight when the loss applies the projection itself) and the micro-batch as a
dict (``tokens``, ``labels`` and whatever the recipe's data adds: ``loss_mask``, ``position_ids``,
``document_ids``, teacher logits, advantages, ...; every value is a tensor whose first dimension is the row). It
returns the *sum* of its loss over the micro-batch's loss units (valid tokens, or sequences for a sequence-mean
loss); ``units(batch)`` counts those units before the step. The loop divides every sum by the number of units in
the whole global batch (all micro-batches, pipeline micro-batches and data-parallel ranks), so masking never
re-weights tokens (torchtitan's global token normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megapipe.models.fused_cross_entropy import fused_linear_cross_entropy

IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    logits: Optional[torch.Tensor] = None  # [B, S, V] (vocabulary-sharded DTensor under TP)
    hidden: Optional[torch.Tensor] = None  # [B, S, H] final normed hidden states, for a fusable loss
    output_weight: Optional[Callable[[], torch.Tensor]] = None  # [V, H], with ``hidden``


@dataclass
class LossResult:
    total: torch.Tensor  # fp32 scalar: the loss summed over the micro-batch's units (reported, after normalising)
    aux: Optional[torch.Tensor] = None  # added to what is backpropagated only (e.g. MoE balancing), already scaled
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # sums over units; reported divided by units


class Loss:
    """Base of a recipe's loss. ``fusable``: it accepts ``ModelOutput.hidden`` (the loop then lets the model
    return hidden states where the layout allows, and the [tokens, vocab] logits are never materialised)."""

    fusable: bool = False

    def units(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, out: ModelOutput, batch: dict) -> LossResult:
        raise NotImplementedError


def loss_targets(batch: dict) -> torch.Tensor:
    """The labels with every position outside ``loss_mask`` (when the batch has one) set to IGNORE_INDEX."""
    labels = batch["labels"]
    mask = batch.get("loss_mask")
    if mask is None:
        return labels
    return labels.masked_fill(~mask.bool(), IGNORE_INDEX)


class TokenCrossEntropy(Loss):
    """Next-token cross-entropy summed over the tokens that count (label != -100 and inside ``loss_mask``).
    Plain logits, vocabulary-sharded logits (TP, under loss_parallel) or the fused chunked path."""

    fusable = True

    def units(self, batch: dict) -> torch.Tensor:
        return (loss_targets(batch) != IGNORE_INDEX).sum()

    def __call__(self, out: ModelOutput, batch: dict) -> LossResult:
        targets = loss_targets(batch)
        if out.hidden is not None:
            # the kernel's mean keeps its low-precision GEMM operands small; times the count it is the sum
            count = (targets != IGNORE_INDEX).sum()
            mean = fused_linear_cross_entropy(out.hidden, out.output_weight(), targets)
            total = mean * count if count > 0 else out.hidden.sum() * 0.0
        else:
            total = torch.nn.functional.cross_entropy(
                out.logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        return LossResult(total=total)
