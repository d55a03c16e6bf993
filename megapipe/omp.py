"""OpenMP's wait policy for the processes that decode.

A decode step is hundreds of short parallel regions (a few per layer). With OpenMP's default policy a thread that
finishes its part spins for a long while (GNU libgomp: 300,000 spins) before sleeping; on a machine whose cores are
shared with another busy process the spinning threads take the cores the working thread needs, and the step's time
grows by an order of magnitude. A thread that sleeps at once (passive) keeps the engine near its fair share, but then
every region waits for its threads to be woken. Measured on a 2-vCPU VM (SmolLM2 bf16, 500 requests of 64 + 32
tokens, 64 at a time, in one process): default 1149 output tokens/s alone, 76 next to one CPU-bound process;
passive 807 and 582; a bounded spin of 3000 (libgomp's GOMP_SPINCOUNT, ~0.1-0.2 ms of pause loops: it spans the
short gaps between a step's regions and sleeps through anything longer) 1114 and 518. `megapipe serve` gave 743
output tokens/s passive and 852 bounded. Next to a busy process the engine's thread governor then runs on one thread
(megapipe.inference.threads). OMP_WAIT_POLICY=PASSIVE is set beside it for OpenMP runtimes other than GNU's, which
read no GOMP_SPINCOUNT (libgomp takes the spin count over the policy). The runtime reads both once, when torch loads
it, so this must run before torch is imported; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = 3000


def prefer_bounded_spin() -> bool:
    """Set GOMP_SPINCOUNT=SPIN_COUNT (and OMP_WAIT_POLICY=PASSIVE) for this process and those it starts, if nobody
    chose a wait policy and torch is not loaded yet; returns whether it did."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ or "torch" in sys.modules:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
