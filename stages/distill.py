"""``megapipe posttrain distill --teacher CKPT --student CKPT|--student-model PRESET --data-path ... --save RUN``:
logit distillation (a recipe of the one training loop: every flag of ``pretrain`` plus the ``distill`` section).
The first launch starts from the student checkpoint's weights (or a fresh PRESET model with the teacher's
tokenizer); launched again with the same --save it resumes that run exactly."""

from __future__ import annotations

from typing import List, Optional

import typer

from megapipe.errors import ConfigError
from stages.common import CONFIG_OPTION, SET_OPTION, config_flags
from stages.pretrain import TRAINING_SECTIONS, launch_training, training_config
from stages.sft import BF16, FP16, NNODES, NODE_RANK, NPROC, QUIET, RDZV


@config_flags(*TRAINING_SECTIONS, "distill", "sft", skip=("checkpoint.finetune", "checkpoint.load"))
def distill(
    ctx: typer.Context,
    config: Optional[str] = CONFIG_OPTION,
    student_model: Optional[str] = typer.Option(
        None, "--student-model", help="A fresh student of this model preset (instead of --student CKPT)."),
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
    """Distill a teacher into a student: forward / reverse KL or generalized JSD on the logits, mixed with the LM
    loss by --kd-alpha."""
    from pathlib import Path

    # lazy: imports torch; megapipe --help stays fast
    from megapipe.checkpoint import resolve_checkpoint
    from megapipe.posttrain.start import posttrain_checkpoints
    from megapipe.training.recipes.distill import DistillRecipe

    if student_model is not None:
        if flags.get("model.preset") is not None:
            raise ConfigError("--student-model and --model are both given: choose one")
        flags = {**flags, "model.preset": student_model}
    cfg = training_config(config, flags, sets, bf16, fp16)
    kd = cfg.distill
    if kd.teacher is None:
        raise ConfigError("distill.teacher (--teacher) is not set: give the teacher checkpoint")
    if (kd.student is None) == (cfg.model.preset is None):
        raise ConfigError("give the student: --student CKPT (its weights) or --student-model PRESET (a fresh model), "
                          "exactly one")
    teacher = resolve_checkpoint(kd.teacher)
    if kd.student is None and cfg.data.tokenizer is None and (Path(teacher) / "tokenizer").is_dir():
        cfg.data.tokenizer = str(Path(teacher) / "tokenizer")  # a fresh student speaks the teacher's vocabulary
    cfg = posttrain_checkpoints(cfg, kd.student, "distill")
    launch_training(ctx, "posttrain distill", cfg, DistillRecipe(cfg.distill, quiet), nproc_per_node, nnodes,
                    node_rank, rdzv_endpoint, quiet)
