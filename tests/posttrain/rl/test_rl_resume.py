"""`megapipe posttrain rl` killed with kill -9 and relaunched: the resumed run reproduces the uninterrupted run bit
for bit (fp32, CPU): every loss, gradient norm, reward, KL, mismatch figure and sampled length, so the completions
sampled after the resume are the ones the uninterrupted run sampled (sampling seeds derive from the prompt stream's
position in the checkpoint). The kill lands while the rollout of step 5 is being scored, and the newest checkpoint
(step 3) is in the middle of a rollout batch (--updates-per-batch 2), so its unfinished batch is restored too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.rl import TIMING, records

ROOT = Path(__file__).resolve().parents[3]
ITERS = 8


def command(base: Path, run: Path) -> list[str]:
    return [sys.executable, "-m", "megapipe.cli", "posttrain", "rl", "--load", str(base), "--save", str(run),
            "--task", "arithmetic", "--reward", "tests.helpers.rl:has_e", "--prompts-per-step", "4",
            "--group-size", "4", "--max-completion-tokens", "8", "--max-prompt-tokens", "48", "--micro-batch-size",
            "4", "--train-iters", str(ITERS), "--lr", "1e-3", "--log-interval", "1", "--precision", "fp32",
            "--kl-coef", "0.05", "--updates-per-batch", "2", "--dynamic-sampling", "--save-interval", "3",
            "--quiet"]


def start(cmd, **env) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    return proc.communicate(timeout=600)[0]


def curve(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records(run)]


def test_kill9_then_resume_reproduces_the_uninterrupted_run(rl_base, tmp_path):
    ref_dir, run_dir, marker = tmp_path / "reference", tmp_path / "run", tmp_path / "hanging"
    ref = start(command(rl_base, ref_dir))

    # rollouts at steps 1, 3, 5, 7: the reward's 3rd call is step 5's, after the checkpoint of step 3
    a = start(command(rl_base, run_dir), MEGAPIPE_TEST_HANG=f"{marker}:3")
    end = time.monotonic() + 300
    while not marker.exists():
        assert a.poll() is None, finish(a)
        assert time.monotonic() < end, "timed out waiting for step 5's rollout"
        time.sleep(0.01)
    a.send_signal(signal.SIGKILL)
    finish(a)
    assert a.returncode == -signal.SIGKILL
    assert (run_dir / "latest").read_text().strip() == "step_00000003"
    m3 = json.loads((run_dir / "step_00000003" / "megapipe.json").read_text())
    assert m3["data_state"]["consumed_prompts"] == 8 and m3["data_state"]["pending"]["passes_left"] == 1
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]

    b = start(command(rl_base, run_dir))  # the same command again: it resumes from --save's newest checkpoint
    out = finish(b)
    assert b.returncode == 0, out
    out = finish(ref)
    assert ref.returncode == 0, out

    want, got = curve(ref_dir), curve(run_dir)
    assert [r["step"] for r in got] == list(range(1, ITERS + 1))  # the resume replaced the records after step 3
    assert got == want  # bit for bit
    assert {"reward", "kl", "mismatch_kl", "completion_len"} <= set(want[4])

    final = json.loads((run_dir / "step_00000008" / "megapipe.json").read_text())
    assert final["parent"] == str(run_dir / "step_00000003")
    assert final["posttrain_start"] == str(rl_base.absolute()) and final["data_state"] == {"consumed_prompts": 16}
