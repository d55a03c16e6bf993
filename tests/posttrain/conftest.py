"""Fixtures of the post-training tests: a chat tokenizer, the chat set, and small base checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.sft import CHAT_SET, train_chat_tokenizer

SMALL = dict(arch="llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             vocab_size=384, max_position_embeddings=256, tie_embeddings=True)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run fastest on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory) -> Path:
    return train_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> Path:
    """The bundled chat set, copied so the SFT index cache lands in a temporary directory."""
    out = tmp_path_factory.mktemp("chat_data") / CHAT_SET.name
    shutil.copy(CHAT_SET, out)
    return out


def write_model(path: Path, tokenizer: Path, seed: int = 0, **fields) -> Path:
    """A randomly initialised model saved as a checkpoint (stage ``init``) with ``tokenizer``."""
    from megapipe.checkpoint import write_checkpoint
    from megapipe.config import ModelConfig
    from megapipe.models import build_model

    cfg = ModelConfig(**{**SMALL, **fields})
    model = build_model(cfg, seed=seed)
    return write_checkpoint(path, model, step=0, manifest={"model": cfg, "stage": "init"}, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def base_ckpt(tmp_path_factory, chat_tokenizer) -> Path:
    return write_model(tmp_path_factory.mktemp("base") / "ckpt", chat_tokenizer)


@pytest.fixture(scope="session")
def sft_model(base_ckpt, chat_data, tmp_path_factory) -> Path:
    """``base_ckpt`` fine-tuned on the chat set until it answers in its format (60 steps, packed)."""
    from megapipe.cli import main

    run = tmp_path_factory.mktemp("sft_model") / "run"
    assert main(["posttrain", "sft", "--load", str(base_ckpt), "--data", str(chat_data), "--chat-template", "chatml",
                 "--packing", "--seq-length", "128", "--micro-batch-size", "8", "--global-batch-size", "8",
                 "--train-iters", "60", "--lr", "1e-2", "--lr-warmup-iters", "5", "--split", "90,10,0",
                 "--eval-iters", "1", "--log-interval", "20", "--save", str(run), "--quiet"]) == 0
    return run / "step_00000060"
