"""What the training-step benchmarks share (tools/bench_train.py, bench_moe.py, bench_hybrid.py): each case runs in
a worker process of the tool (``run_worker``), times its steps (``time_steps``), and the rounds of every case are
summed up (``summarize``) and compared (``speed_ratio``)."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]


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


def run_worker(script: str, passthrough: list[str], *case: str, python: Optional[str] = None,
               env: Optional[dict] = None) -> Optional[dict]:
    """``script`` again in a fresh process (of ``python``, default this one; ``env`` added to the environment) as
    the worker of ``case`` (``--worker CASE...``, the same options): its last stdout line, a JSON dict; None (and
    its stderr's tail) when it failed."""
    cmd = [python or sys.executable, script, *passthrough, "--worker", *case]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        print(f"{' '.join(case)} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(results: list[dict]) -> dict:
    """A case's rounds (``time_steps`` dicts) -> median step and CPU seconds over every timed step, peak RSS, and
    each round's median step."""
    return {"step": statistics.median(w for r in results for w in r["walls"]),
            "cpu": statistics.median(c for r in results for c in r["cpus"]),
            "peak": max(r["peak_rss_mb"] for r in results),
            "rounds": [statistics.median(r["walls"]) for r in results]}


def speed_ratio(ours: dict, base: dict, note: str = "") -> str:
    """'speed 1.25x (rounds 1.16-1.27x; by CPU time 1.26x), peak memory 0.75x' of two ``summarize`` dicts."""
    rounds = sorted(b / o for b, o in zip(base["rounds"], ours["rounds"], strict=True))
    note = f"; {note}" if note else ""
    return (f"speed {base['step'] / ours['step']:.2f}x (rounds {rounds[0]:.2f}-{rounds[-1]:.2f}x; by CPU time "
            f"{base['cpu'] / ours['cpu']:.2f}x{note}), peak memory {ours['peak'] / base['peak']:.2f}x")
