"""Where a post-training run starts: the same command resumes its own run, or starts from the parent's weights.

``megapipe posttrain sft --load BASE --save RUN`` (and ``distill --student BASE``) is a new run from BASE's weights
(Megatron's ``--finetune``: step 0, a fresh optimizer) the first time, and the exact resume of RUN's newest
checkpoint every time after, so a killed job is restarted with the command that started it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from megapipe.config import Config


def posttrain_checkpoints(cfg: Config, parent: Optional[str]) -> Config:
    """``cfg`` with checkpoint.load / finetune set: resume ``--save`` when it holds a complete checkpoint, else load
    ``parent``'s weights only (None: a model initialised from scratch)."""
    from megapipe.checkpoint import find_latest

    c = cfg.checkpoint
    if c.save is not None and Path(c.save).is_dir() and find_latest(c.save) is not None:
        load, finetune = c.save, False
    else:
        load, finetune = parent, parent is not None
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, load=load, finetune=finetune))
