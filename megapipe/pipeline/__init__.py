"""Pipeline files: parse + validate, step keys and cache, run directory state, executors (local, Slurm)."""

from megapipe.pipeline.plan import CACHED, RUN, SKIP, Decision, make_plan
from megapipe.pipeline.runner import RunResult, StepFailed, StepInterrupted, dry_run_lines, run_pipeline, status_rows
from megapipe.pipeline.spec import Pipeline, Step, load_pipeline

__all__ = [
    "CACHED", "RUN", "SKIP", "Decision", "Pipeline", "RunResult", "Step", "StepFailed", "StepInterrupted",
    "dry_run_lines", "load_pipeline", "make_plan", "run_pipeline", "status_rows",
]
