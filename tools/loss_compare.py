"""Run two parallel layouts on the same model, seed and global batches and print their per-step losses.

    .venv/bin/python tools/loss_compare.py tp2,pp2 dp_shard4 --steps 5
    .venv/bin/python tools/loss_compare.py single cp2 --steps 3 -- --model tiny --seq-length 256 --optimizer adamw

Arguments after ``--`` go to every run (see ``python -m megapipe.parallel.layout_run --help``). Exit code 1 when
a relative difference exceeds --tol (default 1e-5: fp32 layouts differ only in summation order; with SGD the
first steps agree to ~1e-7; AdamW amplifies round-off of tiny gradients, allow ~1e-4 after a few steps).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    from megapipe.parallel.layout_run import launch_layout

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description="Per-step loss differences between two parallel layouts.")
    p.add_argument("layout_a")
    p.add_argument("layout_b")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tol", type=float, default=1e-5, help="largest allowed relative difference")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
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
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
