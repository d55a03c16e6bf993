"""`pipeline run` and `pipeline status`: plan, then execute locally or submit to Slurm; the status table's rows."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

from megapipe.errors import MegapipeError
from megapipe.pipeline import slurm
from megapipe.pipeline.execute import command_line, job_spec, run_step
from megapipe.pipeline.plan import CACHED, RUN, Decision, make_plan
from megapipe.pipeline.spec import Pipeline
from megapipe.pipeline.state import (
    DONE,
    FAILED,
    QUEUED,
    RUNNING,
    RunLock,
    now,
    read_pipeline_record,
    read_state,
    write_pipeline_record,
)


class StepFailed(MegapipeError):
    exit_code = 1


class StepInterrupted(MegapipeError):
    exit_code = 130


@dataclass
class RunResult:
    decisions: list[Decision]
    ran: list[str] = field(default_factory=list)
    job_ids: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def dry_run_lines(pipeline: Pipeline, decisions: list[Decision], executor: str) -> list[tuple[Decision, str]]:
    """Each step's decision and the command it would run (under Slurm: what its batch job runs)."""
    import shlex

    return [(d, shlex.join(command_line(job_spec(pipeline, d, executor), ["megapipe"], "HEAD_NODE:PORT")))
            for d in decisions]


def run_pipeline(pipeline: Pipeline, executor: str, start: Optional[str] = None, until: Optional[str] = None,
                 force: Optional[list[str]] = None, echo: Optional[IO[str]] = None, wait: bool = False,
                 on_plan=None) -> RunResult:
    """Run (local) or submit (slurm) every step the plan says must run. A failed step raises StepFailed naming it
    (its completed upstream stays as it is); Ctrl-C / SIGTERM raises StepInterrupted after the step stopped."""
    t0 = now()
    with RunLock(pipeline.run_dir):
        decisions = make_plan(pipeline, start, until, force)
        runs = [d for d in decisions if d.action == RUN]
        for d in runs:
            busy = active(d.record)
            if busy:
                raise MegapipeError(f"step '{d.name}' is still {busy}: wait for it, or cancel it")
            if executor == "local" and pipeline.steps[d.name].resources.get("nodes", 1) > 1:
                raise MegapipeError(f"step '{d.name}' asks for resources.nodes = "
                                    f"{pipeline.steps[d.name].resources['nodes']}; the local executor runs on this "
                                    "machine only: use --executor slurm")
        if on_plan is not None:
            on_plan(decisions)
        run_id = uuid.uuid4().hex[:12]
        record = {"run_id": run_id, "file": str(pipeline.file), "sets": pipeline.sets, "executor": executor,
                  "started": t0,
                  "finished": None, "steps": {d.name: {"action": d.action, "reason": d.reason, "key": d.key}
                                              for d in decisions}}
        write_pipeline_record(pipeline.run_dir, record)
        result = RunResult(decisions)
        try:
            if executor == "slurm":
                result.job_ids = slurm.submit(pipeline, runs, lambda d: job_spec(pipeline, d, "slurm"), echo)
                result.ran = list(result.job_ids)
                if wait:
                    slurm.wait(pipeline, result.job_ids, echo)
                    _raise_first_failure(pipeline, runs)
            else:
                for d in runs:
                    if echo is not None:
                        echo.write(f"\n>>> step {d.name} ({pipeline.steps[d.name].stage}): {d.reason}\n")
                        echo.flush()
                    rec = run_step(job_spec(pipeline, d, "local"), echo)
                    result.ran.append(d.name)
                    if rec.get("state") != DONE:
                        _raise_failure(pipeline, d.name, rec)
        finally:
            record["finished"] = now()
            write_pipeline_record(pipeline.run_dir, record)
    result.seconds = now() - t0
    return result


def _raise_first_failure(pipeline: Pipeline, runs: list[Decision]) -> None:
    for d in runs:
        rec = read_state(pipeline.step_dir(d.name)) or {}
        if rec.get("state") != DONE:
            _raise_failure(pipeline, d.name, rec)


def _raise_failure(pipeline: Pipeline, name: str, rec: dict) -> None:
    log = pipeline.step_dir(name) / "log.txt"
    error = rec.get("error") or "failed"
    if error.startswith("interrupted"):
        raise StepInterrupted(f"step '{name}' ({pipeline.steps[name].stage}) {error}; log: {log}")
    raise StepFailed(f"step '{name}' ({pipeline.steps[name].stage}) failed: {error} (log: {log})")


def active(rec: Optional[dict]) -> Optional[str]:
    """'queued as Slurm job 12 (PENDING)' / 'running (pid 7 on host)' when a step's last attempt is still alive."""
    if not rec or rec.get("state") not in (QUEUED, RUNNING):
        return None
    job_id = rec.get("job_id")
    if job_id and shutil.which("squeue"):
        state = slurm.job_states([job_id]).get(job_id, ("", ""))[0]
        return f"{rec['state']} as Slurm job {job_id} ({state})" if state in slurm.ACTIVE else None
    if rec.get("host") != socket.gethostname():
        return None
    for key in ("pid", "child_pid"):  # the pipeline process, and the command it started
        pid = rec.get(key)
        if pid and pid != os.getpid():
            try:
                os.kill(int(pid), 0)
                return f"running (pid {pid})"
            except (ProcessLookupError, PermissionError, ValueError):
                continue
    return None


# ------------------------------------------------------------------------------------------------ status


@dataclass
class StatusRow:
    step: str
    stage: str
    state: str  # done | cached | stale | failed | pending | queued | running
    output: str
    duration_s: Optional[float]
    key: str
    job: str
    note: str


def status_rows(pipeline: Pipeline) -> list[StatusRow]:
    decisions = make_plan(pipeline)
    last = read_pipeline_record(pipeline.run_dir) or {}
    last_steps = last.get("steps", {})
    job_states: dict[str, tuple[str, str]] = {}
    job_ids = [d.record["job_id"] for d in decisions if d.record and d.record.get("job_id")
               and d.record.get("state") in (QUEUED, RUNNING)]
    if job_ids and shutil.which("squeue"):
        job_states = slurm.job_states(job_ids)
    rows = []
    for d in decisions:
        rec = d.record or {}
        state, note = _state_of(d, rec, last_steps.get(d.name, {}), job_states)
        job = rec.get("job_id") or ""
        if job and job in job_states:
            job += f" {job_states[job][0]}"
        out = pipeline.reference(d.name, "output")
        duration = rec.get("duration_s") if state not in ("queued", "running", "pending") else None
        rows.append(StatusRow(d.name, pipeline.steps[d.name].stage, state, _relative(out), duration, d.key[:12], job,
                              note))
    return rows


def _state_of(d: Decision, rec: dict, last: dict, job_states: dict) -> tuple[str, str]:
    state = rec.get("state")
    if state is None:
        return "pending", ""
    if state in (QUEUED, RUNNING):
        job_id = rec.get("job_id")
        if job_id and job_id in job_states:
            js, reason = job_states[job_id]
            if js in slurm.ACTIVE:
                return ("running" if js in ("RUNNING", "COMPLETING") else "queued"), (reason if reason != "None"
                                                                                     else "")
            return FAILED, f"Slurm job ended as {js}" + (f" ({reason})" if reason not in ("", "None") else "")
        if active(rec):
            return state, ""
        return FAILED, "its run ended without recording an outcome"
    if state == FAILED:
        return FAILED, rec.get("error") or ""
    if d.valid:
        if last.get("action") == CACHED and last.get("key") == d.key:
            return "cached", ""
        return "done", ""
    return "stale", d.why


def _relative(path: str) -> str:
    try:
        return str(Path(path).absolute().relative_to(Path.cwd()))
    except ValueError:
        return path
