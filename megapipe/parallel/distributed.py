"""Process-group set-up: detect torchrun or Slurm (srun), pick the backend, and small rank helpers.

Under torchrun the env has RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT. Under ``srun`` (without torchrun)
we read SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and take the first host of SLURM_JOB_NODELIST as the master.
Backend: NCCL for CUDA tensors (with gloo beside it for CPU tensors), gloo on CPU.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

from megapipe.errors import MegapipeError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    launcher: str = "none"  # "torchrun", "slurm" or "none"


def first_slurm_host(nodelist: str) -> str:
    """'node[003-005,007],gpu1' -> 'node003' (what `scontrol show hostnames | head -1` prints)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_env(env=None) -> DistInfo:
    """Rank layout from the launcher's environment; a plain `python` run is rank 0 of 1."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), launcher="torchrun")
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return DistInfo(
            int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), launcher="slurm"
        )
    return DistInfo()


def _export_slurm_rendezvous(info: DistInfo) -> None:
    os.environ.setdefault("RANK", str(info.rank))
    os.environ.setdefault("WORLD_SIZE", str(info.world_size))
    os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or "127.0.0.1"
    os.environ.setdefault("MASTER_ADDR", first_slurm_host(nodelist))
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))


def init_distributed(cfg=None, timeout_s: float | None = None) -> DistInfo:
    """Join the process group when launched by torchrun/srun (idempotent); return this process's DistInfo."""
    import torch
    import torch.distributed as dist

    info = detect_env()
    cuda = torch.cuda.is_available()
    device = f"cuda:{info.local_rank}" if cuda else "cpu"
    info = DistInfo(info.rank, info.world_size, info.local_rank, device, info.launcher)
    if cuda:
        torch.cuda.set_device(info.local_rank)
    if info.world_size == 1 or dist.is_initialized():
        return info
    if info.launcher == "slurm":
        _export_slurm_rendezvous(info)
    if timeout_s is None:
        timeout_s = cfg.parallel.timeout_s if cfg is not None else 600.0
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    kwargs = {"device_id": torch.device(device)} if cuda else {}
    dist.init_process_group(
        backend=backend, rank=info.rank, world_size=info.world_size, timeout=timedelta(seconds=timeout_s), **kwargs
    )
    return info


def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if is_distributed() else 1


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (one small all-reduce; no-op in one process)."""
    if get_world_size() == 1:
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_reduce_max_(t) -> None:
    """In-place max over all ranks (no-op in one process)."""
    if get_world_size() > 1:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX)


def barrier() -> None:
    import torch.distributed as dist

    if is_distributed():
        dist.barrier()


def destroy_distributed() -> None:
    """Tear the process group down at the end of a run: every rank first waits for all the others to finish their
    collectives, then closes its transport. A process that exits with the group alive, or tears it down while a
    peer is still talking to it, can die in C++ (gloo's threads abort on interpreter shutdown)."""
    import torch.distributed as dist

    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


_TIMEOUT = re.compile(r"timed out|timeout|watchdog", re.IGNORECASE)
_PEER_GONE = re.compile(r"connection (closed|reset) by peer|remote worker crash", re.IGNORECASE)


def explain_collective_failure(exc: BaseException, timeout_s: float) -> MegapipeError | None:
    """A hung or dead peer surfaces as a backend RuntimeError (gloo) or DistBackendError (NCCL); say it in one
    sentence with the setting that bounds the wait. None when ``exc`` is something else."""
    if not isinstance(exc, RuntimeError) or not is_distributed():
        return None
    text = str(exc)
    where = f"rank {get_rank()} of {get_world_size()}"
    if _TIMEOUT.search(text):
        return MegapipeError(
            f"{where}: a collective did not complete within parallel.timeout_s = {timeout_s:g} s "
            "(--distributed-timeout-minutes); another rank hung, died or is far behind"
        )
    if _PEER_GONE.search(text):
        return MegapipeError(f"{where}: a peer process closed its connection (it crashed or was killed); see its log")
    return None
