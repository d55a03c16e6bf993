"""Bradley-Terry reward models (``megapipe posttrain rm``): the decoder with a scalar head (``model.num_labels`` =
1: the output projection gives one score per position) read at each sequence's last non-pad token, trained on the
preference pairs of megapipe.data.preference with ``-log sigmoid(r_chosen - r_rejected - margin)`` (the pair's
optional ``margin`` field) plus ``center_rewards_coefficient * (r_chosen + r_rejected)^2``, on the one training loop.

A loss unit is a pair; both sides are in one micro-batch (one packed row, the prompt once, where the model takes
packed documents; else two rows). The head starts fresh (normal, init_std) when the start checkpoint is a language
model. Logged per step and on the validation split: the rewards of each side, their margin and the preference
accuracy. Layouts: data parallelism (FSDP / DDP), as DPO.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.checkpoint import load_checkpoint, read_manifest
from megapipe.data.preference import RewardSamples
from megapipe.errors import ConfigError
from megapipe.models.objective import LossResult, ModelOutput
from megapipe.posttrain.lora import lora_spec
from megapipe.posttrain.reward_model import MANIFEST_KEY
from megapipe.posttrain.start import START_KEY, start_of
from megapipe.training.recipes.base import RunContext
from megapipe.training.recipes.dpo import DPORecipe, PreferenceLoss, pair_sums

STAGE = "rm"


def pair_rewards(out: ModelOutput, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [pairs, 2], margins [pairs]) of a micro-batch of ``RewardSamples`` rows."""
    mask = batch["loss_mask"].bool()
    if out.hidden is not None:
        scores = F.linear(out.hidden[mask], out.output_weight())[:, 0]
    else:
        scores = out.logits[mask][:, 0]
    rewards = pair_sums(scores.float(), batch)[0]
    margins = pair_sums(batch["margin"][mask], batch)[0][:, 0]
    return rewards, margins


class RewardLoss(PreferenceLoss):
    def __init__(self, center_rewards_coefficient: float | None):
        self.center = center_rewards_coefficient

    def __call__(self, out: ModelOutput, batch: dict) -> LossResult:
        rewards, margins = pair_rewards(out, batch)
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        loss = -F.logsigmoid(chosen - rejected - margins)
        if self.center:
            loss = loss + self.center * (chosen + rejected) ** 2
        c, r = chosen.detach(), rejected.detach()
        metrics = {"rewards/chosen": c.sum(), "rewards/rejected": r.sum(), "rewards/margin": (c - r).sum(),
                   "rewards/accuracy": (c > r).float().sum()}
        return LossResult(total=loss.sum(), metrics=metrics)


def is_head(key: str) -> bool:
    return key.startswith("output.")


class RewardModelRecipe(DPORecipe):
    stage = STAGE
    samples = RewardSamples
    command = "posttrain rm"

    def __init__(self, rm_cfg, quiet: bool = False):
        super().__init__(None, quiet)
        self.center = rm_cfg.center_rewards_coefficient

    def loss(self) -> RewardLoss:
        return RewardLoss(self.center)

    @property
    def loss_name(self) -> str:
        return "Bradley-Terry"

    def check(self, run) -> None:
        if run.cfg.model.num_labels != 1:
            raise ConfigError(f"posttrain rm trains a scalar head: model.num_labels = {run.cfg.model.num_labels} "
                              "must be 1")
        if lora_spec(run.cfg) is not None:
            raise ConfigError("posttrain rm trains the whole model and its head: --lora-rank is not supported")
        super().check(run)

    def load_weights(self, ctx: RunContext, model, ckpt) -> None:
        """A language model's weights without its output projection (the reward head starts fresh); a reward
        model's whole."""
        lm = not read_manifest(ckpt)["model"].get("num_labels")
        load_checkpoint(ckpt, model, optimizer=None, load_optim=False, load_rng=False, skip=is_head if lm else None)

    def manifest(self, ctx: RunContext) -> dict:
        return {START_KEY: start_of(ctx.resume, ctx.parent), MANIFEST_KEY: {
            "score": "last non-pad token", "pad_id": ctx.tokenizer.pad_id,
            "center_rewards_coefficient": self.center, "data": list(ctx.cfg.sft.data),
            "chat_template": self._encoder.template_name, "index": str(self._index.path),
            "pair_layout": "packed" if self.datasets(ctx)["train"].packed else "rows",
        }}
