"""`megapipe posttrain rl --nproc-per-node 2` (FSDP, dp2: each rank samples its two prompts' groups with its own
engine) against the same run in one process: the same rollouts (every reward, length and dropped-group figure
equal) and the same training curve.

Bounds: fp32, AdamW, 4 steps with a KL penalty and two updates per rollout batch. The layouts differ in the order
of fp32 sums (gradient reduce-scatter, the engines' batch composition), which AdamW amplifies a little: 1e-5
relative on each step's loss and KL, 1e-4 on the gradient norm; the sampled tokens are equal. Then the dp2 run's
checkpoints resumed in one process (the format reshards; an unfinished rollout batch does not)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megapipe.cli import main
from tests.helpers.rl import records
from tests.helpers.torchrun import failure

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[3]
ROLLOUT = ("reward", "reward_std", "reward/has_e", "accuracy", "completion_len", "completion_len_max", "truncated",
           "groups_dropped", "rollout_tokens")


def test_dp2_fsdp_equals_one_process_on_the_same_rollouts(rl_base, tmp_path, capsys):
    args = ["posttrain", "rl", "--load", str(rl_base), "--task", "arithmetic", "--reward", "tests.helpers.rl:has_e",
            "--prompts-per-step", "4", "--group-size", "4", "--max-completion-tokens", "8", "--max-prompt-tokens",
            "48", "--micro-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--log-interval", "1",
            "--precision", "fp32", "--kl-coef", "0.1", "--updates-per-batch", "2", "--dynamic-sampling", "--quiet"]
    assert main([*args, "--save", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # --save-interval 1: steps 1 and 3 end inside a rollout batch, so both ranks' unfinished rows are gathered
    proc = subprocess.run([sys.executable, "-m", "megapipe.cli", *args, "--save", str(tmp_path / "two"),
                           "--nproc-per-node", "2", "--save-interval", "1"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, failure(proc)

    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two, strict=True):
        for k in ROLLOUT:
            assert a.get(k) == b.get(k), (a["step"], k, a.get(k), b.get(k))
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), a["step"]
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-5, abs=1e-9), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
        if "mismatch_max" in a:
            assert a["mismatch_max"] < 1e-5 and b["mismatch_max"] < 1e-5
    assert any(r["reward_std"] > 0 for r in one if "reward_std" in r)  # a batch with something to learn
    m = json.loads((tmp_path / "two" / "step_00000004" / "megapipe.json").read_text())
    assert m["layout"] == {"world_size": 2, "parallel": "dp_shard2"} and m["stage"] == "rl"

    # the dp2 run's checkpoints in one process: at a rollout-batch boundary (step 2) it resumes and continues the
    # single-process curve; inside a batch (step 3, whose rows each rank holds) it is refused, naming the reason
    def resumed_from(step: int, save: Path) -> int:
        save.mkdir()
        shutil.copytree(tmp_path / "two" / f"step_{step:08d}", save / f"step_{step:08d}")
        (save / "latest").write_text(f"step_{step:08d}\n")
        return main([*args, "--save", str(save)])

    assert resumed_from(2, tmp_path / "from2") == 0
    three = records(tmp_path / "from2")
    assert [r["step"] for r in three] == [3, 4]
    for a, b in zip(one[2:], three, strict=True):
        assert b.get("reward") == a.get("reward") and b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    assert resumed_from(3, tmp_path / "from3") != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "was saved by 2 data-parallel rank(s) in the middle of a rollout batch (--updates-per-batch 2)" in err
    assert "resume it with 2 rank(s), not 1" in err


def test_dp2_ddp_on_policy_equals_one_process(rl_base, tmp_path):
    """--dp-mode ddp with one update per batch (the training forward gives the old log-probs, and the mismatch is
    reduced over both ranks before the update): the same rollouts and curve as one process."""
    args = ["posttrain", "rl", "--load", str(rl_base), "--task", "arithmetic", "--reward", "tests.helpers.rl:has_e",
            "--prompts-per-step", "4", "--group-size", "4", "--max-completion-tokens", "8", "--max-prompt-tokens",
            "48", "--micro-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--log-interval", "1",
            "--precision", "fp32", "--temperature", "0.8", "--quiet"]
    assert main([*args, "--save", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "megapipe.cli", *args, "--save", str(tmp_path / "two"),
                           "--nproc-per-node", "2", "--dp-mode", "ddp"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, failure(proc)
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        for k in ROLLOUT:
            assert a.get(k) == b.get(k), (a["step"], k, a.get(k), b.get(k))
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
        assert a["mismatch_max"] < 1e-5 and b["mismatch_max"] < 1e-5 and b["mismatch_mean"] < 1e-6
    m = json.loads((tmp_path / "two" / "step_00000003" / "megapipe.json").read_text())
    assert m["layout"]["world_size"] == 2 and m["stage"] == "rl"
