"""OpenMP's wait policy for the processes that decode.

A decode step is hundreds of short parallel regions (a few per layer). With OpenMP's default policy a thread that
finishes its part spins for a while before sleeping; on a machine whose cores are shared with another busy process
the spinning threads take the cores the working thread needs, and the step's time grows by an order of magnitude
(measured: 4 against 46 tokens/s at batch 8, tools/bench_generate.py --co-runner). A passive policy (sleep at once)
keeps the engine near its fair share. The runtime reads the policy once, when torch loads it, so this must run
before torch is imported; the user's own OMP_WAIT_POLICY always wins.
"""

from __future__ import annotations

import os
import sys


def prefer_passive_wait() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE for this process if nobody chose a policy and torch is not loaded yet; returns
    whether it did."""
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
