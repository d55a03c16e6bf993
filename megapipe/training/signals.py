"""Graceful stop: SIGTERM/SIGINT set a flag; the loop finishes its step, saves a checkpoint and exits cleanly.

A second SIGINT while stopping restores Python's default (KeyboardInterrupt) so an impatient user can still get out.
"""

from __future__ import annotations

import signal
import threading

from megapipe.parallel.distributed import any_rank


class StopRequest:
    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signals = signals
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set from the main thread
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self.received = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def requested(self, local: bool = False) -> bool:
        """True on every rank when any rank got a signal or has ``local`` set (ranks must stop at the same step to
        save together)."""
        return any_rank(self.received is not None or local)
