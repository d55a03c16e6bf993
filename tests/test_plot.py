"""`megapipe plot`: the PNGs hold the series of metrics.jsonl (read back from plots.json and from the pixels)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megapipe.cli import main
from megapipe.errors import MegapipeError
from megapipe.plot import ema, plot_runs, run_labels


def write_metrics(run_dir, records, tail: str = ""):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)
    return run_dir


@pytest.fixture
def runs(tmp_path):
    pre = [{"kind": "train", "step": s, "loss": 6.0 - 0.1 * s, "lr": 1e-3 * s, "grad_norm": 1.0 + s,
            "tokens_per_s": 1000.0 + s} for s in range(1, 11)]
    pre[4]["loss"] = None  # a nan step is written as null: left out
    pre += [{"kind": "valid", "step": 5, "loss": 5.7, "ppl": 298.9}, {"kind": "valid", "step": 10, "loss": 5.2}]
    pre.append({"kind": "train", "step": 10, "loss": 4.9, "lr": 0.01, "grad_norm": 11.0, "tokens_per_s": 1010.0})
    a = write_metrics(tmp_path / "a" / "run", pre, tail='{"kind": "train", "step": 11, "lo')  # cut by a kill -9
    rl = [{"kind": "train", "step": s, "loss": 1.0 / s, "reward": 0.1 * s, "kl": 0.01 * s, "completion_length": 20 + s}
          for s in range(1, 6)]
    b = write_metrics(tmp_path / "b" / "run", rl)
    return a, b


def series(summary, figure):
    return {(s["run"], s["series"]): (s["steps"], s["values"]) for s in summary["figures"][figure]["series"]}


def test_plot_writes_each_metric_with_every_run(tmp_path, runs, capsys):
    a, b = runs
    out = tmp_path / "plots"
    assert main(["plot", str(a), str(b), "--output", str(out)]) == 0
    summary = json.loads((out / "plots.json").read_text())
    assert set(summary["figures"]) == {"loss", "lr", "grad_norm", "tokens_per_s", "reward", "kl", "length"}
    assert {f.name for f in out.glob("*.png")} == {f"{n}.png" for n in summary["figures"]}
    assert [r["label"] for r in summary["runs"]] == ["a/run", "b/run"]  # same names: parents tell them apart
    loss = series(summary, "loss")
    steps = [1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert loss[("a/run", "train")] == (steps, [6.0 - 0.1 * s for s in steps[:-1]] + [4.9])  # last record wins
    assert loss[("a/run", "eval")] == ([5, 10], [5.7, 5.2])
    assert loss[("b/run", "train")] == ([1, 2, 3, 4, 5], [1.0 / s for s in range(1, 6)])
    assert ("b/run", "eval") not in loss
    assert series(summary, "lr")[("a/run", "lr")][1][-1] == 0.01
    assert series(summary, "reward") == {("b/run", "reward"): ([1, 2, 3, 4, 5], [0.1 * s for s in range(1, 6)])}
    assert summary["figures"]["length"]["series"][0]["key"] == "completion_length"
    assert "tokens_per_s" in capsys.readouterr().out

    import matplotlib.image

    pixels = matplotlib.image.imread(out / "loss.png")
    assert pixels.shape[:2] == (462, 825)
    rgb = (pixels[..., :3] * 255).round().astype(int).reshape(-1, 3)
    for color in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):  # matplotlib's first two colors: run a, run b
        assert (np.abs(rgb - color).sum(axis=1) < 30).sum() > 200


def test_a_run_without_rl_keys_gets_no_rl_figures(tmp_path, runs):
    summary = plot_runs([runs[0]], tmp_path / "out", labels=["pretrain"])
    assert set(summary["figures"]) == {"loss", "lr", "grad_norm", "tokens_per_s"}
    assert not (tmp_path / "out" / "reward.png").exists()
    assert series(summary, "grad_norm")[("pretrain", "grad norm")][1][:2] == [2.0, 3.0]


def test_smoothing_is_a_debiased_ema(tmp_path, runs):
    summary = plot_runs([runs[1]], tmp_path / "out", smooth=0.5)
    values = series(summary, "loss")[("run", "train")][1]
    raw = [1.0 / s for s in range(1, 6)]
    assert values == ema(raw, 0.5) and values[0] == raw[0]
    assert values[1] == pytest.approx((0.25 * 1.0 + 0.5 * 0.5) / 0.75)  # (w(1-w) x1 + (1-w) x2) / (1 - w^2)
    assert series(summary, "loss")[("run", "train")][0] == [1, 2, 3, 4, 5]


def test_a_pipeline_step_directory_is_a_run(tmp_path, runs):
    step_dir = runs[0].parent  # holds run/metrics.jsonl one level down, as a pipeline step's directory does
    assert plot_runs([step_dir], tmp_path / "out")["runs"][0]["metrics"] == str(runs[0] / "metrics.jsonl")


def test_mistakes(tmp_path, runs, capsys):
    with pytest.raises(MegapipeError, match="does not exist"):
        plot_runs([tmp_path / "nope"], tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MegapipeError, match=r"has no metrics.jsonl"):
        plot_runs([tmp_path / "empty"], tmp_path / "out")
    with pytest.raises(MegapipeError, match="2 --label for 1 runs"):
        plot_runs([runs[0]], tmp_path / "out", labels=["x", "y"])
    assert main(["plot", str(tmp_path / "nope"), "--output", str(tmp_path / "out")]) == 2
    assert "error: run" in capsys.readouterr().err


@pytest.mark.parametrize("step", ["1e300", "1e308", "-1", "2.5", "NaN"])
def test_a_step_that_is_no_step_count_is_named_and_nothing_is_written(tmp_path, capsys, step):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n'
                                       f'{{"kind": "train", "step": {step}, "loss": 1.0}}\n')
    assert main(["plot", str(run), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"metrics.jsonl:2: step {json.loads(step)!r} is not a training step" in err.replace("\n", "")
    assert not (tmp_path / "out").exists()


def test_labels_are_short_and_distinct(tmp_path):
    assert run_labels([tmp_path / "x" / "run", tmp_path / "y" / "run"]) == ["x/run", "y/run"]
    assert run_labels([tmp_path / "one", tmp_path / "two"]) == ["one", "two"]
