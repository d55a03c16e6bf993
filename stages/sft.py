"""``megapipe posttrain sft --load CKPT --data FILE... --save RUN``: supervised fine-tuning (a recipe of the one
training loop: every flag of ``pretrain`` for optimisation, layout, precision, eval and checkpoints, plus the
``sft`` and ``lora`` sections). The first launch starts from CKPT's weights; launched again with the same --save it
resumes that run exactly. ``megapipe posttrain projector`` is the same command over the projector recipe (LLaVA's
stage 1 on image-caption pairs), without the lora section."""

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


def sft_command(stage: str, recipe: str, doc: str, sections: tuple = ("sft", "lora"), skip: tuple = (),
                from_scratch: bool = True):
    """The command of a recipe that trains on SFT records (posttrain sft, posttrain projector): ``recipe`` is
    ``module:Class`` under megapipe.training.recipes (imported when the command runs: torch stays out of --help);
    ``from_scratch``: --model PRESET may stand in for --load."""

    def command(
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
        import importlib

        from megapipe.posttrain.start import posttrain_checkpoints

        module, name = recipe.split(":")
        recipe_class = getattr(importlib.import_module(f"megapipe.training.recipes.{module}"), name)
        cfg = training_config(config, flags, sets, bf16, fp16)
        if cfg.checkpoint.load is None and not (from_scratch and cfg.model.preset is not None):
            raise ConfigError(f"posttrain {stage} starts from a checkpoint: give --load CKPT"
                              + (" (or --model PRESET to train a model from scratch)" if from_scratch else ""))
        cfg = posttrain_checkpoints(cfg, cfg.checkpoint.load, stage)
        launch_training(ctx, f"posttrain {stage}", cfg, recipe_class(quiet), nproc_per_node, nnodes, node_rank,
                        rdzv_endpoint, quiet)

    command.__doc__ = doc
    command.__name__ = stage
    return config_flags(*TRAINING_SECTIONS, *sections, skip=("checkpoint.finetune", *skip))(command)


sft = sft_command("sft", "sft:SFTRecipe", "Fine-tune on chat, prompt/completion or text records: loss on the "
                  "assistant's tokens, packing, LoRA.")
projector = sft_command(
    "projector", "projector:ProjectorRecipe", "Pretrain a vision-language model's projector on image-caption pairs "
    "(LLaVA's stage 1): tower and decoder frozen, loss on the captions.", sections=("sft",),
    skip=("sft.train_on_prompt", "sft.freeze_vision", "sft.freeze_projector"), from_scratch=False)
