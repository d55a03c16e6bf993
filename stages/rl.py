"""``megapipe posttrain rl --load CKPT --task TASK --save RUN``: GRPO with verifiable rewards (a recipe of the one
training loop: the optimisation, layout, precision and checkpoint flags of ``pretrain``, plus the ``rl`` section).
The first launch starts from CKPT's weights; launched again with the same --save it resumes that run exactly. With
--nproc-per-node N (FSDP or DDP) every rank samples its share of the prompts with its own engine."""

from __future__ import annotations

from typing import List, Optional

import typer

from megapipe.errors import ConfigError
from stages.common import CONFIG_OPTION, SET_OPTION, config_flags
from stages.pretrain import launch_training, training_config

# the model comes from --load; the batch and sequence length from the rl section; evaluation is the rollouts' own
SKIPPED = ("checkpoint.finetune", "train.global_batch_size", "train.train_tokens", "train.eval_interval",
           "train.eval_iters")


@config_flags("train", "optim", "checkpoint", "parallel", "rl", skip=SKIPPED)
def rl(
    ctx: typer.Context,
    config: Optional[str] = CONFIG_OPTION,
    bf16: bool = typer.Option(False, "--bf16", help="Same as --precision bf16."),
    fp16: bool = typer.Option(False, "--fp16", help="Same as --precision fp16."),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", help="Start this many processes here under torchrun (one per GPU)."),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes of a multi-node run (every node runs the same command)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's index in [0, nnodes)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No console output but errors."),
    sets: Optional[List[str]] = SET_OPTION,
    flags: dict = None,
) -> None:
    """Reinforcement learning with verifiable rewards (GRPO): rollouts from the in-process engine, rewards from the
    task or your functions, measured train/inference agreement."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.parallel.launch import planned_world_size
    from megapipe.training.recipes.rl import RLRecipe, check_world_size, rl_config

    cfg = rl_config(_config(config, flags, sets, bf16, fp16))
    check_world_size(cfg, planned_world_size(nproc_per_node, nnodes))
    launch_training(ctx, "posttrain rl", cfg, RLRecipe(cfg.rl), nproc_per_node, nnodes, node_rank, rdzv_endpoint,
                    quiet)


def _config(config, flags, sets, bf16: bool, fp16: bool):
    """The training config with its global batch set to rl.prompts_per_step x rl.group_size before the checks
    that read it (a first pass reads the rl section)."""
    probe = training_config(config, flags, [*(sets or []), "train.global_batch_size=1", "train.micro_batch_size=1"],
                            bf16, fp16)
    p, g = probe.rl.prompts_per_step, probe.rl.group_size
    try:
        return training_config(config, flags, [*(sets or []), f"train.global_batch_size={p * g}"], bf16, fp16)
    except ConfigError as e:
        raise ConfigError(f"{e} (posttrain rl: the global batch is rl.prompts_per_step x rl.group_size = {p} x {g} "
                          "sequences)") from None
