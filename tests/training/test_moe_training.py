"""`megapipe pretrain` of an MoE model, the user's path: Megatron's MoE flags, MoE metrics in metrics.jsonl, the
aux-loss-free expert bias updated once per step and checkpointed (exact resume), and `--ep 2` on two processes
following the single-process run (losses and expert biases); impossible EP layouts refused before launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapipe.cli import main
from megapipe.errors import MegapipeError
from tests.helpers.torchrun import failure

MODEL = ["--model", "tiny-moe", "--set", "model.num_layers=2", "--set", "model.hidden_size=64", "--set",
         "model.intermediate_size=64", "--set", "model.num_heads=4", "--set", "model.num_kv_heads=2",
         "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
         "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff",
         "0.001", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.01",
         "--moe-layer-freq", "([0]*1+[1]*1)"]
TRAIN = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--split", "90,10,0",
         "--optimizer", "sgd", "--lr", "0.5", "--lr-warmup-iters", "0", "--eval-iters", "1", "--log-interval", "1",
         "--quiet"]
STEPS = 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def args(pretrain_data):
    prefix, tokenizer = pretrain_data
    return ["pretrain", "--data-path", str(prefix), "--tokenizer", str(tokenizer), *MODEL, *TRAIN]


def records(run: Path, kind: str = "train") -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == kind:
            out[r["step"]] = r
    return out


def bias(run: Path, step: int) -> torch.Tensor:
    from megapipe.checkpoint.load import load_model

    model = load_model(run / f"step_{step:08d}").model
    assert type(model.layers["0"]).__name__ == "TransformerBlock"  # the layer pattern
    return model.layers["1"].moe.expert_bias.clone()


@pytest.fixture(scope="module")
def reference(args, tmp_path_factory):
    run = tmp_path_factory.mktemp("moe_ref")
    assert main([*args, "--train-iters", str(STEPS), "--save-interval", "2", "--save", str(run)]) == 0
    return run


def test_moe_run_logs_its_metrics_and_resumes_exactly(args, reference, tmp_path):
    recs = records(reference)
    assert sorted(recs) == list(range(1, STEPS + 1))
    first = recs[1]
    assert first["moe/aux_loss"] > 0 and first["moe/z_loss"] > 0 and first["moe/dropped_fraction"] == 0.0
    assert first["moe/load_max_over_mean"] >= 1.0 and "moe/L1/load_max_over_mean" in first
    assert recs[STEPS]["loss"] < recs[1]["loss"]
    b2, b4 = bias(reference, 2), bias(reference, STEPS)
    assert b2.abs().max() > 0 and not torch.equal(b2, b4)
    steps = b2 / 0.01  # two updates of +-0.01 (or 0 where an expert had exactly the mean load)
    assert (steps - steps.round()).abs().max() < 1e-4 and steps.abs().max() <= 2 + 1e-4

    resumed = tmp_path / "resumed"
    import shutil

    shutil.copytree(reference / "step_00000002", resumed / "step_00000002")
    assert main([*args, "--train-iters", str(STEPS), "--save", str(resumed), "--load", str(resumed)]) == 0
    again = records(resumed)
    for step in (3, 4):
        assert again[step]["loss"] == recs[step]["loss"] and again[step]["moe/aux_loss"] == recs[step]["moe/aux_loss"]
    assert torch.equal(bias(resumed, STEPS), b4)


@pytest.mark.dist
def test_expert_parallel_run_follows_the_single_process_run(args, reference, tmp_path):
    run = tmp_path / "ep2"
    exe = Path(sys.executable).with_name("megapipe")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "megapipe.cli"]
    proc = subprocess.run([*cmd, *args, "--train-iters", str(STEPS), "--save", str(run), "--nproc-per-node", "2",
                           "--ep", "2"], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, failure(proc)
    got, want = records(run), records(reference)
    assert json.loads((run / f"step_{STEPS:08d}" / "megapipe.json").read_text())["layout"]["parallel"] == "dp_shard2,ep2"
    for step in range(1, STEPS + 1):
        for key in ("loss", "moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (step, key)
    assert torch.equal(bias(run, STEPS), bias(reference, STEPS))


@pytest.mark.parametrize("extra, message", [
    (["--nproc-per-node", "2", "--ep", "4"], "parallel.ep = 4 must divide parallel.dp_shard = 2"),
    (["--nproc-per-node", "2", "--ep", "2", "--dp-mode", "ddp"], "parallel.ep = 2 needs parallel.dp_mode = 'fsdp'"),
    (["--nproc-per-node", "2", "--ep", "2", "--num-experts", "3", "--moe-router-topk", "1"],
     "model.num_experts = 3 is not divisible by parallel.ep = 2"),
    (["--nproc-per-node", "2", "--ep", "2", "--num-experts", "0"], "parallel.ep = 2 needs an MoE model"),
    (["--nproc-per-node", "2", "--ep", "2", "--compile"], "train.compile = true is not supported with parallel.ep"),
])
def test_impossible_expert_parallel_layouts_are_refused_before_launch(args, tmp_path, capsys, extra, message):
    code = main([*args, "--train-iters", "1", "--save", str(tmp_path / "run"), *extra])
    assert code == MegapipeError.exit_code
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "run").exists()
