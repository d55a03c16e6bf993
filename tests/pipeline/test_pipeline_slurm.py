"""The Slurm executor on a real single-node Slurm cluster (tests/helpers/slurm_cluster.py; skipped, with the reason,
where it cannot start): sbatch per step, afterok chains, a 2-process pretrain through srun + torchrun rendezvous,
states from squeue/scontrol, a failure cancelling its downstream."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from megapipe.cli import step_commands
from megapipe.pipeline import slurm as slurm_executor
from megapipe.pipeline.runner import StepFailed, run_pipeline, status_rows
from megapipe.pipeline.spec import load_pipeline
from megapipe.pipeline.state import read_state

TRAIN = Path(__file__).parent / "pipelines" / "train.yaml"
STEPS = ["tok", "data", "pretrain", "hf"]


def test_slurm_runs_a_pipeline_with_a_two_process_pretrain(slurm_cluster, tmp_path, shakespeare_excerpt):
    run_dir = tmp_path / "run"
    sets = [f"vars.corpus={shakespeare_excerpt}", "pretrain.micro_batch_size=2",
            "pretrain.resources.procs_per_node=2", "pretrain.resources.cpus_per_task=2"]
    pipeline = load_pipeline(TRAIN, step_commands(), sets, str(run_dir))
    result = run_pipeline(pipeline, "slurm")
    assert list(result.job_ids) == STEPS and len(set(result.job_ids.values())) == 4
    rows = {r.step: r for r in status_rows(pipeline)}
    # hf waits on pretrain (seconds of training): queued behind its dependency right after submission
    assert rows["hf"].state == "queued" and rows["hf"].note in ("", "Dependency")  # before/after a scheduling pass
    assert rows["hf"].job == f"{result.job_ids['hf']} PENDING"
    slurm_executor.wait(pipeline, result.job_ids, None, poll_s=0.5, timeout_s=600)

    recs = {s: read_state(run_dir / s) for s in STEPS}
    assert all(r["state"] == "done" and r["executor"] == "slurm" for r in recs.values()), recs
    assert {s: r["job_id"] for s, r in recs.items()} == result.job_ids
    for up, down in zip(STEPS[:-1], STEPS[1:], strict=True):  # afterok: each starts after its upstream finished
        assert recs[down]["started"] >= recs[up]["finished"]
    manifest = json.loads((run_dir / "pretrain" / "run" / "step_00000008" / "megapipe.json").read_text())
    assert manifest["layout"] == {"world_size": 2, "parallel": "dp_shard2"}
    command = recs["pretrain"]["command"]
    assert command.startswith("srun --kill-on-bad-exit=1 --nodes=1 --ntasks-per-node=1 --cpus-per-task=2 bash -c")
    assert command.endswith(f"--nproc-per-node 2 --nnodes 1 --rdzv-endpoint "
                            f"{socket.gethostname()}:{29400 + int(result.job_ids['pretrain']) % 10000}")
    assert "#SBATCH --cpus-per-task=2" in (run_dir / "pretrain" / "job.sbatch").read_text()
    assert (run_dir / "pretrain" / "plots" / "loss.png").is_file()
    assert (run_dir / "hf" / "hf" / "config.json").is_file()
    assert [r.state for r in status_rows(pipeline)] == ["done"] * 4

    again = run_pipeline(pipeline, "slurm", wait=True)  # a cache hit submits nothing
    assert again.job_ids == {} and {d.action for d in again.decisions} == {"cached"}

    broken = load_pipeline(TRAIN, step_commands(), [*sets, f"data.input={tmp_path}/missing.jsonl"], str(run_dir))
    with pytest.raises(StepFailed, match=r"^step 'data' \(preprocess\) failed: exit 2: error: input file "):
        run_pipeline(broken, "slurm", wait=True)
    rows = {r.step: r for r in status_rows(broken)}
    assert [rows[s].state for s in STEPS] == ["cached", "failed", "failed", "failed"]
    for s in ("pretrain", "hf"):  # never ran: Slurm cancelled them when their dependency failed
        assert read_state(run_dir / s)["error"] == (
            f"Slurm job {read_state(run_dir / s)['job_id']} ended as CANCELLED (DependencyNeverSatisfied)")
    assert (run_dir / "pretrain" / "run" / "step_00000008").is_dir()  # the completed outputs are untouched
