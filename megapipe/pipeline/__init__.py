"""Pipeline files: parse + validate, step keys and cache, run directory state, executors (local, Slurm).

spec.py ``load_pipeline`` (a file checked against the commands the CLI hands in), plan.py ``make_plan`` (what runs,
what is cached), runner.py ``run_pipeline`` / ``status_rows`` / ``dry_run_lines``, stages.py (a step's command and
its ``Output``). The package imports none of them, so a module here may import its siblings without a circle.
"""
