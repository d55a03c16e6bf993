"""Rank 1 stalls past the process-group timeout; rank 0 prints how megapipe explains the failed collective."""

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megapipe.parallel.distributed import explain_collective_failure, init_distributed

cfg = SimpleNamespace(parallel=SimpleNamespace(timeout_s=2.0))
info = init_distributed(cfg)
if info.rank == 1:
    time.sleep(6)
else:
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as e:
        print("EXPLAINED:", explain_collective_failure(e, 2.0), flush=True)
