"""Training curves from ``metrics.jsonl``: one PNG per metric, several runs overlaid, plus ``plots.json``.

Figures (each written only when some run has its data): loss (train, and eval as dashed markers), learning rate,
gradient norm, tokens/s, and for RL runs reward (and accuracy), KL, completion length and the engine/trainer
log-prob mismatch. ``plots.json`` beside the PNGs holds
the exact points of every line drawn, so tools (and tests) can read them back.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megapipe.errors import MegapipeError
from megapipe.fileio import refuse_overlap, write_text_atomic

METRICS = "metrics.jsonl"
TRAIN, EVAL = ("train",), ("valid", "eval", "test")
MAX_STEP = 2 ** 53  # every step below is exact in a float (and in matplotlib's axes)


@dataclass(frozen=True)
class Series:
    label: str
    kinds: Optional[tuple[str, ...]]  # record kinds it reads (None: any)
    keys: tuple[str, ...]  # the first key a record has is taken (names differ between recipes)
    style: str = "line"  # line | points (sparse evaluations)


@dataclass(frozen=True)
class FigureSpec:
    name: str
    title: str
    ylabel: str
    series: tuple[Series, ...]
    log_y: bool = False


FIGURES = (
    FigureSpec("loss", "Loss", "loss", (Series("train", TRAIN, ("loss",)),
                                         Series("eval", EVAL, ("loss", "eval_loss"), "points"))),
    FigureSpec("lr", "Learning rate", "lr", (Series("lr", TRAIN, ("lr",)),)),
    FigureSpec("grad_norm", "Gradient norm (before clipping)", "grad norm", (Series("grad norm", TRAIN,
                                                                                     ("grad_norm",)),)),
    FigureSpec("tokens_per_s", "Throughput", "tokens/s", (Series("tokens/s", TRAIN, ("tokens_per_s",)),)),
    FigureSpec("reward", "Reward", "reward", (Series("reward", None, ("reward", "reward_mean", "rewards/mean")),
                                               Series("accuracy", None, ("accuracy",)))),
    FigureSpec("kl", "KL to the reference policy", "KL", (Series("KL", None, ("kl", "kl_mean", "objective/kl")),)),
    FigureSpec("length", "Completion length", "tokens", (Series("length", None, ("completion_len", "length",
                                                                                  "completion_length",
                                                                                  "response_length")),)),
    FigureSpec("mismatch", "Rollout engine vs trainer log-probs (sampled tokens)", "mismatch",
               (Series("KL", None, ("mismatch_kl",)), Series("max |d|", None, ("mismatch_max",))), log_y=True),
)


def find_metrics(run: str | Path) -> Path:
    """A run's metrics.jsonl: the file itself, RUN/metrics.jsonl, or the one in a subdirectory (a pipeline
    step's directory holds its run one level down)."""
    p = Path(run)
    if p.is_file():
        return p
    if (p / METRICS).is_file():
        return p / METRICS
    if p.is_dir():
        found = sorted(p.glob(f"*/{METRICS}"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise MegapipeError(f"{run} holds several runs ({', '.join(str(f.parent) for f in found)}): name one")
    if not p.exists():
        raise MegapipeError(f"run {run} does not exist")
    raise MegapipeError(f"{run} has no {METRICS} (give a run directory written by a training stage's --save)")


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line cut short by a crash is skipped; for a step logged twice (a resumed
    run) the last record wins. A step that is no count of training steps (negative, fractional, beyond 2**53) is
    an error naming the line."""
    records: dict[tuple, dict] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                continue
            step = rec.get("step") if isinstance(rec, dict) else None
            if not isinstance(step, (int, float)) or isinstance(step, bool):
                continue
            if not (math.isfinite(step) and step == int(step) and 0 <= step <= MAX_STEP):
                raise MegapipeError(f"{path}:{number}: step {step!r} is not a training step (a whole number from 0 "
                                    f"to 2**53)")
            records[(rec.get("kind", "train"), int(step))] = rec
    return sorted(records.values(), key=lambda r: (r["step"], str(r.get("kind"))))


def series_points(records: list[dict], s: Series) -> tuple[list[float], list[float], Optional[str]]:
    """(steps, values, the key read) of a series; non-finite and missing values are left out."""
    chosen = next((k for k in s.keys if any(k in r for r in records if s.kinds is None or r.get("kind", "train")
                                            in s.kinds)), None)
    xs, ys = [], []
    if chosen is None:
        return xs, ys, None
    for r in records:
        if s.kinds is not None and r.get("kind", "train") not in s.kinds:
            continue
        v = r.get(chosen)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys, chosen


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard-style exponential moving average, debiased so the first points are not pulled to zero."""
    if not 0 < weight < 1:
        return values
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


def run_labels(runs: Sequence[Path]) -> list[str]:
    """Short distinct names: the run directory's name, with parents added until they differ."""
    parts = [p.absolute().parts for p in runs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in runs]


def plot_runs(runs: Sequence[str | Path], output: str | Path, labels: Optional[Sequence[str]] = None,
              smooth: float = 0.0) -> dict:
    """Write a PNG per figure that has data into ``output`` and ``plots.json`` beside them; returns that JSON's
    content ({"runs": [...], "figures": {name: {"file", "series": [...]}}})."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = [find_metrics(r) for r in runs]
    run_dirs = [p.parent for p in paths]
    labels = list(labels) if labels else run_labels(run_dirs)
    if len(labels) != len(paths):
        raise MegapipeError(f"{len(labels)} --label for {len(paths)} runs: give one per run, or none")
    data = [read_metrics(p) for p in paths]
    if not any(data):
        raise MegapipeError(f"no metrics records in {', '.join(str(p) for p in paths)}")
    out_dir = Path(output)
    refuse_overlap([out_dir], [*runs, *paths])  # a run directory (or its metrics) is read, never written
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MegapipeError(f"cannot create the plot directory {out_dir}: {e.strerror}") from None
    try:
        return _draw(plt, MaxNLocator, labels, paths, data, out_dir, smooth)
    except BaseException:
        if created:  # a failed plot leaves no directory behind that it made
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _draw(plt, MaxNLocator, labels, paths, data, out_dir: Path, smooth: float) -> dict:
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    summary: dict = {"runs": [{"label": lab, "metrics": str(p)} for lab, p in zip(labels, paths, strict=True)],
                     "figures": {}}
    for spec in FIGURES:
        drawn = []
        fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
        for i, (label, records) in enumerate(zip(labels, data, strict=True)):
            color = colors[i % len(colors)]
            for j, s in enumerate(spec.series):
                xs, ys, key = series_points(records, s)
                if not xs:
                    continue
                name = label if len(spec.series) == 1 else f"{label} {s.label}"
                if s.style == "points":
                    ax.plot(xs, ys, linestyle="--", marker="o", markersize=4, color=color, label=name)
                else:
                    shown = ema(ys, smooth) if smooth else ys
                    # a run's further lines in one figure (accuracy beside reward) are dotted, in the run's colour
                    ax.plot(xs, shown, linestyle="-" if j == 0 else ":", linewidth=1.4 if j == 0 else 2.0,
                            color=color, label=name)
                    ys = shown
                drawn.append({"run": label, "series": s.label, "key": key, "kind": list(s.kinds or ["any"]),
                              "steps": xs, "values": ys})
        if not drawn:
            plt.close(fig)
            continue
        ax.set_title(spec.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(spec.ylabel)
        if spec.log_y and all(v > 0 for d in drawn for v in d["values"]):
            ax.set_yscale("log")
        if spec.name == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        file = out_dir / f"{spec.name}.png"
        tmp = out_dir / f".{spec.name}.png.tmp-{os.getpid()}"
        fig.savefig(tmp, format="png")
        plt.close(fig)
        os.replace(tmp, file)
        summary["figures"][spec.name] = {"file": file.name, "series": drawn}
    write_text_atomic(out_dir / "plots.json", json.dumps(summary, indent=1) + "\n")
    return summary
