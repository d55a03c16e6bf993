"""GRPO: group-relative advantages, the clipped surrogate with a KL penalty, and the three loss aggregations.

For a prompt with G sampled completions and rewards r_1..r_G, the advantage of completion i is

    A_i = (r_i - mean(r)) / (std + eps)      std: of the group (``group``), of the whole batch (``batch``)
    A_i =  r_i - mean(r)                     ``none`` (Dr. GRPO)

(std unbiased, eps = 1e-4, as TRL). Every token t of completion i is trained with

    l_it = -min(rho_it A_i, clip(rho_it, 1 - clip_low, 1 + clip_high) A_i) + kl_coef * KL_it
    rho_it = exp(logp_it - old_logp_it)

where logp is the policy's log-probability of the sampled token at temperature T (softmax(z / T)), old_logp the
same under the weights that sampled the batch (recomputed by the trainer, so rho = 1 on the batch's first update)
and KL_it an estimate of KL(policy || reference) from the sampled token: k1 = logp - ref_logp, or
k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (non-negative, unbiased; TRL's and DeepSeek's choice).

Aggregation over the global batch (all micro-batches and data-parallel ranks; the loop divides the sums by the
global count of units, megapipe.models.objective):
- ``token-mean``: sum_it l_it / number of completion tokens (DAPO);
- ``seq-mean-token-sum``: sum_i sum_t l_it / number of sequences;
- ``seq-mean-token-mean``: sum_i mean_t l_it / number of sequences (the GRPO paper).
A sequence none of whose tokens is trained (its group dropped by dynamic sampling, or truncated under
--mask-truncated) is no unit at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.models.objective import Loss, LossResult, ModelOutput
from megapipe.posttrain.rl.logprobs import logits_logprobs, token_logprobs

EPS = 1e-4
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def group_advantages(rewards: torch.Tensor, scale: str, all_sum=None) -> torch.Tensor:
    """rewards [groups, G] -> advantages [groups, G]. Scale ``batch`` divides by the unbiased std of the whole batch:
    ``all_sum`` (a list of floats -> their sums over every data-parallel rank; None: this rank holds the batch)
    gathers its count, sum and sum of squares."""
    r = rewards.double()
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    if scale == "group":
        return centred / (r.std(dim=1, keepdim=True) + EPS)
    if scale == "batch":
        n, s1, s2 = (all_sum or list)([float(r.numel()), float(r.sum()), float((r * r).sum())])
        batch_std = max((s2 - s1 * s1 / n) / (n - 1), 0.0) ** 0.5 if n > 1 else 0.0
        return centred / (batch_std + EPS)
    raise ValueError(f"unknown reward scaling {scale!r}")


def degenerate_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[groups] True where every completion of the group got the same reward (no learning signal)."""
    return (rewards == rewards[:, :1]).all(dim=1)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled from the policy."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = ref_logp - logp
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def clipped_surrogate(logp, old_logp, advantages, clip_low: float, clip_high: float):
    """Per-token -min(rho A, clip(rho) A) and where clipping took effect: (loss, low-clipped, high-clipped).
    Low-clipped: rho < 1 - clip_low with A < 0 (the clipped term is the min); high: rho > 1 + clip_high, A > 0."""
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages)
    low = (ratio < 1.0 - clip_low) & (advantages < 0)
    high = (ratio > 1.0 + clip_high) & (advantages > 0)
    return loss, low, high


@dataclass
class GRPOSettings:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = "token-mean"
    temperature: float = 1.0
    chunk: int = 1024


class MismatchMeter:
    """This rank's sums of the engine/trainer log-prob mismatch over a step's micro-batches (sum |d|, max |d|, sum
    k3, count), filled by GRPOLoss when the batch carries the engine's log-probs, read and reset by the recipe."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sums = [0.0, 0.0, 0.0, 0]

    def add(self, engine_lp: torch.Tensor, trainer_lp: torch.Tensor) -> None:
        """d = trainer - engine log-prob per token; k3 = e^d - 1 - d estimates KL(engine || trainer) from tokens
        the engine sampled."""
        d = trainer_lp.detach().double().cpu() - engine_lp.detach().double().cpu()
        if d.numel():
            a, m, k = float(d.abs().sum()), float(d.abs().max()), float((torch.expm1(d) - d).sum())
            s = self.sums
            self.sums = [s[0] + a, max(s[1], m), s[2] + k, s[3] + d.numel()]


def sequence_index(mask: torch.Tensor, document_ids=None) -> tuple[torch.Tensor, int]:
    """Per masked position (row-major): the index of the sequence it belongs to, and the number of sequences. A
    sequence is a row, or a document of a row when the batch packs several (``document_ids``)."""
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand(mask.shape)
    key = rows if document_ids is None else rows * (int(document_ids.max()) + 1) + document_ids
    unique, index = torch.unique(key[mask], return_inverse=True)
    return index, unique.numel()


class GRPOLoss(Loss):
    """The recipe's loss over a micro-batch of rollouts. Batch keys: ``tokens``, ``labels`` [B, S];
    ``completion_mask`` [B, S] (label positions trained on); ``advantages`` [B] (one per row) or [B, S] (per
    position, rows packing several completions); ``old_logprobs`` (and ``ref_logprobs`` with a KL penalty)
    [B, S], read where the mask is set. Without ``old_logprobs`` the update is on-policy: the old log-prob is the
    policy's own, detached (rho = 1, the first update of a batch, without a separate scoring pass).

    Packed rows (one prompt, then several completions: ``document_ids`` / ``prefix_ids`` / ``position_ids``, see
    megapipe.models.attention.DocumentMask) are sequences per document for the seq-mean aggregations. With a
    ``meter`` and the batch's ``engine_logprobs`` / ``sampled_mask``, the log-probs of every sampled token at
    temperature 1 are compared with the engine's (MismatchMeter), in the same forward."""

    fusable = True

    def __init__(self, settings: GRPOSettings, meter: MismatchMeter | None = None):
        if settings.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {settings.aggregation!r}")
        self.s = settings
        self.meter = meter

    def units(self, batch: dict) -> torch.Tensor:
        mask = batch["completion_mask"]
        if self.s.aggregation == "token-mean":
            return mask.sum()
        return torch.tensor(sequence_index(mask, batch.get("document_ids"))[1])

    def policy_logprobs(self, out: ModelOutput, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp, entropy) of the labels at the trained positions, in row-major order; measures the mismatch on
        the way when the batch carries the engine's log-probs."""
        mask, t = batch["completion_mask"], self.s.temperature
        if self.meter is None or "engine_logprobs" not in batch:
            return masked_logprobs(out, batch["labels"], mask, t, self.s.chunk)
        sampled = batch["sampled_mask"]
        logp, entropy = masked_logprobs(out, batch["labels"], sampled, t, self.s.chunk)
        raw = logp
        if t != 1.0:
            with torch.no_grad():
                raw = masked_logprobs(out, batch["labels"], sampled, 1.0, self.s.chunk)[0]
        self.meter.add(batch["engine_logprobs"][sampled], raw)
        trained = mask[sampled]
        return logp[trained], entropy[trained]

    def weights(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per trained token: (its weight in the loss sum, its weight in the per-token metrics). The loss weighs 1,
        or 1 / the length of its sequence (seq-mean-token-mean); metrics are averaged like the loss's units: over
        tokens (token-mean), or per sequence then over sequences (the seq-mean aggregations)."""
        mask = batch["completion_mask"]
        ones = torch.ones(int(mask.sum()), device=mask.device)
        if self.s.aggregation == "token-mean":
            return ones, ones
        index, n = sequence_index(mask, batch.get("document_ids"))
        inverse = 1.0 / torch.bincount(index, minlength=n).float()[index]
        return (inverse if self.s.aggregation == "seq-mean-token-mean" else ones), inverse

    def __call__(self, out: ModelOutput, batch: dict) -> LossResult:
        s, mask = self.s, batch["completion_mask"]
        logp, entropy = self.policy_logprobs(out, batch)
        old = batch["old_logprobs"][mask] if "old_logprobs" in batch else logp.detach()
        adv = batch["advantages"]
        adv = (adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv)[mask].float()
        pg, low, high = clipped_surrogate(logp, old, adv, s.clip_low, s.clip_high)
        per_token = pg
        w, metrics_w = self.weights(batch)
        metrics = {}
        if s.kl_coef > 0:
            kl = kl_estimate(logp, batch["ref_logprobs"][mask], s.kl_estimator)
            per_token = per_token + s.kl_coef * kl
            metrics["kl"] = (kl.detach() * metrics_w).sum()
        total = (per_token * w).sum()
        metrics.update({
            "pg_loss": (pg.detach() * w).sum(),
            "entropy": (entropy * metrics_w).sum(),
            "clip_low": (low.float() * metrics_w).sum(),
            "clip_high": (high.float() * metrics_w).sum(),
        })
        return LossResult(total=total, metrics=metrics)


def masked_logprobs(out: ModelOutput, labels: torch.Tensor, mask: torch.Tensor, temperature: float,
                    chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(z / T)[label] and the entropy at the positions where ``mask`` is set, from the model's hidden
    states (chunked through the output projection) or from its logits."""
    targets = labels[mask]
    if out.hidden is not None:
        return token_logprobs(out.hidden[mask], out.output_weight(), targets, temperature, chunk)
    return logits_logprobs(out.logits[mask], targets, temperature, chunk)
