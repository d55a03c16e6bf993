"""`megapipe pretrain` as a user runs it: kill -9 and SIGTERM mid-run, resume, and get the uninterrupted run's
losses bit for bit (fp32, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ITERS = 100


def command(pretrain_data, run_dir: Path, *extra: str) -> list[str]:
    prefix, tokenizer = pretrain_data
    return [
        sys.executable, "-m", "megapipe.cli", "pretrain", "--data-path", "1.0", str(prefix), "--tokenizer",
        str(tokenizer), "--model", "tiny", "--set", "model.num_layers=2", "--set", "model.hidden_size=64",
        "--set", "model.intermediate_size=128", "--set", "model.num_heads=4", "--set", "model.num_kv_heads=2",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS),
        "--lr", "1e-2", "--lr-warmup-iters", "5", "--split", "90,10,0", "--eval-interval", "50", "--eval-iters", "2",
        "--log-interval", "1", "--save", str(run_dir), "--save-interval", "5", "--precision", "fp32", *extra,
    ]


def start(cmd) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout=600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def records(run_dir: Path, running: bool = False) -> list[dict]:
    """Every record of metrics.jsonl; a line that is not JSON fails the test (it would hide a lost or damaged
    record). Only while the run is still writing may the last line be incomplete (no newline yet): it is left out."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    assert running or not tail, f"{path} ends with a cut line: {tail!r}"
    out = []
    for number, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise AssertionError(f"{path}:{number} is not a JSON record ({e}): {line!r}") from None
    return out


def wait_for(predicate, proc, what: str, timeout=300.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended before {what}:\n{finish(proc)}"
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def latest_step(run_dir: Path) -> int:
    name = (run_dir / "latest").read_text().strip()
    return json.loads((run_dir / name / "megapipe.json").read_text())["step"]


def curve(recs: list[dict]) -> list[tuple]:
    return [(r["kind"], r["step"], r["loss"], r.get("grad_norm"), r.get("lr")) for r in recs]


def test_kill9_and_sigterm_then_resume_is_bitwise_exact(pretrain_data, tmp_path):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    ref = start(command(pretrain_data, ref_dir))

    # 1. kill -9 as soon as a checkpoint exists
    a = start(command(pretrain_data, run_dir))
    wait_for(lambda: (run_dir / "latest").exists(), a, "the first checkpoint")
    a.send_signal(signal.SIGKILL)
    finish(a)
    assert a.returncode == -signal.SIGKILL
    killed_at = latest_step(run_dir)
    assert 5 <= killed_at < ITERS

    # 2. resume; SIGTERM once it has made progress: it finishes the step, saves, exits 0. The killed run may have
    # logged steps past its checkpoint: progress is a step past those too (else the signal can land while the
    # resumed run still loads, before its handlers are in place)
    logged = max([killed_at + 1] + [r["step"] for r in records(run_dir, running=True)])
    b = start(command(pretrain_data, run_dir, "--load", str(run_dir)))
    wait_for(lambda: any(r["step"] > logged for r in records(run_dir, running=True)), b, "progress after the resume")
    b.send_signal(signal.SIGTERM)
    out = finish(b)
    assert b.returncode == 0, out
    assert "stopped by SIGTERM" in out
    stopped_at = latest_step(run_dir)
    assert killed_at < stopped_at < ITERS
    assert max(r["step"] for r in records(run_dir)) == stopped_at  # the checkpoint holds the last step done
    manifest = json.loads((run_dir / f"step_{stopped_at:08d}" / "megapipe.json").read_text())
    assert manifest["stage"] == "pretrain" and manifest["data_state"] == {"consumed_samples": stopped_at * 4}
    assert (run_dir / f"step_{stopped_at:08d}" / "tokenizer" / "tokenizer.json").is_file()

    # 3. resume to the end
    c = start(command(pretrain_data, run_dir, "--load", str(run_dir)))
    out = finish(c)
    assert c.returncode == 0, out
    assert f"resuming from {run_dir / f'step_{stopped_at:08d}'}" in " ".join(out.split())

    out = finish(ref)
    assert ref.returncode == 0, out
    expected, got = curve(records(ref_dir)), curve(records(run_dir))
    assert [s for k, s, *_ in got if k == "train"] == list(range(1, ITERS + 1))
    assert got == expected  # every loss, gradient norm and learning rate, bit for bit
    assert latest_step(run_dir) == latest_step(ref_dir) == ITERS


def short_command(pretrain_data, run_dir: Path, iters: int, eval_iters: int) -> list[str]:
    cmd = command(pretrain_data, run_dir, "--save-interval", "1000", "--eval-iters", str(eval_iters))
    cmd[cmd.index("--train-iters") + 1] = str(iters)
    return cmd


def test_a_signal_during_the_final_evaluation_still_saves_the_last_step(pretrain_data, tmp_path):
    """Ctrl-C right after the last step's line, while the (long) final evaluation runs: the evaluation stops, the
    last step is saved, the run exits 0 and says why."""
    run_dir = tmp_path / "run"
    proc = start(short_command(pretrain_data, run_dir, 6, 5000))
    wait_for(lambda: any(r["kind"] == "train" and r["step"] == 6 for r in records(run_dir)), proc, "step 6")
    proc.send_signal(signal.SIGINT)
    out = finish(proc)
    assert proc.returncode == 0, out
    assert "stopped by SIGINT after step 6" in out
    assert latest_step(run_dir) == 6 and not list(run_dir.glob("*.tmp-*"))
    assert not [r for r in records(run_dir) if r["kind"] == "valid"]  # the cut evaluation records nothing


def test_signals_during_the_final_save_let_the_save_finish(pretrain_data, tmp_path):
    """SIGTERM every millisecond from the last step's line until the process exits, so signals land before, during
    and after the final save (a wider model makes the save last a while): the save completes and `latest` names it.
    (Once the run is over and its handlers are gone, a signal may end the process: exit 0 or -SIGTERM.)"""
    run_dir = tmp_path / "run"
    cmd = short_command(pretrain_data, run_dir, 4, 0) + ["--set", "model.hidden_size=384"]
    proc = start(cmd)
    wait_for(lambda: any(r["kind"] == "train" and r["step"] == 4 for r in records(run_dir)), proc, "step 4")
    saw_tmp = False
    while proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        saw_tmp = saw_tmp or any(run_dir.glob("*.tmp-*"))
        time.sleep(0.001)
    out = finish(proc)
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert latest_step(run_dir) == 4 and not list(run_dir.glob("*.tmp-*"))
    manifest = json.loads((run_dir / "step_00000004" / "megapipe.json").read_text())
    assert manifest["complete"] is True and saw_tmp
