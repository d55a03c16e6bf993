"""``megapipe posttrain dpo --load CKPT --data FILE... --save RUN``: preference optimisation (a recipe of the one
training loop: every flag of ``pretrain`` plus the ``dpo``, ``sft`` (data, chat template) and ``lora`` sections).
The first launch starts from CKPT's weights (CKPT is also the reference); launched again with the same --save it
resumes that run exactly."""

from __future__ import annotations

from typing import List, Optional

import typer

from megapipe.errors import ConfigError
from stages.common import CONFIG_OPTION, SET_OPTION, config_flags
from stages.pretrain import TRAINING_SECTIONS, launch_training, training_config
from stages.sft import BF16, FP16, NNODES, NODE_RANK, NPROC, QUIET, RDZV


@config_flags(*TRAINING_SECTIONS, "dpo", "sft", "lora", skip=("checkpoint.finetune",))
def dpo(
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
    """Train on preference pairs (prompt / chosen / rejected): DPO, IPO, hinge, robust, SimPO, ORPO; LoRA."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.posttrain.start import posttrain_checkpoints
    from megapipe.training.recipes.dpo import STAGE, DPORecipe

    cfg = training_config(config, flags, sets, bf16, fp16)
    if cfg.checkpoint.load is None:
        raise ConfigError("posttrain dpo starts from a checkpoint (also its reference): give --load CKPT")
    cfg = posttrain_checkpoints(cfg, cfg.checkpoint.load, STAGE)
    launch_training(ctx, "posttrain dpo", cfg, DPORecipe(cfg.dpo, quiet), nproc_per_node, nnodes, node_rank,
                    rdzv_endpoint, quiet)
