"""MLA's tensor-parallel plan (megapipe.models.mla): heads split, latents and the shared rope key replicated, on two
gloo processes equal to one process (loss and every gradient, with and without sequence parallelism)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.torchrun import failure

WORKER = Path(__file__).parents[1] / "dist" / "mla_tp_worker.py"


def test_mla_tensor_parallel_equals_one_process():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure(proc)
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout
