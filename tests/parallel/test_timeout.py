import subprocess
import sys
from pathlib import Path

from megapipe.parallel.distributed import explain_collective_failure

WORKER = Path(__file__).parents[1] / "dist" / "timeout_worker.py"


def test_a_hung_rank_becomes_one_clear_error():
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(WORKER)],
        capture_output=True, text=True, timeout=120,
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("EXPLAINED:"))
    assert line == (
        "EXPLAINED: rank 0 of 2: a collective did not complete within parallel.timeout_s = 2 s "
        "(--distributed-timeout-minutes); another rank hung, died or is far behind"
    )


def test_other_errors_are_left_alone():
    assert explain_collective_failure(RuntimeError("Timed out"), 1.0) is None  # no process group: not ours
    assert explain_collective_failure(ValueError("timeout"), 1.0) is None
