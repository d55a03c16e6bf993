"""Run resolution, in one place: which checkpoint a run resumes or descends from, its tokenizer, the model config it
builds (vocabulary from the tokenizer, padded) and its length. The stage's check before launch and the trainer
both call ``resolve_run``; the config given is never modified (the resolved model goes into a copy).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megapipe.checkpoint import find_latest, read_manifest, resolve_checkpoint
from megapipe.checkpoint.dcp import checkpoint_tokenizer, verify_checkpoint
from megapipe.config import CheckpointConfig, Config, ModelConfig, check_seq_length, from_dict
from megapipe.data.tokenizer import load_tokenizer
from megapipe.errors import ConfigError
from megapipe.posttrain.start import check_start


@dataclass
class Run:
    cfg: Config  # the config with the resolved model
    resume: Optional[Path]  # checkpoint whose full state is restored (None: a new run)
    parent: Optional[Path]  # checkpoint the run descends from (the resumed one, or the --finetune weights)
    tokenizer: Any  # megapipe.data.tokenizer.Tokenizer, or None when the model's vocab_size is given
    train_iters: int
    _tokenizer_copy: Any = None  # keeps a private copy of a checkpoint's tokenizer alive

    @property
    def model(self) -> ModelConfig:
        return self.cfg.model


def padded_vocab_size(vocab: int, multiple: int) -> int:
    multiple = max(1, multiple)
    return -(-vocab // multiple) * multiple


def resolve_vocab(model_cfg: ModelConfig, tokenizer) -> ModelConfig:
    """vocab_size None -> the tokenizer's, padded; a model vocab smaller than the tokenizer's is an error."""
    if tokenizer is None:
        if model_cfg.vocab_size is None:
            raise ConfigError("model.vocab_size is not set and no --tokenizer was given to take it from")
        return model_cfg
    tv = tokenizer.vocab_size
    if model_cfg.vocab_size is None:
        return dataclasses.replace(model_cfg, vocab_size=padded_vocab_size(tv, model_cfg.make_vocab_size_divisible_by))
    if model_cfg.vocab_size < tv:
        raise ConfigError(
            f"model.vocab_size = {model_cfg.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tv} tokens, {tokenizer.path}); raise model.vocab_size or leave it unset"
        )
    return model_cfg


def resolve_train_iters(cfg: Config) -> int:
    t = cfg.train
    if t.train_iters is not None:
        return t.train_iters
    if t.train_tokens is not None:
        return max(1, math.ceil(t.train_tokens / (t.global_batch_size * cfg.data.seq_length)))
    raise ConfigError("neither train.train_iters (--train-iters) nor train.train_tokens (--train-tokens) is set")


def find_checkpoint(c: CheckpointConfig) -> tuple[Optional[Path], Optional[Path]]:
    """(checkpoint to resume from, checkpoint the run descends from); --finetune resumes nothing."""
    if c.load is None:
        return None, None

    ckpt = find_latest(c.load) if Path(c.load).exists() else None
    if ckpt is None and c.save is not None and Path(c.load).absolute() == Path(c.save).absolute():
        return None, None  # --save X --load X on a fresh run dir: start, and resume on the next launch
    ckpt = resolve_checkpoint(c.load)  # raises a CheckpointError saying what is wrong
    manifest = read_manifest(ckpt)
    verify_checkpoint(ckpt, manifest, ["model/"])  # a damaged file is named before the run builds anything
    check_start(ckpt, manifest, resume=not c.finetune)
    return (None if c.finetune else ckpt), ckpt


def base_model_config(m: ModelConfig, parent: Optional[Path]) -> ModelConfig:
    """Loading a checkpoint with no model given (no preset, defaults untouched but ``num_labels``): take its model
    config, with ``num_labels`` when given (a reward model started from a language model)."""
    if parent is None or dataclasses.replace(m, num_labels=None) != ModelConfig():
        return m
    base = from_dict(ModelConfig, read_manifest(parent)["model"], "model.")
    return base if m.num_labels is None else dataclasses.replace(base, num_labels=m.num_labels)


def _tokenizer(cfg: Config, parent: Optional[Path], private_copy: bool):
    """--tokenizer, else the one inside the checkpoint the run descends from, else none."""
    path, keep = cfg.data.tokenizer, None
    if path is None and parent is not None:
        path = checkpoint_tokenizer(parent)  # None when it has none; a damaged file is named
    if path is not None and cfg.data.tokenizer is None:
        if private_copy:  # pruning old checkpoints (keep_last) may delete this one while the run copies from it
            keep = tempfile.TemporaryDirectory(prefix="megapipe-tokenizer-")
            path = shutil.copytree(path, Path(keep.name) / "tokenizer")
    return (load_tokenizer(path) if path is not None else None), keep


def resolve_run(cfg: Config, private_tokenizer: bool = False) -> Run:
    """Everything a run is made of that is not in the config as given; raises ConfigError / CheckpointError
    naming what is wrong. ``private_tokenizer``: copy a checkpoint's tokenizer (for the trainer)."""
    resume, parent = find_checkpoint(cfg.checkpoint)
    tokenizer, keep = _tokenizer(cfg, parent, private_tokenizer)
    model = resolve_vocab(base_model_config(cfg.model, parent), tokenizer)
    check_seq_length(model, cfg.data.seq_length)
    resolved = dataclasses.replace(cfg, model=model)
    return Run(resolved, resume, parent, tokenizer, resolve_train_iters(resolved), keep)
