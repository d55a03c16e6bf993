"""``megapipe plot RUN... --output DIR``: PNGs of training curves (several runs overlaid) from metrics.jsonl."""

from __future__ import annotations

from typing import List, Optional

import typer

from stages.common import print_table


def plot(
    runs: List[str] = typer.Argument(..., help="Run directories (a training stage's --save), their metrics.jsonl, "
                                     "or pipeline step directories."),
    output: str = typer.Option(..., "--output", "-o", help="Directory for the PNGs and plots.json."),
    label: Optional[List[str]] = typer.Option(None, "--label", help="Legend name per run, in order (default: the "
                                              "run directories' names)."),
    smooth: float = typer.Option(0.0, "--smooth", min=0.0, max=0.999, help="Exponential moving average weight "
                                 "for the train curves (TensorBoard's smoothing; 0 = raw)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary table."),
) -> None:
    """Plot loss / eval loss, learning rate, grad norm, tokens/s (and reward, KL, length for RL) per run."""
    # lazy: not loaded by megapipe --help, which stays fast
    from megapipe.plot import plot_runs

    summary = plot_runs(runs, output, labels=label, smooth=smooth)
    if not quiet:
        rows = [(name, f"{output}/{fig['file']} ({len(fig['series'])} series)")
                for name, fig in summary["figures"].items()]
        print_table("plots", rows + [("data", f"{output}/plots.json")])
