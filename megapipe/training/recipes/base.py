"""The recipe interface. The loop (megapipe.training.trainer) owns the optimizer, accumulation, precision,
clipping, evaluation, logging, checkpoints and signals; a recipe owns what differs between stages:

- ``stage``: the name written into every checkpoint's manifest (lineage: stage + parent checkpoint);
- ``train_data`` / ``eval_data``: iterators of micro-batch dicts (CPU tensors, first dimension = rows) for this
  data-parallel rank; the train iterator's ``state_dict()`` goes into the checkpoint and comes back to
  ``train_data`` on resume (exact resume);
- ``loss()``: a megapipe.models.objective.Loss (sum over loss units; the loop normalises globally);
- ``prepare_model``: changes to the plain model before parallelism is applied (LoRA adapters, frozen parts);
  ``load_weights``: how a new run (--finetune) takes its parent's weights into that model;
- ``check``: recipe-specific refusals before any process starts; ``packed_sequences``: whether batches carry
  document ids / position ids (layouts that cannot attend within documents yet refuse it before launch);
- ``manifest`` / ``metrics``: extra manifest fields, extra per-step metrics;
- ``before_update``: called on every rank after a step's backward and before its optimizer update (a recipe may
  stop the run there, e.g. on a figure the forward measured);
- ``tokenizer_files``: the tokenizer copied into each checkpoint (e.g. with the chat template SFT rendered with);
  ``summary``: extra rows of the end-of-run summary.

The hooks the trainer calls once the layout is set (``prepare_model`` to ``summary``) get the run's ``RunContext``:
what a recipe may read of the run, never the trainer; those that work on the model get it as an argument of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from megapipe.checkpoint import load_checkpoint
from megapipe.config import Config
from megapipe.models.objective import Loss, TokenCrossEntropy
from megapipe.parallel.dims import ParallelDims


@dataclass(frozen=True)
class RunContext:
    """What the recipe hooks read of a run, built by the trainer once the layout is set."""

    cfg: Config  # the resolved config (the model's vocabulary taken from the tokenizer)
    dims: ParallelDims  # the layout: this rank's place in the mesh, its process groups
    tokenizer: Any  # megapipe.data.tokenizer.Tokenizer, or None when the model's vocab_size is given
    device: torch.device
    autocast: Callable[[], ContextManager]  # a new context for a forward pass at the run's precision
    resume: Optional[Path]  # checkpoint whose full state the run restores (None: a new run)
    parent: Optional[Path]  # checkpoint the run descends from (the resumed one, or the --finetune weights)
    is_main: bool  # global rank 0
    train_iters: int
    num_microbatches: int  # micro-batches per step on this rank


class Recipe:
    stage: str = "train"
    # a global batch with no loss unit is a normal event (RL: every group dropped), skipped without an update;
    # elsewhere it is a non-finite loss (train.max_nan_skips)
    empty_batches: bool = False
    # a new run (--finetune) may add multi-token prediction modules its parent lacks (they start fresh)
    new_mtp: bool = False

    def loss(self) -> Loss:
        return TokenCrossEntropy()

    def check(self, run) -> None:
        """Refuse a run this recipe cannot do (``run``: megapipe.training.run.Run), before launch."""

    def packed_sequences(self, cfg) -> bool:
        return False

    def prepare_model(self, ctx: RunContext, model):
        return model

    def load_weights(self, ctx: RunContext, model, ckpt) -> None:
        """A new run from ``ckpt`` (--finetune): its weights into ``model``, no optimizer or RNG state."""
        load_checkpoint(ckpt, model, optimizer=None, load_optim=False, load_rng=False, new_mtp=self.new_mtp)

    def train_data(self, ctx: RunContext, model, state: dict) -> Iterator[dict]:
        """``model``: the model being trained, as parallelised (RL samples from it)."""
        raise NotImplementedError

    def eval_data(self, ctx: RunContext, split: str) -> Optional[Iterator[dict]]:
        return None

    def manifest(self, ctx: RunContext) -> dict[str, Any]:
        return {}

    def metrics(self, ctx: RunContext) -> dict[str, float]:
        """Extra values for the step's log record (called at each log interval)."""
        return {}

    def before_update(self, ctx: RunContext) -> None:
        """After the step's backward, before its update (every rank)."""

    def tokenizer_files(self, ctx: RunContext):
        """The tokenizer (directory or file) written into every checkpoint: the run's own by default."""
        return ctx.tokenizer.path if ctx.tokenizer else None

    def summary(self, ctx: RunContext) -> dict[str, Any]:
        """Extra entries of the end-of-run summary."""
        return {}
