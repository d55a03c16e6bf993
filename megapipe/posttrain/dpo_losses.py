"""Preference losses over one batch of pairs, from per-pair sums of answer-token log-probabilities.

Inputs per pair: the policy's summed log-probs of the chosen / rejected answer (``pc``, ``pr``), the answers'
trained-token counts (``nc``, ``nr``) and, for the losses with a reference, the reference's sums (``rc``, ``rr``).
With z = (pc - pr) - (rc - rr), beta and label smoothing e:

- ``sigmoid`` (DPO): -(1 - e) log s(beta z) - e log s(-beta z)
- ``robust``:        (-(1 - e) log s(beta z) + e log s(-beta z)) / (1 - 2e)
- ``hinge``:         max(0, 1 - beta z)
- ``ipo``:           (z' - 1 / (2 beta))^2, z' from the length-averaged log-probs (as TRL)
- ``simpo`` (no reference): -(1 - e) log s(u) - e log s(-u), u = beta (pc / nc - pr / nr) - gamma
- ``orpo``  (no reference): -pc / nc - beta log s(log-odds), log-odds = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)),
  a = the length-averaged log-probs
plus ``rpo_alpha`` x (-pc / nc) with --rpo-alpha (the chosen answer's mean NLL). Rewards: beta x the log-ratio to the
reference (beta x the length-averaged log-prob for the reference-free losses). s is the logistic sigmoid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass(frozen=True)
class PreferenceSpec:
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    rpo_alpha: Optional[float] = None

    @property
    def needs_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    @classmethod
    def from_config(cls, dpo) -> "PreferenceSpec":
        return cls(dpo.loss_type, dpo.beta, dpo.label_smoothing, dpo.simpo_gamma, dpo.rpo_alpha)


def _smoothed_logistic(u: torch.Tensor, e: float) -> torch.Tensor:
    return -(1 - e) * F.logsigmoid(u) - e * F.logsigmoid(-u)


def preference_loss(spec: PreferenceSpec, pc, pr, nc, nr, rc=None, rr=None):
    """(loss per pair, chosen reward, rejected reward), all [pairs] fp32."""
    b, e = spec.beta, spec.label_smoothing
    nc, nr = nc.float(), nr.float()
    t = spec.loss_type
    if t in REFERENCE_FREE:
        ac, ar = pc / nc, pr / nr
        if t == "simpo":
            loss = _smoothed_logistic(b * (ac - ar) - spec.simpo_gamma, e)
        else:
            log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
            loss = -ac - b * F.logsigmoid(log_odds)
        chosen, rejected = b * ac.detach(), b * ar.detach()
    else:
        z = (pc - pr) - (rc - rr)
        if t == "sigmoid":
            loss = _smoothed_logistic(b * z, e)
        elif t == "robust":
            loss = (-(1 - e) * F.logsigmoid(b * z) + e * F.logsigmoid(-b * z)) / (1 - 2 * e)
        elif t == "hinge":
            loss = torch.relu(1 - b * z)
        elif t == "ipo":
            za = (pc / nc - pr / nr) - (rc / nc - rr / nr)
            loss = (za - 1 / (2 * b)) ** 2
        else:
            raise ValueError(f"unknown preference loss {t!r}")
        chosen, rejected = b * (pc - rc).detach(), b * (pr - rr).detach()
    if spec.rpo_alpha:
        loss = loss + spec.rpo_alpha * (-pc / nc)
    return loss, chosen, rejected
