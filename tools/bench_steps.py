"""The timing loop the training-step benchmarks share (tools/bench_train.py, bench_moe.py, bench_hybrid.py): each
runs one implementation's step in a worker process and reads back this dict."""

from __future__ import annotations

import resource
import time
from typing import Callable


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_steps(step: Callable[[], float], warmup: int, steps: int) -> dict:
    """``warmup`` untimed calls of ``step`` (which returns the loss), then ``steps`` timed ones: the wall and CPU
    seconds of each, the warm-up's seconds, the process's peak RSS, the first and the last loss."""
    t0 = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    warm = time.perf_counter() - t0
    walls, cpus = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {"walls": walls, "cpus": cpus, "warmup_s": warm, "peak_rss_mb": peak_rss_mb(), "first_loss": losses[0],
            "last_loss": losses[-1]}
