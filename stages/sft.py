"""``megapipe posttrain sft --load CKPT --data FILE... --save RUN``: supervised fine-tuning (a recipe of the one
training loop: every flag of ``pretrain`` for optimisation, layout, precision, eval and checkpoints, plus the
``sft`` and ``lora`` sections). The first launch starts from CKPT's weights; launched again with the same --save it
resumes that run exactly."""

from __future__ import annotations

from typing import List, Optional

import typer

from megapipe.errors import ConfigError
from stages.common import CONFIG_OPTION, SET_OPTION, config_flags
from stages.pretrain import TRAINING_SECTIONS, launch_training, training_config

BF16 = typer.Option(False, "--bf16", help="Same as --precision bf16.")
FP16 = typer.Option(False, "--fp16", help="Same as --precision fp16.")
NPROC = typer.Option(None, "--nproc-per-node", help="Start this many processes here under torchrun (one per GPU).")
NNODES = typer.Option(1, "--nnodes", help="Nodes of a multi-node run (every node runs the same command).")
NODE_RANK = typer.Option(0, "--node-rank", help="This node's index in [0, nnodes).")
RDZV = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous.")
QUIET = typer.Option(False, "--quiet", "-q", help="No console output but errors.")


@config_flags(*TRAINING_SECTIONS, "sft", "lora", skip=("checkpoint.finetune",))
def sft(
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
    """Fine-tune on chat, prompt/completion or text records: loss on the assistant's tokens, packing, LoRA."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.posttrain.start import posttrain_checkpoints
    from megapipe.training.recipes.sft import SFTRecipe

    cfg = training_config(config, flags, sets, bf16, fp16)
    if cfg.checkpoint.load is None and cfg.model.preset is None:
        raise ConfigError("posttrain sft starts from a checkpoint: give --load CKPT (or --model PRESET to train a "
                          "model from scratch)")
    cfg = posttrain_checkpoints(cfg, cfg.checkpoint.load, "sft")
    launch_training(ctx, "posttrain sft", cfg, SFTRecipe(quiet), nproc_per_node, nnodes, node_rank, rdzv_endpoint,
                    quiet)


@config_flags(*TRAINING_SECTIONS, "sft",
              skip=("checkpoint.finetune", "sft.train_on_prompt", "sft.freeze_vision", "sft.freeze_projector"))
def projector(
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
    """Pretrain a vision-language model's projector on image-caption pairs (LLaVA's stage 1): tower and decoder
    frozen, loss on the captions."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.posttrain.start import posttrain_checkpoints
    from megapipe.training.recipes.projector import ProjectorRecipe

    cfg = training_config(config, flags, sets, bf16, fp16)
    if cfg.checkpoint.load is None:
        raise ConfigError("posttrain projector starts from a vision-language checkpoint: give --load CKPT")
    cfg = posttrain_checkpoints(cfg, cfg.checkpoint.load, "projector")
    launch_training(ctx, "posttrain projector", cfg, ProjectorRecipe(quiet), nproc_per_node, nnodes, node_rank,
                    rdzv_endpoint, quiet)
