"""The Slurm executor: one ``sbatch`` job per step, chained with ``afterok`` dependencies.

Each job runs ``python -m megapipe.pipeline.job STEP/job.json``, which runs the step exactly as the local
executor does and records its state; a training step's command goes through ``srun`` (one task per node, each a
torchrun joined by a c10d rendezvous on the first node). A job whose upstream failed is cancelled by Slurm
(``--kill-on-invalid-dep=yes``). Job states come from ``squeue`` and ``scontrol`` (clusters without accounting
have no ``sacct``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from megapipe.errors import MegapipeError
from megapipe.fileio import write_text_atomic
from megapipe.pipeline.state import DONE, FAILED, QUEUED, now, read_state, update_state

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
          "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED"}
SIGNAL_BEFORE_END_S = 120  # training jobs get SIGTERM this long before their time limit: they save and stop


def require_slurm() -> None:
    missing = [c for c in ("sbatch", "squeue", "scontrol") if shutil.which(c) is None]
    if missing:
        raise MegapipeError(f"--executor slurm needs Slurm's {', '.join(missing)} on PATH (none found here)")


def batch_script(job: dict, step_dir: Path, res: dict) -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job['pipeline']}.{job['step']}",
             f"#SBATCH --output={step_dir.absolute()}/slurm-%j.out", f"#SBATCH --chdir={os.getcwd()}",
             f"#SBATCH --nodes={res.get('nodes', 1)}", "#SBATCH --ntasks-per-node=1"]
    for key, flag in (("cpus_per_task", "cpus-per-task"), ("gpus_per_node", "gpus-per-node"), ("mem", "mem"),
                      ("time", "time"), ("partition", "partition"), ("account", "account"), ("qos", "qos"),
                      ("constraint", "constraint")):
        if res.get(key) not in (None, 0):
            lines.append(f"#SBATCH --{flag}={res[key]}")
    if job["training"]:
        lines.append(f"#SBATCH --signal=B:TERM@{SIGNAL_BEFORE_END_S}")
    lines += [f"#SBATCH {arg}" for arg in res.get("sbatch", [])]
    job_json = step_dir.absolute() / "job.json"
    lines += ["set -euo pipefail", f"exec {shlex.quote(sys.executable)} -m megapipe.pipeline.job "
              f"{shlex.quote(str(job_json))}", ""]
    return "\n".join(lines)


def submit(pipeline, runs: list, job_for, echo) -> dict[str, str]:
    """Submit the steps to run (in order) and return {step: job id}. Jobs are submitted held, recorded as queued,
    then released together: no job starts before its state says queued (so it never races that write), and a
    submission that fails part-way cancels what it submitted before anything ran."""
    require_slurm()
    ids: dict[str, str] = {}
    for d in runs:
        step = pipeline.steps[d.name]
        step_dir = pipeline.step_dir(d.name)
        step_dir.mkdir(parents=True, exist_ok=True)
        job = job_for(d)
        write_text_atomic(step_dir / "job.json", json.dumps(job, indent=1) + "\n")
        script = step_dir / "job.sbatch"
        write_text_atomic(script, batch_script(job, step_dir, step.resources))
        deps = [ids[u] for u in step.upstream if u in ids]
        cmd = ["sbatch", "--parsable", "--hold", "--kill-on-invalid-dep=yes"]
        if deps:
            cmd.append("--dependency=afterok:" + ":".join(deps))
        cmd.append(str(script))
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            cancel(list(ids.values()))
            raise MegapipeError(f"sbatch of step '{d.name}' failed: {e}") from None
        if res.returncode != 0:
            cancel(list(ids.values()))
            message = (res.stderr or res.stdout).strip().splitlines()
            raise MegapipeError(f"sbatch refused step '{d.name}': {message[-1] if message else res.returncode}")
        ids[d.name] = res.stdout.strip().split(";")[0]
    for d in runs:  # `key` stays the one of the attempt that last ran: a resume needs its checkpoints
        update_state(pipeline.step_dir(d.name), state=QUEUED, job_id=ids[d.name], queued_key=d.key,
                     stage=pipeline.steps[d.name].stage, submitted=now(), executor="slurm", error=None)
    if ids:
        res = subprocess.run(["scontrol", "release", ",".join(ids.values())], capture_output=True, text=True,
                             timeout=60)
        if res.returncode != 0:
            cancel(list(ids.values()))
            raise MegapipeError(f"scontrol release of jobs {', '.join(ids.values())} failed: "
                                f"{(res.stderr or res.stdout).strip()}")
    if echo is not None:
        for d in runs:
            after = [u for u in pipeline.steps[d.name].upstream if u in ids]
            echo.write(f"submitted {d.name} as job {ids[d.name]}" + (f" after {', '.join(after)}" if after else "")
                       + "\n")
        echo.flush()
    return ids


def cancel(job_ids: list[str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=60)


def job_states(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """{job id: (state, reason)} from squeue, and from scontrol for jobs squeue no longer lists; jobs neither
    knows (purged after MinJobAge) are absent."""
    states: dict[str, tuple[str, str]] = {}
    if not job_ids:
        return states
    try:
        res = subprocess.run(["squeue", "-h", "-o", "%i|%T|%r", "-j", ",".join(job_ids)], capture_output=True,
                             text=True, timeout=60)
        for line in res.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0] in job_ids:
                states[parts[0]] = (parts[1], parts[2])
    except (OSError, subprocess.SubprocessError):
        pass
    for job_id in job_ids:
        if job_id in states:
            continue
        try:
            res = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                                 timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        fields = dict(f.split("=", 1) for f in res.stdout.split() if "=" in f)
        if res.returncode == 0 and "JobState" in fields:
            states[job_id] = (fields["JobState"], fields.get("Reason", "None"))
    return states


def wait(pipeline, ids: dict[str, str], echo, poll_s: float = 2.0, timeout_s: Optional[float] = None) -> None:
    """Block until no submitted job is queued or running; jobs that ended without recording an outcome (cancelled,
    killed, their dependency failed) are recorded as failed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    reported: set[str] = set()
    while True:
        states = job_states(list(ids.values()))
        for name, job_id in ids.items():
            state = states.get(job_id, ("", ""))[0]
            if name not in reported and state and state not in ACTIVE and echo is not None:
                echo.write(f"job {job_id} ({name}): {state}\n")
                echo.flush()
                reported.add(name)
        if not any(states.get(j, ("", ""))[0] in ACTIVE for j in ids.values()):
            break
        if deadline is not None and time.monotonic() > deadline:
            raise MegapipeError(f"Slurm jobs still running after {timeout_s:.0f} s: {', '.join(ids.values())}")
        time.sleep(poll_s)

    for name, job_id in ids.items():
        rec = read_state(pipeline.step_dir(name)) or {}
        if rec.get("state") != DONE and rec.get("state") != FAILED:
            state, reason = states.get(job_id, ("unknown", ""))
            update_state(pipeline.step_dir(name), state=FAILED, finished=now(),
                         error=f"Slurm job {job_id} ended as {state}" + (f" ({reason})" if reason not in
                                                                        ("", "None") else ""))
