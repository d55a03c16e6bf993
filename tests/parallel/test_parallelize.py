"""Single-process parallelize_model (activation recompute, torch.compile) and the torchrun re-launcher."""

from __future__ import annotations

import sys

import pytest
import torch

from megapipe.config import Config, ModelConfig
from megapipe.errors import ConfigError
from megapipe.models import build_model
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.launch import maybe_launch_torchrun, strip_launch_flags, torchrun_command
from megapipe.parallel.parallelize import parallelize_model
from megapipe.parallel.step import clip_grad_norm_, train_step

MODEL = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64)


def run(recompute: str = "none", compile: bool = False):
    cfg = Config(model=ModelConfig(**MODEL))
    cfg.train.recompute, cfg.train.compile = recompute, compile
    model = parallelize_model(build_model(cfg.model, seed=3), ParallelDims(), cfg)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (4, 17), generator=g)
    mbs = [{"tokens": d[:, :-1], "labels": d[:, 1:]} for d in data.split(2)]
    loss = train_step(model, mbs, ParallelDims())
    norm = clip_grad_norm_(model, 0.0, ParallelDims())
    return model, loss, norm


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_gradients_and_keeps_names(recompute):
    ref, ref_loss, ref_norm = run()
    model, loss, norm = run(recompute)
    assert list(model.state_dict()) == list(ref.state_dict())  # checkpoints stay layout-free
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6) and norm.item() == pytest.approx(ref_norm.item())
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.slow
def test_compile_per_block_matches_eager():
    ref, ref_loss, _ = run()
    model, loss, _ = run("selective", compile=True)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_launcher_flags_and_command():
    argv = ["pretrain", "--nproc-per-node", "4", "--tp=2", "--nnodes=1", "--config", "x.yaml"]
    assert strip_launch_flags(argv) == ["pretrain", "--tp=2", "--config", "x.yaml"]
    cmd = torchrun_command(argv, 4)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--standalone" in cmd
    assert cmd[-6:] == ["-m", "megapipe.cli", "pretrain", "--tp=2", "--config", "x.yaml"]
    multi = torchrun_command(argv, 8, nnodes=2, node_rank=1, rdzv_endpoint="head:29500")
    assert ["--rdzv-endpoint", "head:29500"] == multi[multi.index("--rdzv-endpoint"):][:2]
    with pytest.raises(ConfigError, match="--nnodes = 2 needs --rdzv-endpoint"):
        torchrun_command(argv, 8, nnodes=2)
    with pytest.raises(ConfigError, match="--node-rank = 2"):
        torchrun_command(argv, 8, nnodes=2, node_rank=2, rdzv_endpoint="h:1")


@pytest.mark.parametrize("command", [["pretrain", "--model", "tiny", "--data-path", "d", "--save", "run"],
                                     ["posttrain", "prune", "ckpt", "--calib-data", "d", "--output", "run"]])
@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nnodes"])
def test_no_process_count_below_one(tmp_path, monkeypatch, capsys, command, flag):
    from megapipe.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([*command, flag, "0"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {flag} = 0 must be >= 1 (processes per node and nodes)"
    assert list(tmp_path.iterdir()) == []


def test_no_relaunch_for_one_process_or_inside_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert maybe_launch_torchrun(["pretrain"], 1) is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert maybe_launch_torchrun(["pretrain"], 2) is None  # already a torchrun worker: join, do not nest
