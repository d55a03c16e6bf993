"""Logit distillation: a frozen teacher's next-token distributions train the student (megapipe.posttrain.
distill_losses: forward KL at temperature T, reverse KL, generalized JSD, top-k, mixed with the LM loss by alpha).

The data is either pretraining data (--data-path, every token counts) or SFT records (--data, the trained tokens of
megapipe.data.sft). The teacher is loaded from its checkpoint in eval mode with gradients off (fp32 or bf16), on
every rank or FSDP-sharded over the data-parallel ranks, and run on each micro-batch inside the loss; the student
trains in any layout the loop offers except context parallelism (the teacher needs whole sequences). Teacher and
student must share the vocabulary: same size and same tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megapipe.checkpoint import read_manifest, resolve_checkpoint
from megapipe.checkpoint.load import load_model
from megapipe.data.tokenizer import tokenizer_files
from megapipe.errors import ConfigError
from megapipe.models.objective import IGNORE_INDEX, LossResult, ModelOutput, loss_targets
from megapipe.models.objective import Loss as LossBase
from megapipe.parallel.step import model_kwargs
from megapipe.posttrain.distill_losses import KDSpec, distill_fused, distill_logits
from megapipe.posttrain.start import START_KEY, start_of
from megapipe.training.recipes.base import Recipe, RunContext
from megapipe.training.recipes.pretrain import PretrainRecipe
from megapipe.training.recipes.sft import SFTRecipe


class DistillLoss(LossBase):
    """alpha * T^2 * divergence(teacher, student) + (1 - alpha) * cross-entropy, summed over the trained tokens.
    ``teacher`` is set by the recipe once the model is built (DistillRecipe.prepare_model)."""

    fusable = True

    def __init__(self, spec):
        self.spec = spec
        self.teacher = None

    def units(self, batch: dict) -> torch.Tensor:
        return (loss_targets(batch) != IGNORE_INDEX).sum()

    @torch.no_grad()
    def teacher_states(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's final hidden states [tokens, H_t] and its output weight [V, H_t] (gathered when sharded)."""
        kwargs = model_kwargs(batch)
        tokens = batch["tokens"]
        dev = tokens.device.type
        with torch.autocast(dev, enabled=False):
            hidden = self.teacher(tokens, return_hidden=True, **kwargs)
        weight = self.teacher.output_weight()
        if hasattr(weight, "full_tensor"):
            weight = weight.full_tensor()
        if hasattr(hidden, "full_tensor"):
            hidden = hidden.full_tensor()
        return hidden.flatten(0, 1), weight

    def __call__(self, out: ModelOutput, batch: dict) -> LossResult:
        targets = loss_targets(batch).flatten()
        weights = (targets != IGNORE_INDEX).float()
        labels = torch.where(targets == IGNORE_INDEX, 0, targets)
        t_hidden, t_weight = self.teacher_states(batch)
        if out.hidden is not None:
            total, kd, ce = distill_fused(out.hidden.flatten(0, 1), out.output_weight(), t_hidden, t_weight, labels,
                                          weights, self.spec)
        else:
            logits = out.logits
            if hasattr(logits, "full_tensor"):  # vocabulary-sharded (TP): the divergence needs whole rows
                logits = logits.full_tensor()
            total, kd, ce = distill_logits(logits.flatten(0, 1), t_hidden, t_weight, labels, weights, self.spec)
        metrics = {"kd_loss": kd.detach()}
        if self.spec.alpha < 1:
            metrics["lm_loss"] = ce.detach()
        return LossResult(total=total, metrics=metrics)


def _vocab(path) -> dict:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_files(path)[0])).get_vocab(with_added_tokens=True)


def check_same_vocabulary(teacher_ckpt: Path, student_vocab_size: int, student_tokenizer) -> None:
    """A teacher with another vocabulary size or tokenizer than the student's is refused, naming both."""
    model = read_manifest(teacher_ckpt).get("model") or {}
    tv = model.get("vocab_size")
    if tv != student_vocab_size:
        raise ConfigError(
            f"teacher {teacher_ckpt} has vocab_size {tv} but the student has {student_vocab_size}: distillation "
            "compares distributions over one vocabulary (same tokenizer, same padded size)"
        )
    teacher_tok = teacher_ckpt / "tokenizer"
    if student_tokenizer is None or not teacher_tok.is_dir():
        return
    a, b = _vocab(teacher_tok), _vocab(student_tokenizer.path)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:1]
        what = f" (e.g. token {diff[0][0]!r} = id {diff[0][1]} in only one)" if diff else ""
        raise ConfigError(
            f"teacher {teacher_ckpt} and the student use different tokenizers ({teacher_tok} vs "
            f"{student_tokenizer.path}){what}: distill from a teacher with the student's tokenizer"
        )


def frozen_model(ckpt: Path, ctx: RunContext, precision: str, parallel: str):
    """A checkpoint's model in eval mode with gradients off (``precision`` fp32 or bf16), on every rank
    (``parallel`` replicate) or FSDP-sharded over the data-parallel ranks (fsdp): a teacher, a reference."""
    dtype = torch.bfloat16 if precision == "bf16" else None
    model = load_model(ckpt, device=ctx.device, dtype=dtype).model
    model.requires_grad_(False)
    dims = ctx.dims
    if parallel == "fsdp" and dims.dp_shard * dims.cp > 1:
        from torch.distributed.fsdp import fully_shard

        mesh = dims.mesh("dp_shard_cp")
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


class DistillRecipe(Recipe):
    """``DistillRecipe(cfg.distill)``: the distillation settings fix the loss before the run is resolved."""

    stage = "distill"

    def __init__(self, distill_cfg, quiet: bool = False):
        self.quiet = quiet
        self._data: Optional[Recipe] = None
        self._loss = DistillLoss(KDSpec.from_config(distill_cfg))

    def data_recipe(self, cfg) -> Recipe:
        if self._data is None:
            if cfg.data.data_path and cfg.sft.data:
                raise ConfigError("give --data-path (pretraining data) or --data (SFT records), not both")
            self._data = SFTRecipe(self.quiet) if cfg.sft.data else PretrainRecipe()
        return self._data

    def packed_sequences(self, cfg) -> bool:
        return self.data_recipe(cfg).packed_sequences(cfg)

    def check(self, run) -> None:
        cfg = run.cfg
        kd = cfg.distill
        if kd.teacher is None:
            raise ConfigError("distill.teacher (--teacher) is not set: give the teacher checkpoint")
        if cfg.parallel.cp > 1:
            raise ConfigError(f"posttrain distill with context parallelism (--context-parallel-size {cfg.parallel.cp})"
                              " is not supported: the teacher needs whole sequences; use tp / dp / pp")
        if cfg.lora.rank:
            raise ConfigError("posttrain distill trains the whole student: --lora-rank is not supported here")
        if not cfg.data.data_path and not cfg.sft.data:
            raise ConfigError("posttrain distill needs data: --data-path PREFIX (pretraining) or --data FILE (SFT)")
        teacher = resolve_checkpoint(kd.teacher)
        check_same_vocabulary(teacher, run.model.vocab_size, run.tokenizer)
        if kd.top_k > run.model.vocab_size:
            raise ConfigError(f"distill.top_k (--kd-top-k) = {kd.top_k} is more than the vocabulary "
                              f"({run.model.vocab_size} tokens): give at most that, or 0 for the whole vocabulary")
        if run.resume is not None:
            before = (read_manifest(run.resume).get("distill") or {}).get("teacher")
            if before is not None and before != str(teacher.absolute()):
                raise ConfigError(f"{run.resume} was distilled from teacher {before}, not {teacher}: resume with that "
                                  "teacher, or pick another --save directory")
        self.data_recipe(cfg).check(run)

    def loss(self) -> DistillLoss:
        return self._loss

    def prepare_model(self, ctx: RunContext, model):
        """The student as it is; the teacher is loaded here (it needs the device and the mesh)."""
        self._loss.teacher = self.build_teacher(ctx)
        return self.data_recipe(ctx.cfg).prepare_model(ctx, model)

    def build_teacher(self, ctx: RunContext):
        kd = ctx.cfg.distill
        return frozen_model(resolve_checkpoint(kd.teacher), ctx, kd.teacher_precision, kd.teacher_parallel)

    def train_data(self, ctx: RunContext, model, state: dict):
        return self.data_recipe(ctx.cfg).train_data(ctx, model, state)

    def eval_data(self, ctx: RunContext, split: str):
        return self.data_recipe(ctx.cfg).eval_data(ctx, split)

    def manifest(self, ctx: RunContext) -> dict:
        kd = ctx.cfg.distill
        data = self.data_recipe(ctx.cfg).manifest(ctx)
        return {**data, START_KEY: start_of(ctx.resume, ctx.parent), "distill": {
            "teacher": str(resolve_checkpoint(kd.teacher).absolute()), "loss": kd.loss, "temperature": kd.temperature,
            "alpha": kd.alpha, "jsd_beta": kd.jsd_beta, "top_k": kd.top_k,
        }}

    def summary(self, ctx: RunContext) -> dict:
        return self.data_recipe(ctx.cfg).summary(ctx)

    def tokenizer_files(self, ctx: RunContext):
        return self.data_recipe(ctx.cfg).tokenizer_files(ctx)
