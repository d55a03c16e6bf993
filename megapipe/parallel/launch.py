"""``megapipe pretrain --nproc-per-node N``: re-execute the same command under torchrun, unless already launched.

Under torchrun (RANK/WORLD_SIZE set) the process joins the existing job; under srun with one task per GPU and
no --nproc-per-node it joins through the SLURM_* variables (megapipe.parallel.distributed). srun with one task per
node plus --nproc-per-node starts one torchrun per node. Single node: torchrun --standalone picks a free port. Several nodes: every node runs the same command
with --nnodes, --node-rank and --rdzv-endpoint HOST:PORT (c10d rendezvous, as torchrun does).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional, Sequence

from megapipe.errors import ConfigError
from megapipe.parallel.distributed import detect_env

LAUNCH_FLAGS = ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint")


def strip_launch_flags(argv: Sequence[str]) -> list[str]:
    """argv without the launcher's own flags (both '--flag value' and '--flag=value' forms)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCH_FLAGS or name.replace("_", "-") in LAUNCH_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def check_process_counts(nproc_per_node: Optional[int], nnodes: int) -> None:
    for flag, value in (("--nproc-per-node", nproc_per_node), ("--nnodes", nnodes)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} = {value} must be >= 1 (processes per node and nodes)")


def torchrun_command(argv: Sequence[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                     rdzv_endpoint: Optional[str] = None, module: str = "megapipe.cli") -> list[str]:
    check_process_counts(nproc_per_node, nnodes)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node)]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ConfigError(f"--nnodes = {nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node)")
        if not 0 <= node_rank < nnodes:
            raise ConfigError(f"--node-rank = {node_rank} must be within [0, {nnodes - 1}]")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", rdzv_endpoint]
    return cmd + ["-m", module, *strip_launch_flags(argv)]


def planned_world_size(nproc_per_node: Optional[int], nnodes: int = 1) -> int:
    """The world size the job will have: torchrun's WORLD_SIZE when already under it, else
    --nproc-per-node x --nnodes when we launch, else the srun task count (1 for a plain process)."""
    check_process_counts(nproc_per_node, nnodes)
    env = detect_env()
    if env.launcher == "torchrun":
        return env.world_size
    if (nproc_per_node or 1) * nnodes > 1:
        return (nproc_per_node or 1) * nnodes
    return env.world_size


def maybe_launch_torchrun(argv: Sequence[str], nproc_per_node: Optional[int], nnodes: int = 1, node_rank: int = 0,
                          rdzv_endpoint: Optional[str] = None) -> Optional[int]:
    """Run ``megapipe <argv>`` under torchrun and return its exit code; None when the caller should just go on
    (already under torchrun/srun, or a single process was asked for)."""
    check_process_counts(nproc_per_node, nnodes)
    if detect_env().launcher == "torchrun" or ((nproc_per_node or 1) == 1 and nnodes == 1):
        return None  # a worker of torchrun, or one process (plain, or one srun task of many)
    cmd = torchrun_command(argv, nproc_per_node or 1, nnodes, node_rank, rdzv_endpoint)
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nproc_per_node or 1))))
    return run_forwarding_signals(cmd, env)


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launching process dies (Linux), so torchrun never runs on unwatched."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc; empty elsewhere)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def run_forwarding_signals(cmd: list[str], env: dict) -> int:
    """Run torchrun ``cmd`` in its own process group and pass SIGTERM/SIGINT straight to its workers, exactly once
    (a Ctrl-C in the terminal reaches only this process): each worker finishes its step, saves with the others
    and exits 0, so torchrun ends cleanly. (Signalled itself, torchrun would raise, kill the workers after 30 s
    and exit 1.) Without workers yet, torchrun gets the signal."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def forward(signum, frame):
        if proc.poll() is not None:
            return
        workers = _children(proc.pid)
        for pid in workers or [proc.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if proc.poll() is None:  # an exception here: never leave the job behind
            proc.terminate()
            proc.wait()
