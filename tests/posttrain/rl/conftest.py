"""RL fixtures: a tiny base checkpoint (random init, the tiny tokenizer, no chat template) and run configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.rl import TINY


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run fastest on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="session")
def rl_base(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """A checkpoint of a tiny random model with the tiny tokenizer, as `megapipe import hf` / pretrain leave one."""
    from megapipe.checkpoint import write_checkpoint
    from megapipe.config import ModelConfig, to_dict
    from megapipe.models import build_model

    cfg = ModelConfig(**TINY)
    path = tmp_path_factory.mktemp("rl_base") / "base"
    write_checkpoint(path, build_model(cfg, seed=0), manifest={"stage": "pretrain", "model": to_dict(cfg)},
                     tokenizer=tiny_tokenizer_dir)
    return path
