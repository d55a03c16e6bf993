"""``python -m megapipe.pipeline.job STEP/job.json``: run one step inside its Slurm batch job.

Exit status 0 only when the step completed, so ``afterok`` dependencies hold back the steps downstream of a
failure (and ``--kill-on-invalid-dep`` cancels them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megapipe.pipeline.execute import run_step
from megapipe.pipeline.state import DONE


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m megapipe.pipeline.job STEP/job.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    record = run_step(job, echo=sys.stdout)
    if record.get("state") != DONE:
        print(f"error: step '{job['step']}' failed: {record.get('error')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
