"""Run two parallel layouts on the same model, seed and global batches and print their per-step losses.

Two ways to run each layout:
  default     tools/layout_run.py: a few steps of the one training loop (megapipe.training.Trainer) at a
              constant learning rate, without eval or checkpoints; batches are random tokens or windows of a
              .bin/.idx prefix (--data). Arguments after ``--`` go to layout_run
              (see ``python tools/layout_run.py --help``).
  --pretrain  the real ``megapipe pretrain --nproc-per-node N`` with the layout's flags (--tp/--pp/--cp/
              --dp-shard/--dp-replicate); losses are read from its metrics.jsonl. Arguments after ``--`` go to
              ``megapipe pretrain`` and must name the data and tokenizer (--data-path, --tokenizer; the rest as usual).

    .venv/bin/python tools/loss_compare.py tp2,pp2 dp_shard4 --steps 5
    .venv/bin/python tools/loss_compare.py single cp2 --steps 3 -- --model tiny --seq-length 256 --optimizer adamw
    .venv/bin/python tools/loss_compare.py single tp2,pp2 --pretrain --steps 3 -- --data-path PREFIX --tokenizer TOK

Exit code 1 when a relative difference exceeds --tol (default 1e-5: fp32 layouts differ only in summation order;
with SGD the first steps agree to ~1e-7; AdamW amplifies round-off of tiny gradients, allow ~1e-4 after a few steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def pretrain_flags(layout: str) -> tuple[int, list[str]]:
    """'tp2,pp2' -> (4, ['--tp', '2', '--pp', '2']): the world size and the ``megapipe pretrain`` flags."""
    from megapipe.parallel.dims import layout_world_size, parse_layout

    parsed = parse_layout(layout)
    flags = []
    for name, size in parsed.items():
        if name == "ddp":
            flags += ["--dp-replicate", str(size), "--set", "parallel.dp_mode=ddp"]
        else:
            flags += ["--" + name.replace("_", "-"), str(size)]
    return layout_world_size(parsed), flags


def run_pretrain(layout: str, steps: int, extra: list[str], log_dir: str) -> dict:
    """``megapipe pretrain`` in ``layout`` for ``steps`` steps; its per-step training losses."""
    from megapipe.errors import MegapipeError

    world, flags = pretrain_flags(layout)
    cmd = [sys.executable, "-m", "megapipe.cli", "pretrain", "--nproc-per-node", str(world), *flags,
           "--train-iters", str(steps), "--log-interval", "1", "--log-dir", log_dir, "--quiet", *extra]
    proc = subprocess.run(cmd, env={**os.environ}, capture_output=True, text=True)
    metrics = Path(log_dir) / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise MegapipeError(f"megapipe pretrain in layout {layout!r} failed (exit {proc.returncode}):\n{tail}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = sorted((r["step"], r["loss"]) for r in records if r["kind"] == "train")
    return {"layout": layout, "losses": [loss for _, loss in train]}


def main(argv=None) -> int:
    from layout_run import launch_layout

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layout_a")
    p.add_argument("layout_b")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tol", type=float, default=1e-5, help="largest allowed relative difference")
    p.add_argument("--pretrain", action="store_true", help="run each layout through 'megapipe pretrain'")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.pretrain:
            runs = [run_pretrain(lay, args.steps, extra, str(Path(tmp) / f"run{i}"))
                    for i, lay in enumerate((args.layout_a, args.layout_b))]
        else:
            runs = [launch_layout(lay, ["--steps", str(args.steps), *extra], str(Path(tmp) / f"{i}.json"))
                    for i, lay in enumerate((args.layout_a, args.layout_b))]
    a, b = runs
    print(f"{'step':>4}  {args.layout_a:>14}  {args.layout_b:>14}  {'abs diff':>10}  {'rel diff':>10}")
    worst = 0.0
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)):
        rel = abs(x - y) / max(abs(x), 1e-12)
        worst = max(worst, rel)
        print(f"{i + 1:>4}  {x:>14.8f}  {y:>14.8f}  {abs(x - y):>10.2e}  {rel:>10.2e}")
    verdict = "OK" if worst <= args.tol else "DIFFERENT"
    print(f"max relative difference {worst:.2e} (tolerance {args.tol:.0e}): {verdict}")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
