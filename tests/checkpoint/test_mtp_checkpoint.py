"""Multi-token prediction modules in the shared checkpoint: optional at load one way, refused the other way unless a
new pretraining run adds them (megapipe.checkpoint.dcp.mtp_rule)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from megapipe.checkpoint import load_checkpoint, save_checkpoint
from megapipe.config import ModelConfig
from megapipe.errors import CheckpointError
from megapipe.models import build_model

WITH = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, mtp_num_layers=2)
WITHOUT = dataclasses.replace(WITH, mtp_num_layers=None)


def saved(tmp_path, cfg, seed):
    model = build_model(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.zeros(1, 4, dtype=torch.long)
    if cfg.mtp_num_layers:  # every parameter gets optimizer state
        logits, mtp_logits = model(tokens, mtp=True)
        (logits.sum() + sum(x.sum() for x in mtp_logits)).backward()
    else:
        model(tokens).sum().backward()
    opt.step()
    return model, opt, save_checkpoint(tmp_path / "run", 1, model, opt, manifest={"stage": "pretrain"})


def test_a_checkpoint_with_mtp_loads_into_a_model_without(tmp_path, caplog):
    source, _, ckpt = saved(tmp_path, WITH, 0)
    model = build_model(WITHOUT, seed=1)
    opt = torch.optim.AdamW(model.parameters())
    with caplog.at_level(logging.INFO, logger="megapipe.checkpoint.dcp"):
        load_checkpoint(ckpt, model, opt)  # weights and optimizer state, its MTP part unread
    assert "multi-token prediction modules are not loaded" in caplog.text
    ours = model.state_dict()
    for k, v in source.state_dict().items():
        if not k.startswith("mtp."):
            assert torch.equal(ours[k], v), k


def test_a_model_with_mtp_refuses_a_checkpoint_without(tmp_path):
    source, _, ckpt = saved(tmp_path, WITHOUT, 0)
    model = build_model(WITH, seed=1)
    with pytest.raises(CheckpointError, match=r"holds no multi-token prediction modules .*\(--mtp-num-layers\)"):
        load_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(CheckpointError, match="--mtp-num-layers"):
        load_checkpoint(ckpt, model, load_optim=False, load_rng=False)  # weights only, but not a new pretraining
    fresh = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("mtp.")}
    load_checkpoint(ckpt, model, load_optim=False, load_rng=False, new_mtp=True)  # a new pretraining run
    ours = model.state_dict()
    for k, v in source.state_dict().items():
        assert torch.equal(ours[k], v), k
    for k, v in fresh.items():
        assert torch.equal(ours[k], v), k


def test_with_mtp_on_both_sides_every_tensor_comes_back(tmp_path):
    source, _, ckpt = saved(tmp_path, WITH, 0)
    model = build_model(WITH, seed=1)
    load_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters()))
    for k, v in source.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
