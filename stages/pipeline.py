"""``megapipe pipeline run|status FILE``: chain stages from a YAML file, cached and resumable, locally or on Slurm.

The commands a step may run come from the CLI through the click context (``ctx.obj``: megapipe.cli's
``step_commands``), so the pipeline imports no CLI."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from megapipe.errors import ConfigError

SET_HELP = "Override, repeatable: STEP.OPTION=VALUE, vars.NAME=VALUE, STEP.resources.KEY=VALUE."
RUN_DIR_HELP = "Run directory (default: the file's run_dir, else runs/<name>)."


def run(
    ctx: typer.Context,
    file: str = typer.Argument(..., help="Pipeline YAML file."),
    start: Optional[str] = typer.Option(None, "--from", help="Rerun this step and what depends on it, nothing else."),
    until: Optional[str] = typer.Option(None, "--until", help="Run only this step and what it depends on."),
    force: Optional[List[str]] = typer.Option(None, "--force", help="Rerun this step (and so its downstream) even "
                                              "if cached; repeatable."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate, print the plan and each step's command, run "
                                 "nothing."),
    sets: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP),
    executor: Optional[str] = typer.Option(None, "--executor", help="local (default, or the file's executor:) or "
                                           "slurm."),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help=RUN_DIR_HELP),
    wait: bool = typer.Option(False, "--wait", help="slurm: block until the jobs end; exit non-zero if a step "
                              "failed."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not echo the steps' output (it is in their log.txt)."),
) -> None:
    """Run the steps of FILE whose inputs changed since they last completed; reuse the others (cache hits)."""
    # lazy: not loaded by megapipe --help, which stays fast
    from megapipe.pipeline.plan import make_plan
    from megapipe.pipeline.runner import dry_run_lines, run_pipeline
    from megapipe.pipeline.spec import EXECUTORS, load_pipeline

    pipeline = load_pipeline(file, ctx.obj(), sets, run_dir)
    executor = executor or pipeline.executor
    if executor not in EXECUTORS:
        raise ConfigError(f"--executor {executor}: choose {' or '.join(EXECUTORS)}")
    if dry_run:
        decisions = make_plan(pipeline, start, until, force)
        _show_plan(pipeline, decisions, executor, dry_run_lines(pipeline, decisions, executor))
        return
    result = run_pipeline(pipeline, executor, start, until, force, echo=None if quiet else sys.stdout, wait=wait,
                          on_plan=lambda ds: _show_plan(pipeline, ds, executor))
    _show_summary(pipeline, result, executor, wait)


def status(
    ctx: typer.Context,
    file: str = typer.Argument(..., help="Pipeline YAML file."),
    sets: Optional[List[str]] = typer.Option(None, "--set", help=SET_HELP + " Default: those of the last `run`."),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help=RUN_DIR_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of rows instead of a table."),
) -> None:
    """A table of the steps: state (done / cached / stale / failed / pending / queued / running), output,
    duration, key and Slurm job."""
    import dataclasses
    import json

    # lazy: not loaded by megapipe --help, which stays fast
    from megapipe.pipeline.runner import status_rows
    from megapipe.pipeline.spec import load_pipeline
    from megapipe.pipeline.state import read_pipeline_record

    step_commands = ctx.obj()
    pipeline = load_pipeline(file, step_commands, sets, run_dir)
    last = read_pipeline_record(pipeline.run_dir) or {}
    if not sets and last.get("sets"):  # compare with what the last run was asked for
        pipeline = load_pipeline(file, step_commands, last["sets"], run_dir)
    rows = status_rows(pipeline)
    if as_json:
        typer.echo(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    colors = {"done": "green", "cached": "green", "stale": "yellow", "failed": "red", "pending": "dim",
              "queued": "cyan", "running": "cyan"}
    overrides = f", --set {' --set '.join(pipeline.sets)}" if pipeline.sets else ""
    table = Table(title=f"pipeline {pipeline.name} ({pipeline.run_dir}{overrides})", title_justify="left")
    for col in ("step", "stage", "state", "output", "duration", "key", "job", "note"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.step, r.stage, f"[{colors.get(r.state, 'white')}]{r.state}[/]", _under(r.output, pipeline),
                      _duration(r.duration_s), r.key, r.job, r.note)
    console = Console()
    if not console.is_terminal:  # a pipe or a file: wide rows rather than paths folded over lines
        console = Console(width=max(console.width, 200))
    console.print(table)


def _under(path: str, pipeline) -> str:
    """A step's output relative to the run directory (named in the table's title)."""
    from pathlib import Path

    try:
        return str(Path(path).absolute().relative_to(pipeline.run_dir.absolute()))
    except ValueError:
        return path


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def _show_plan(pipeline, decisions, executor: str, commands=None) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)
    console.print(f"[bold]pipeline {pipeline.name}[/] ({pipeline.file}) -> {pipeline.run_dir}, executor {executor}")
    marks = {"run": "[bold yellow]run   [/]", "cached": "[green]cached[/]", "skip": "[dim]skip  [/]"}
    for i, d in enumerate(decisions):
        console.print(f"  {marks[d.action]} {d.name} ({pipeline.steps[d.name].stage}) key {d.key[:12]}"
                      + (f": {escape(d.reason)}" if d.action != "cached" else ""))
        if commands is not None:
            console.print(f"         [dim]$[/] {escape(commands[i][1])}")


def _show_summary(pipeline, result, executor: str, wait: bool) -> None:
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    cached = [d.name for d in result.decisions if d.action == "cached"]
    if executor == "slurm" and not wait:
        jobs = ", ".join(f"{n}={j}" for n, j in result.job_ids.items()) or "none"
        console.print(f"[bold]submitted[/] {len(result.job_ids)} job(s): {jobs}; cached: {len(cached)}; "
                      f"`megapipe pipeline status {pipeline.file}` follows them")
        return
    console.print(f"[bold green]pipeline {pipeline.name} done[/] in {result.seconds:.1f} s: ran {len(result.ran)} "
                  f"step(s) ({', '.join(result.ran) or 'none'}), {len(cached)} cached")
