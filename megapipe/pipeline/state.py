"""The run directory: one directory per step, each with its ``state.json``; ``pipeline.json`` for the last run.

```
RUN_DIR/
  pipeline.json        the last `pipeline run`: when, executor, what each step was (run / cached / skipped)
  STEP/
    state.json         state (queued, running, done, failed), key, generation, inputs, command, times, error, job
    log.txt            the command's output, every attempt
    <output>           what the stage writes (run/, tokenizer/, data_text_document.bin/.idx, completions.txt ...)
    plots/             training steps: PNGs of metrics.jsonl
```

Each step writes only its own ``state.json`` (atomically), so Slurm jobs of several steps never race on one file.
A step's *generation* is a fresh id each time it completes: a downstream step records the generations it
consumed, so a step that reran (forced, or its upstream changed) invalidates everything below it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from megapipe.errors import MegapipeError
from megapipe.fileio import write_text_atomic

STATE_NAME = "state.json"
PIPELINE_NAME = "pipeline.json"
LOG_NAME = "log.txt"
LOCK_NAME = ".lock"

# states written by the executors; `status` adds cached / stale / pending from the pipeline file
QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"


def read_state(step_dir: Path) -> Optional[dict]:
    path = step_dir / STATE_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {"state": FAILED, "error": f"{path} is unreadable"}


def write_state(step_dir: Path, record: dict) -> None:
    step_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(step_dir / STATE_NAME, json.dumps(record, indent=1, sort_keys=True) + "\n")


def update_state(step_dir: Path, **fields: Any) -> dict:
    record = read_state(step_dir) or {}
    record.update(fields)
    write_state(step_dir, record)
    return record


def new_generation() -> str:
    return uuid.uuid4().hex[:16]


def now() -> float:
    return time.time()


def read_pipeline_record(run_dir: Path) -> Optional[dict]:
    try:
        return json.loads((run_dir / PIPELINE_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_pipeline_record(run_dir: Path, record: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / PIPELINE_NAME, json.dumps(record, indent=1, sort_keys=True) + "\n")


class RunLock:
    """An exclusive lock on a run directory, held while a `pipeline run` executes or submits steps."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_NAME
        self._fd: Optional[int] = None
        self._created = False

    def __enter__(self) -> "RunLock":
        self._created = not self.path.parent.exists()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MegapipeError(f"cannot create the run directory {self.path.parent}: {e.strerror}") from None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise MegapipeError(f"another `megapipe pipeline run` (pid {holder}) is using {self.path.parent}: wait for "
                                "it to finish") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if exc_type is not None and self._created and [p.name for p in self.path.parent.iterdir()] == [LOCK_NAME]:
            # refused before anything was written (a bad --set, a busy step): leave no run directory behind
            self.path.unlink()
            self.path.parent.rmdir()
