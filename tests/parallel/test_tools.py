"""tools/loss_compare.py runs two layouts through torchrun and agrees with itself across layouts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.dist
def test_loss_compare_single_vs_fsdp2(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools" / "loss_compare.py"), "single", "dp_shard2", "--steps", "2", "--",
           "--num-layers", "2", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].endswith(": OK") and len(lines) == 4  # header, 2 steps, verdict
    step1 = lines[1].split()
    assert float(step1[1]) == pytest.approx(float(step1[2]), rel=1e-5) and float(step1[1]) > 5.0  # ~ln(256)
