"""What a recipe's loss sees and returns: the loss contract of the one training loop.

A loss is called once per micro-batch with what the model produced (``ModelOutput``: logits, or the final hidden
states plus the output projection's weight when the loss applies the projection itself) and the micro-batch as a
dict (``tokens``, ``labels`` and whatever the recipe's data adds: ``loss_mask``, ``position_ids``,
``document_ids``, teacher logits, advantages, ...; every value is a tensor whose first dimension is the row). It
returns the *sum* of its loss over the micro-batch's loss units (valid tokens, or sequences for a sequence-mean
loss); ``units(batch)`` counts those units before the step. The loop divides every sum by the number of units in
the whole global batch (all micro-batches, pipeline micro-batches and data-parallel ranks), so masking never
re-weights tokens (torchtitan's global token normalisation).

Multi-token prediction (megapipe.models.mtp): a loss that declares ``mtp`` gets each MTP depth's output in
``ModelOutput.mtp`` and returns their loss in ``LossResult.backprop``: depth k's cross-entropy summed over its
labels (``mtp_targets``), times ``mtp_weight`` (mtp_loss_scaling_factor / N), summed over depths. It is divided by
the global batch's units like ``total``: the LM's valid tokens, what Megatron does with per-token loss (MTP sums
scaled by the factor over N, normalised by the main loss's token count), so every micro-batching gives the same
gradients. Each depth's sum is also a metric (``mtp/loss_k``, reported per LM unit); the reported ``loss`` never
includes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megapipe.models.fused_cross_entropy import fused_linear_cross_entropy
from megapipe.models.mtp import shift_left, tokens_ahead

IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    logits: Optional[torch.Tensor] = None  # [B, S, V] (vocabulary-sharded DTensor under TP)
    hidden: Optional[torch.Tensor] = None  # [B, S, H] final normed hidden states, for a fusable loss
    output_weight: Optional[Callable[[], torch.Tensor]] = None  # [V, H], with ``hidden``
    mtp: Optional[list[torch.Tensor]] = None  # MTP depth k's logits (with ``logits``) or hidden (with ``hidden``)
    mtp_weight: float = 0.0  # each depth's loss weight in what is backpropagated (mtp_loss_scaling_factor / N)


@dataclass
class LossResult:
    total: torch.Tensor  # fp32 scalar: the loss summed over the micro-batch's units (reported, after normalising)
    aux: Optional[torch.Tensor] = None  # added to what is backpropagated only (e.g. MoE balancing), already scaled
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # sums over units; reported divided by units
    backprop: Optional[torch.Tensor] = None  # a sum over the same units as total, backpropagated only (MTP)

    def objective(self, factor: float) -> torch.Tensor:
        """What the micro-batch backpropagates: its sums times ``factor`` (the global normalisation), plus aux."""
        out = self.total if self.backprop is None else self.total + self.backprop
        out = out * factor
        return out if self.aux is None else out + self.aux


class Loss:
    """Base of a recipe's loss. ``fusable``: it accepts ``ModelOutput.hidden`` (the loop then lets the model
    return hidden states where the layout allows, and the [tokens, vocab] logits are never materialised)."""

    fusable: bool = False
    mtp: bool = False  # it takes ModelOutput.mtp (the loop then runs a model's MTP modules)
    token_nll: bool = True  # its value is a per-token negative log-likelihood (so exp of it is a perplexity)

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


def mtp_targets(batch: dict, depth: int) -> torch.Tensor:
    """MTP depth ``depth``'s labels: index t gets ``loss_targets`` of index t + depth (the label, and the loss mask,
    shifted with it); IGNORE_INDEX where t + depth is beyond the row or in another document (``document_ids``).
    A batch that carries ``mtp_labels`` (``with_mtp_streams``) has them already."""
    if "mtp_labels" in batch:
        return batch["mtp_labels"][..., depth - 1]
    targets = shift_left(loss_targets(batch), depth, IGNORE_INDEX)
    docs = batch.get("document_ids")
    if docs is not None:
        targets = targets.masked_fill(shift_left(docs, depth, 0) != docs, IGNORE_INDEX)
    return targets


def mtp_metric(depth: int) -> str:
    return f"mtp/loss_{depth}"


def with_mtp_streams(batch: dict, depths: int) -> dict:
    """The batch plus what MTP depths 1..``depths`` read k tokens ahead, computed on the whole rows: ``mtp_tokens``
    (the tokens they embed) and ``mtp_labels`` (their labels), both [B, S, depths]; a layout may then split the
    sequence (context parallelism) or hand a stage hidden states instead of tokens (pipeline parallelism)."""
    labels = torch.stack([mtp_targets(batch, k) for k in range(1, depths + 1)], dim=-1)
    return {**batch, "mtp_tokens": tokens_ahead(batch["tokens"], depths), "mtp_labels": labels}


def _cross_entropy_sum(out: ModelOutput, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the targets that count: ``x`` are hidden states (the fused output projection with
    ``out.output_weight``) when ``out.hidden`` is given, else logits."""
    if out.hidden is not None:
        # the kernel's mean keeps its low-precision GEMM operands small; times the count it is the sum
        count = (targets != IGNORE_INDEX).sum()
        mean = fused_linear_cross_entropy(x, out.output_weight(), targets)
        return mean * count if count > 0 else x.sum() * 0.0
    return torch.nn.functional.cross_entropy(
        x.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class TokenCrossEntropy(Loss):
    """Next-token cross-entropy summed over the tokens that count (label != -100 and inside ``loss_mask``).
    Plain logits, vocabulary-sharded logits (TP, under loss_parallel) or the fused chunked path."""

    fusable = True
    mtp = True

    def units(self, batch: dict) -> torch.Tensor:
        return (loss_targets(batch) != IGNORE_INDEX).sum()

    def __call__(self, out: ModelOutput, batch: dict) -> LossResult:
        main = out.hidden if out.hidden is not None else out.logits
        result = LossResult(total=_cross_entropy_sum(out, main, loss_targets(batch)))
        for depth, x in enumerate(out.mtp or [], start=1):
            depth_sum = _cross_entropy_sum(out, x, mtp_targets(batch, depth))
            result.metrics[mtp_metric(depth)] = depth_sum
            weighted = depth_sum * out.mtp_weight
            result.backprop = weighted if result.backprop is None else result.backprop + weighted
        return result
