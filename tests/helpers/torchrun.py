"""What a failed torchrun launch printed, the workers' own output last: torchrun ends its stderr with a summary of
exit codes (and its own traceback) that would otherwise fill the tail a failure message keeps, hiding the worker's
exception, gloo's abort reason or the Python stacks faulthandler dumped."""

from __future__ import annotations

import subprocess

_SUMMARY = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def failure(proc: subprocess.CompletedProcess, keep: int = 6000) -> str:
    err = proc.stderr or ""
    cut = err.find(_SUMMARY)
    if cut < 0:
        cut = len(err)
    elif (traceback := err.rfind("Traceback (most recent call last)", 0, cut)) >= 0:
        cut = traceback  # torchrun's own traceback belongs to the summary
    workers, summary = err[:cut], err[cut:]
    exits = "\n".join(line for line in summary.splitlines() if "exitcode" in line or "Signal" in line)
    return (f"torchrun exited {proc.returncode}\n{exits}\n--- stdout (tail) ---\n{(proc.stdout or '')[-2000:]}"
            f"\n--- workers' stderr (tail) ---\n{workers[-keep:]}")
