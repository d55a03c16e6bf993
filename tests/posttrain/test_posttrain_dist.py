"""Each post-training command in a parallel layout through torchrun (``--nproc-per-node 2``, one launch each),
against the same run in one process: SFT with LoRA and packing under FSDP (dp2), distillation with an FSDP-sharded
teacher (dp2), pruning with the calibration split over two processes.

Bounds: fp32, AdamW, 3 steps; the layouts differ only in the order of fp32 sums (and the one-process run takes the
fused output + loss path, the sharded one the logits path), which AdamW amplifies a little: 1e-5 relative on each
step's loss (observed <= 1e-6). Pruning sums the same statistics in another order: same kept units, losses 1e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megapipe.cli import main
from tests.helpers.torchrun import failure

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
REL = 1e-5


def megapipe(args: list[str]) -> str:
    """``megapipe ARGS`` in a new process (the console script), as a user runs it."""
    exe = Path(sys.executable).with_name("megapipe")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "megapipe.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, failure(proc)
    return proc.stdout


def train_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"}


def same_curve(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for s in a:
        assert a[s] == pytest.approx(b[s], rel=REL), (s, a, b)


TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "5e-3",
         "--split", "90,10,0", "--eval-iters", "0", "--log-interval", "1", "--quiet"]


def test_sft_with_lora_and_packing_under_fsdp(base_ckpt, chat_data, tmp_path):
    args = ["posttrain", "sft", "--load", str(base_ckpt), "--data", str(chat_data), "--chat-template", "chatml",
            "--packing", "--seq-length", "96", "--lora-rank", "4", *TRAIN]
    main([*args, "--save", str(tmp_path / "one")])
    megapipe([*args, "--save", str(tmp_path / "two"), "--nproc-per-node", "2"])
    same_curve(train_losses(tmp_path / "two"), train_losses(tmp_path / "one"))
    m = json.loads((tmp_path / "two" / "step_00000003" / "megapipe.json").read_text())
    assert m["layout"]["world_size"] == 2 and m["lora"]["rank"] == 4


def test_distill_with_an_fsdp_sharded_teacher(base_ckpt, chat_tokenizer, chat_data, tmp_path):
    from tests.posttrain.conftest import write_model

    student = write_model(tmp_path / "student", chat_tokenizer, seed=5, hidden_size=32, intermediate_size=64,
                          num_heads=2, num_kv_heads=1)
    args = ["posttrain", "distill", "--teacher", str(base_ckpt), "--student", str(student), "--data",
            str(chat_data), "--chat-template", "chatml", "--seq-length", "64", "--kd-alpha", "0.5", *TRAIN]
    main([*args, "--save", str(tmp_path / "one")])
    megapipe([*args, "--save", str(tmp_path / "two"), "--nproc-per-node", "2", "--teacher-parallel", "fsdp"])
    same_curve(train_losses(tmp_path / "two"), train_losses(tmp_path / "one"))


def test_prune_with_the_calibration_split_over_two_processes(base_ckpt, chat_data, tmp_path, capsys):
    args = ["posttrain", "prune", str(base_ckpt), "--calib-data", str(chat_data), "--chat-template", "chatml",
            "--calib-samples", "16", "--valid-samples", "8", "--seq-length", "96", "--split", "90,10,0",
            "--hidden", "48", "--ffn", "96", "--heads", "2", "--kv-heads", "1", "--json"]
    assert main([*args, "--output", str(tmp_path / "one")]) == 0
    one = json.loads(capsys.readouterr().out)
    two = json.loads(megapipe([*args, "--output", str(tmp_path / "two"), "--nproc-per-node", "2"]).splitlines()[-1])
    assert two["layers_kept"] == one["layers_kept"] and two["parameters_after"] == one["parameters_after"]
    for key in ("valid_loss_before", "valid_loss_after"):
        assert two[key] == pytest.approx(one[key], rel=1e-6)

    import torch

    from megapipe.checkpoint.load import load_model

    a = load_model(tmp_path / "one").model
    b = load_model(tmp_path / "two").model
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name  # the same units kept: the same weights
