"""Step time per token of each parallel layout against the single-process run measured in the same invocation.

    .venv/bin/python tools/bench_parallel.py                       # single, dp_shard2, ddp2, tp2, pp2, cp2
    .venv/bin/python tools/bench_parallel.py single tp2,pp2 --steps 6 -- --model tiny --seq-length 256

On a CPU host every process shares the same cores, so ratios mostly show each layout's communication and
scheduling overhead; on GPUs (one process per device) they show scaling. Arguments after ``--`` go to every run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

DEFAULT = ["single", "dp_shard2", "ddp2", "tp2", "pp2", "cp2"]


def main(argv=None) -> int:
    from layout_run import launch_layout

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description="Per-token step time of parallel layouts vs one process.")
    p.add_argument("layouts", nargs="*", default=DEFAULT)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    layouts = args.layouts if "single" in args.layouts else ["single", *args.layouts]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, lay in enumerate(layouts):
            r = launch_layout(lay, ["--steps", str(args.steps), "--warmup", str(args.warmup), *extra],
                              str(Path(tmp) / f"{i}.json"))
            per_token = statistics.median(r["step_times"]) / r["tokens_per_step"]
            rows.append((lay, r["world_size"], per_token, r["losses"][-1]))
    base = rows[0][2]
    print(f"{'layout':<16} {'procs':>5} {'ms/1k tok':>10} {'tok/s':>9} {'vs single':>10} {'last loss':>10}")
    for lay, world, per_token, loss in rows:
        print(f"{lay:<16} {world:>5} {per_token * 1e6:>10.2f} {1 / per_token:>9.0f} {base / per_token:>9.2f}x "
              f"{loss:>10.4f}")
    print("(median step time after warm-up; 'vs single' > 1 means faster than one process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
