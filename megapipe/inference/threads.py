"""One thread instead of several while another process competes for the CPU cores (``EngineConfig.thread_governor``).

A step is hundreds of short parallel regions, each of which waits for its slowest thread. When a busy process
shares the cores, one of the engine's threads is often off its core, and every region waits for it: on a 2-vCPU
machine next to one CPU-bound process the engine's two threads got half their CPU time and 0.40x of the solo
tokens/s at batch 8 (0.47x at 64 concurrent requests), while one thread, which nothing waits for, kept 0.59x
(0.53x). So the governor measures, over each second of steps, the share of its threads' time the process got
(its CPU seconds over wall seconds x threads: 0.95 alone, spinning waits included, 0.50 next to the busy process);
below ``threshold`` it runs the steps on one thread, and after ``hold_s`` seconds of steps tries all of them again
for a second, the hold doubling (to ``max_hold_s``) while the contention lasts. The caller's thread count is
restored after every step, so code that shares the process (RL's trainer) keeps its own.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

log = logging.getLogger("megapipe.engine")


class ThreadGovernor:
    def __init__(self, window_s: float = 1.0, threshold: float = 0.6, hold_s: float = 5.0, max_hold_s: float = 60.0):
        self.window_s, self.threshold, self.first_hold, self.max_hold_s = window_s, threshold, hold_s, max_hold_s
        self.single = False  # steps run on one thread
        self.hold = hold_s  # seconds of steps on one thread before all are tried again
        self.held = 0.0
        self.trying = False  # the window after a hold: contention there doubles the next hold
        self.wall = self.cpu = 0.0

    def threads(self, configured: int) -> int:
        return 1 if self.single else configured

    @contextlib.contextmanager
    def step(self):
        """Run one step on the governed thread count; measure it."""
        configured = torch.get_num_threads()
        threads = self.threads(configured)
        if threads != configured:
            torch.set_num_threads(threads)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - wall, time.process_time() - cpu, threads)
            if threads != configured:
                torch.set_num_threads(configured)

    def observe(self, wall: float, cpu: float, threads: int) -> None:
        """One step's wall and CPU seconds (the process's, all threads) on ``threads`` threads."""
        if self.single:
            self.held += wall
            if self.held >= self.hold:
                self.single, self.trying = False, True
            return
        if threads < 2:
            return
        self.wall, self.cpu = self.wall + wall, self.cpu + cpu
        if self.wall < self.window_s:
            return
        share = self.cpu / (self.wall * threads)
        self.wall = self.cpu = 0.0
        if share >= self.threshold:
            self.hold, self.trying = self.first_hold, False
            return
        self.hold = min(2 * self.hold, self.max_hold_s) if self.trying else self.first_hold
        self.single, self.held, self.trying = True, 0.0, False
        log.info("another process competes for the CPU cores (this engine's %d threads got %.0f%% of their time "
                 "over the last second): the steps run on one thread for %.0f s", threads, 100 * share, self.hold)
