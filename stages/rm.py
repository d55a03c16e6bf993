"""``megapipe posttrain rm --load CKPT --data FILE... --save RUN``: a Bradley-Terry reward model on preference pairs
(a recipe of the one training loop: every flag of ``pretrain`` plus the ``rm`` and ``sft`` (data, chat template)
sections). The first launch starts from CKPT's weights with a fresh scalar head; launched again with the same
--save it resumes that run exactly."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import typer

from megapipe.errors import ConfigError
from stages.common import CONFIG_OPTION, SET_OPTION, config_flags
from stages.pretrain import TRAINING_SECTIONS, launch_training, training_config
from stages.sft import BF16, FP16, NNODES, NODE_RANK, NPROC, QUIET, RDZV


@config_flags(*TRAINING_SECTIONS, "rm", "sft", skip=("checkpoint.finetune",))
def rm(
    ctx: typer.Context,
    config: Optional[str] = CONFIG_OPTION,
    bf16: bool = BF16,
    fp16: bool = FP16,
    nproc_per_node: Optional[int] = NPROC,
    nnodes: int = NNODES,
    node_rank: int = NODE_RANK,
    rdzv_endpoint: Optional[str] = RDZV,
    quiet: bool = QUIET,
    sets: Optional[List[str]] = SET_OPTION,
    flags: dict = None,
) -> None:
    """Train a reward model on preference pairs (prompt / chosen / rejected, optional margin): a scalar head on the
    last token, -log sigmoid(r_chosen - r_rejected - margin)."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.posttrain.start import posttrain_checkpoints
    from megapipe.training.recipes.rm import STAGE, RewardModelRecipe

    cfg = training_config(config, flags, sets, bf16, fp16)
    if cfg.checkpoint.load is None:
        raise ConfigError("posttrain rm starts from a checkpoint (a language model or a reward model): give --load "
                          "CKPT")
    if cfg.model.num_labels not in (None, 1):
        raise ConfigError(f"posttrain rm trains a scalar head: model.num_labels = {cfg.model.num_labels} must be 1")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_labels=1))
    cfg = posttrain_checkpoints(cfg, cfg.checkpoint.load, STAGE)
    launch_training(ctx, "posttrain rm", cfg, RewardModelRecipe(cfg.rm, quiet), nproc_per_node, nnodes, node_rank,
                    rdzv_endpoint, quiet)
