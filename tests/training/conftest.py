"""Trainer tests: small deterministic runs on the Shakespeare excerpt (fixtures in tests/conftest.py)."""

from __future__ import annotations

import pytest

TINY_MODEL = [
    "model.preset=tiny", "model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
    "model.num_heads=4", "model.num_kv_heads=2",
]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every trainer test runs on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_overrides():
    return _tiny_overrides


def _tiny_overrides(prefix, tokenizer, extra: dict | None = None) -> dict:
    """Dotted overrides for a small, fast, deterministic run on the fixture data."""
    from megapipe.config import parse_override

    o = dict(parse_override(x) for x in TINY_MODEL)
    o.update({
        "data.data_path": [str(prefix)], "data.tokenizer": str(tokenizer), "data.seq_length": 32,
        "data.split": "90,10,0", "train.micro_batch_size": 2, "train.global_batch_size": 4, "train.lr": 1e-2,
        "train.lr_warmup_iters": 2, "train.log_interval": 1, "train.eval_iters": 2,
    })
    o.update(extra or {})
    return o
