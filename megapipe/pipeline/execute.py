"""Run one step: the stage command in a child process, its output teed to the step's log, its state recorded.

Both executors call ``run_step``: the local one in the `pipeline run` process, the Slurm one inside the step's
batch job (``python -m megapipe.pipeline.job``), so a step means the same wherever it runs. A job is a plain
JSON-able dict (``job_spec``), which is what the Slurm executor writes as ``job.json``.

SIGINT/SIGTERM during a step are passed on as SIGTERM to the command's process group (a training stage then
saves a checkpoint and stops); the step is recorded as failed ("interrupted"), and the next run resumes it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Optional

from megapipe.parallel.distributed import first_slurm_host
from megapipe.pipeline.plan import Decision
from megapipe.pipeline.spec import Pipeline
from megapipe.pipeline.stages import latest_checkpoint_step, to_argv
from megapipe.pipeline.state import DONE, FAILED, LOG_NAME, RUNNING, new_generation, now, read_state, update_state
from megapipe.plot import plot_runs

GROUP_EXIT_WAIT_S = 120.0  # how long a stopped command's processes get to save and exit before SIGKILL


def job_spec(pipeline: Pipeline, d: Decision, executor: str) -> dict:
    """Everything needed to run the step ``d`` anywhere, as JSON-able data."""
    step = pipeline.steps[d.name]
    options = pipeline.resolved_options(d.name)
    if d.resume_from is not None and step.output.resume and step.output.resume.option:
        options[step.output.resume.option] = str(pipeline.output_path(d.name))
        for name in step.output.resume.clear:
            options.pop(name, None)
    res = step.resources
    return {
        "pipeline": pipeline.name,
        "file": str(pipeline.file),
        "run_dir": str(pipeline.run_dir.absolute()),
        "step": d.name,
        "stage": step.stage,
        "key": d.key,
        "material": d.material,
        "options": step.options,
        "argv": to_argv(step.cmd, options),
        "env": step.env,
        "upstream": step.upstream,
        "output": {"path": str(pipeline.output_path(d.name).absolute()), "kind": step.output.kind,
                   "reference": str(Path(pipeline.reference(d.name, "output")).absolute())},
        "training": step.output.training,
        "metrics": step.output.metrics if step.output.training else None,
        "resume_from": d.resume_from,
        "fresh": d.resume_from is None,  # remove what an earlier attempt left before running
        "executor": executor,
        "nodes": res.get("nodes", 1),
        "procs_per_node": res.get("procs_per_node", res.get("gpus_per_node") or 1),
        "cpus_per_task": res.get("cpus_per_task"),
        "reason": d.reason,
    }


def command_line(job: dict, program: Optional[list[str]] = None, endpoint: Optional[str] = None) -> list[str]:
    """The process the step starts: ``python -m megapipe.cli ARGV``, with the launch flags of a training stage
    (torchrun here; under Slurm one torchrun per node through srun, joined by a c10d rendezvous on the first node
    of the job). ``program``/``endpoint`` replace the interpreter and the rendezvous address (for --dry-run)."""
    base = [*(program or [sys.executable, "-m", "megapipe.cli"]), *job["argv"]]
    if not job["training"]:
        return base
    procs, nodes = int(job["procs_per_node"]), int(job["nodes"])
    if job["executor"] != "slurm":
        return base + (["--nproc-per-node", str(procs)] if procs > 1 else [])
    if endpoint is None:
        endpoint = f"{_head_node()}:{29400 + int(os.environ.get('SLURM_JOB_ID', '0')) % 10000}"
    srun = ["srun", "--kill-on-bad-exit=1", f"--nodes={nodes}", "--ntasks-per-node=1"]
    if job.get("cpus_per_task"):
        srun.append(f"--cpus-per-task={job['cpus_per_task']}")
    # each node's task adds its own --node-rank from SLURM_NODEID (c10d assigns the ranks, torchrun checks it)
    wrapper = ["bash", "-c", 'exec "$@" --node-rank "$SLURM_NODEID"', "megapipe-step"]
    return srun + wrapper + base + ["--nproc-per-node", str(procs), "--nnodes", str(nodes), "--rdzv-endpoint",
                                    endpoint]


def _head_node() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return socket.gethostname()
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass

    return first_slurm_host(nodelist)


# ----------------------------------------------------------------------------------------------- running


def run_step(job: dict, echo: Optional[IO[str]] = None) -> dict:
    """Run a step's command and record the outcome in its state.json; returns the final record."""
    run_dir = Path(job["run_dir"])
    step_dir = run_dir / job["step"]
    step_dir.mkdir(parents=True, exist_ok=True)
    out = job["output"]
    missing = [u for u in job["upstream"] if (read_state(run_dir / u) or {}).get("state") != DONE]
    record = read_state(step_dir) or {}
    attempt = int(record.get("attempt", 0)) + 1
    base = {"stage": job["stage"], "key": job["key"], "material": job["material"], "options": job["options"],
            "output": out["reference"], "attempt": attempt, "job_id": os.environ.get("SLURM_JOB_ID"),
            "executor": job["executor"]}
    if missing:
        return update_state(step_dir, **base, state=FAILED, error=f"upstream step '{missing[0]}' is not done",
                            finished=now())
    inputs = {u: (read_state(run_dir / u) or {}).get("generation") for u in job["upstream"]}
    if job["fresh"]:
        remove_output(out)
    cmd = command_line(job)
    started = now()
    update_state(step_dir, **base, state=RUNNING, started=started, finished=None, duration_s=None, error=None,
                 command=shlex.join(cmd), host=socket.gethostname(), pid=os.getpid(), inputs=inputs,
                 resumed_from=job["resume_from"])
    env = {**os.environ, **job["env"], "PYTHONUNBUFFERED": "1"}
    stdout_path = Path(out["path"]) if out["kind"] == "stdout" else None
    rc, stopped_by, tail = _run(cmd, env, step_dir / LOG_NAME, stdout_path, echo,
                                header=f"attempt {attempt}: {shlex.join(cmd)}",
                                on_start=lambda pid: update_state(step_dir, child_pid=pid))
    duration = now() - started
    if job["training"] and job["metrics"]:
        _plot(Path(out["reference"]) / job["metrics"], step_dir / "plots", job["step"], echo)
    if rc == 0 and stopped_by is None:
        return update_state(step_dir, state=DONE, finished=now(), duration_s=duration, rc=0, error=None,
                            generation=new_generation(), pid=None, child_pid=None)
    if stopped_by is not None:
        error = f"interrupted by {stopped_by}"
        if job["training"]:
            step = latest_checkpoint_step(Path(out["reference"]))
            error += f" (checkpoint at step {step}; the next run resumes from it)" if step is not None else ""
    else:
        error = f"exit {rc}" + (f": {tail}" if tail else "")
    if not job["training"]:
        remove_output(out)  # nothing half-written survives a failure (a run directory keeps its checkpoints)
    return update_state(step_dir, state=FAILED, finished=now(), duration_s=duration, rc=rc, error=error, pid=None,
                        child_pid=None)


def remove_output(out: dict) -> None:
    path = Path(out["path"])
    targets = [path]
    if out["kind"] == "prefix":
        targets += list(path.parent.glob(path.name + "_*")) + list(path.parent.glob(path.name + ".*"))
    for t in targets:
        if t.is_dir() and not t.is_symlink():
            shutil.rmtree(t)
        elif t.exists() or t.is_symlink():
            t.unlink()


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the pipeline process dies, even by SIGKILL, so a training
    stage saves and stops instead of running on unwatched (it has its own process group, away from Ctrl-C)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run(cmd: list[str], env: dict, log_path: Path, stdout_path: Optional[Path], echo: Optional[IO[str]],
         header: str, on_start=None) -> tuple[int, Optional[str], str]:
    """Start ``cmd`` in its own process group, tee its output, pass stop signals on; (rc, signal name, last
    error line)."""
    stopped: list[str] = []
    last = {"line": "", "error": ""}  # the last line, and the last `error: ...` line the CLI printed
    tmp_stdout = stdout_path.with_name(stdout_path.name + ".partial") if stdout_path else None
    with open(log_path, "a", encoding="utf-8", errors="replace") as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {header}\n")
        log.flush()
        try:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, text=True, errors="replace",
                                    bufsize=1, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        except OSError as e:
            log.write(f"cannot start {cmd[0]}: {e}\n")
            return 127, None, f"cannot start {cmd[0]}: {e.strerror}"
        if on_start is not None:
            on_start(proc.pid)
        lock = threading.Lock()

        def pump(stream, extra: Optional[IO[str]]):
            for line in stream:
                with lock:
                    log.write(line)
                    log.flush()
                    if extra is not None:
                        extra.write(line)
                    if echo is not None:
                        echo.write(line)
                        echo.flush()
                    text = line.strip()
                    if text:
                        last["line"] = text
                        if text.startswith("error:"):
                            last["error"] = text

        sink = open(tmp_stdout, "w", encoding="utf-8") if tmp_stdout else None
        threads = [threading.Thread(target=pump, args=(proc.stdout, sink), daemon=True),
                   threading.Thread(target=pump, args=(proc.stderr, None), daemon=True)]
        for t in threads:
            t.start()

        def on_signal(signum, frame):
            if stopped:  # a second signal: stop waiting for a graceful exit
                _killpg(proc.pid, signal.SIGKILL)
                return
            stopped.append(signal.Signals(signum).name)
            _killpg(proc.pid, signal.SIGTERM)

        previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                previous[s] = signal.signal(s, on_signal)
        try:
            rc = proc.wait()
            _wait_group(proc.pid, GROUP_EXIT_WAIT_S if stopped else 10.0)
            for t in threads:
                t.join(timeout=10)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            if sink is not None:
                sink.close()
    if tmp_stdout is not None:
        if rc == 0 and not stopped:
            os.replace(tmp_stdout, stdout_path)
        else:
            tmp_stdout.unlink(missing_ok=True)
    return rc, (stopped[0] if stopped else None), (last["error"] or last["line"])[:300]


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is still in process group ``pgid`` (Linux /proc; else killpg)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _wait_group(pgid: int, timeout: float) -> None:
    """Wait for the rest of the command's process group (a launcher's workers) to exit; SIGKILL it after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            _killpg(pgid, signal.SIGKILL)
            return
        time.sleep(0.1)


def _plot(metrics: Path, out_dir: Path, label: str, echo: Optional[IO[str]]) -> None:
    if not metrics.is_file():
        return
    try:
        plot_runs([metrics.parent], out_dir, labels=[label])
    except Exception as e:  # a plot must never turn a finished training step into a failed one
        if echo is not None:
            echo.write(f"warning: could not plot {metrics}: {e}\n")
