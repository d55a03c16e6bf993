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
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from megapipe.models.objective import Loss, TokenCrossEntropy


class Recipe:
    stage: str = "train"
    # a global batch with no loss unit is a normal event (RL: every group dropped), skipped without an update;
    # elsewhere it is a non-finite loss (train.max_nan_skips)
    empty_batches: bool = False

    def loss(self) -> Loss:
        return TokenCrossEntropy()

    def check(self, run) -> None:
        """Refuse a run this recipe cannot do (``run``: megapipe.training.run.Run), before launch."""

    def packed_sequences(self, cfg) -> bool:
        return False

    def prepare_model(self, trainer, model):
        return model

    def load_weights(self, trainer, ckpt) -> None:
        """A new run from ``ckpt`` (--finetune): its weights into ``trainer.model``, no optimizer or RNG state."""
        from megapipe.checkpoint import load_checkpoint

        load_checkpoint(ckpt, trainer.model, optimizer=None, load_optim=False, load_rng=False)

    def train_data(self, trainer, state: dict) -> Iterator[dict]:
        raise NotImplementedError

    def eval_data(self, trainer, split: str) -> Optional[Iterator[dict]]:
        return None

    def manifest(self, trainer) -> dict[str, Any]:
        return {}

    def metrics(self, trainer) -> dict[str, float]:
        """Extra values for the step's log record (called at each log interval)."""
        return {}

    def before_update(self, trainer) -> None:
        """After the step's backward, before its update (every rank)."""

    def tokenizer_files(self, trainer):
        """The tokenizer (directory or file) written into every checkpoint: the run's own by default."""
        return trainer.tokenizer.path if trainer.tokenizer else None

    def summary(self, trainer) -> dict[str, Any]:
        """Extra entries of the end-of-run summary."""
        return {}
