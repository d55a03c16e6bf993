"""A real tiny pretrain step interrupted mid-run (SIGTERM to `megapipe pipeline run`) resumes from its checkpoint.

tests/pipeline/pipelines/train.yaml: tok -> data -> pretrain -> hf (export hf).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megapipe.cli import step_commands
from megapipe.pipeline.runner import run_pipeline, status_rows
from megapipe.pipeline.spec import load_pipeline
from megapipe.pipeline.state import read_state

TRAIN = Path(__file__).parent / "pipelines" / "train.yaml"
ITERS = 60
# ~2k tokens a step: slow enough (~0.1 s a step) to be stopped half-way, fast enough to finish in seconds
SETS = [f"vars.iters={ITERS}", "pretrain.global_batch_size=32", "pretrain.micro_batch_size=16",
        "pretrain.save_interval=10", "pretrain.eval_interval=20"]


def train_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "pretrain" / "run" / "metrics.jsonl").open()]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == sorted(set(steps)), "a step logged twice"
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_interrupted_pretrain_resumes_from_its_checkpoint(tmp_path, shakespeare_excerpt):
    run_dir = tmp_path / "run"
    sets = [f"vars.corpus={shakespeare_excerpt}", *SETS]
    args = [sys.executable, "-m", "megapipe.cli", "pipeline", "run", str(TRAIN), "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    first_ckpt = run_dir / "pretrain" / "run" / "step_00000010" / "megapipe.json"
    deadline = time.monotonic() + 240
    while not first_ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the pipeline ended before its first checkpoint: {proc.communicate()}"
    os.kill(proc.pid, signal.SIGTERM)  # what Ctrl-C, `kill` or a preemption does
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, (out, err)
    rec = read_state(run_dir / "pretrain")
    stopped_at = int(rec["error"].split("checkpoint at step ")[1].split(";")[0])
    assert 10 <= stopped_at < ITERS
    assert rec["state"] == "failed" and rec["error"] == (
        f"interrupted by SIGTERM (checkpoint at step {stopped_at}; the next run resumes from it)")
    assert "interrupted by SIGTERM" in " ".join(err.split())
    assert not (run_dir / "hf").exists()  # nothing downstream ran
    pipeline = load_pipeline(TRAIN, step_commands(), sets, str(run_dir))
    rows = {r.step: r for r in status_rows(pipeline)}
    assert (rows["pretrain"].state, rows["tok"].state, rows["hf"].state) == ("failed", "done", "pending")

    result = run_pipeline(pipeline, "local")
    decisions = {d.name: d for d in result.decisions}
    assert [decisions[s].action for s in ("tok", "data")] == ["cached", "cached"]
    assert decisions["pretrain"].resume_from == stopped_at
    assert decisions["pretrain"].reason.endswith(f"resumes from its checkpoint at step {stopped_at}")
    assert result.ran == ["pretrain", "hf"]
    rec = read_state(run_dir / "pretrain")
    assert rec["state"] == "done" and rec["attempt"] == 2 and rec["resumed_from"] == stopped_at
    assert f"--load {run_dir}/pretrain/run" in rec["command"]
    second_attempt = (run_dir / "pretrain" / "log.txt").read_text().split("===== ")[-1]
    assert f"resuming from {run_dir}/pretrain/run/step_{stopped_at:08d} at step {stopped_at}" in second_attempt
    assert f"step {stopped_at + 1} |" in second_attempt and "step 1 |" not in second_attempt
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert (run_dir / "hf" / "hf" / "config.json").is_file()
    plotted = json.loads((run_dir / "pretrain" / "plots" / "plots.json").read_text())
    train_series = plotted["figures"]["loss"]["series"][0]
    assert train_series["steps"] == list(range(1, ITERS + 1)) and train_series["values"] == [losses[s] for s in
                                                                                          range(1, ITERS + 1)]

    # the same pretrain, never interrupted, has the same curve: the resume continued the run exactly
    reference = tmp_path / "reference"
    run_pipeline(load_pipeline(TRAIN, step_commands(), sets, str(reference)), "local", until="pretrain")
    assert train_losses(reference) == losses
    assert run_pipeline(pipeline, "local").ran == []  # and now it is all cached


def test_a_failed_step_whose_options_changed_starts_over(tmp_path, shakespeare_excerpt):
    """A training step that failed after saving checkpoints resumes from them only while its key is unchanged;
    with another option it is another run: its old checkpoints are removed and it trains from step 1."""
    from megapipe.pipeline.plan import make_plan
    from megapipe.pipeline.state import update_state

    run_dir = tmp_path / "run"
    sets = [f"vars.corpus={shakespeare_excerpt}", "vars.iters=4"]
    pipeline = load_pipeline(TRAIN, step_commands(), sets, str(run_dir))
    run_pipeline(pipeline, "local", until="pretrain")
    update_state(run_dir / "pretrain", state="failed", error="interrupted by SIGTERM")  # checkpoints at 2 and 4
    plan = {d.name: d for d in make_plan(pipeline, until="pretrain")}
    assert plan["pretrain"].resume_from == 4  # unchanged: it would resume

    changed = load_pipeline(TRAIN, step_commands(), [*sets, "pretrain.lr=1e-3"], str(run_dir))
    result = run_pipeline(changed, "local", until="pretrain")
    pretrain = {d.name: d for d in result.decisions}["pretrain"]
    assert result.ran == ["pretrain"] and pretrain.resume_from is None
    assert pretrain.reason == "interrupted by SIGTERM; option lr changed: '3e-3' -> '1e-3', so it starts over"
    rec = read_state(run_dir / "pretrain")
    assert rec["state"] == "done" and rec["resumed_from"] is None and "--lr 1e-3" in rec["command"]
    second_attempt = (run_dir / "pretrain" / "log.txt").read_text().split("===== ")[-1]
    assert "resuming from" not in second_attempt and "step 1 |" in second_attempt
    assert sorted(train_losses(run_dir)) == [1, 2, 3, 4]
