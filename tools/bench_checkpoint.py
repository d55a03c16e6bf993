"""Checkpoint save / load throughput with and without checksums, against torch.save / torch.load, in one run.

    .venv/bin/python tools/bench_checkpoint.py [--gb 0.54] [--rounds 3] [--dir /tmp]

The state is fp32 weights of about --gb GB (a stack of square matrices, as a model's are). Each round times, in
turn: torch.save + fsync and torch.load (weights_only) of the same state dict (the baseline), megapipe's
save_checkpoint with checksums (XXH3-128 computed while writing; the default) and without, and load_checkpoint with
verification (every file hashed before loading; the default) and without. Loads read from the page cache, as the
baseline's do. Prints the median and best-round GB/s of each and
its ratio to the baseline (the machine is shared and its disk swings: compare ratios within one run), plus the hash's own speed in memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn


def make_model(gb: float) -> nn.Module:
    side = 2048
    n = max(1, round(gb * 1e9 / (side * side * 4)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(n)])


def nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=0.54)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory in /tmp)")
    args = parser.parse_args()

    from megapipe.checkpoint import load_checkpoint, save_checkpoint
    from megapipe.checkpoint.integrity import ALGORITHM, hash_bytes

    model = make_model(args.gb)
    size = nbytes(model)
    other = make_model(args.gb)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt-", dir=args.dir))
    times: dict[str, list[float]] = {k: [] for k in ("torch.save", "save, checksums", "save, no checksums",
                                                     "torch.load", "load, verified", "load, not verified")}
    try:
        for r in range(args.rounds):
            path = root / f"torch-{r}.pt"

            def torch_save(path=path):
                with open(path, "wb") as f:
                    torch.save(model.state_dict(), f)
                    f.flush()
                    os.fsync(f.fileno())

            times["torch.save"].append(timed(torch_save))
            times["torch.load"].append(timed(lambda path=path: other.load_state_dict(torch.load(path, weights_only=True))))
            path.unlink()
            order = ((True, "save, checksums"), (False, "save, no checksums"))
            for checksums, key in order if r % 2 == 0 else order[::-1]:  # the second save waits on the first's
                # write-back: alternate which goes first
                run = root / f"run-{r}-{checksums}"
                times[key].append(timed(lambda: save_checkpoint(run, 1, model, checksums=checksums)))  # noqa: B023
            ckpt = root / f"run-{r}-True"
            loads = (("load, verified", True), ("load, not verified", False))
            for key, verify in loads if r % 2 == 0 else loads[::-1]:
                times[key].append(timed(lambda: load_checkpoint(ckpt, other, load_rng=False, verify=verify)))  # noqa: B023
            for run in root.glob("run-*"):
                shutil.rmtree(run)
        data = os.urandom(256 << 20)
        hash_s = min(timed(lambda: hash_bytes(data)) for _ in range(3))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(),
                                                 strict=True))
    gb = size / 1e9
    print(f"state: {gb:.2f} GB fp32, {args.rounds} rounds, medians; {ALGORITHM} alone: {len(data) / hash_s / 1e9:.1f}"
          " GB/s in memory")
    print(f"  {'':22s} {'median':>16s}   {'best round':>16s}")
    for kind in ("save", "load"):
        base, base_best = statistics.median(times[f"torch.{kind}"]), min(times[f"torch.{kind}"])
        for key in [k for k in times if k.startswith((kind, f"torch.{kind}"))]:
            t, best = statistics.median(times[key]), min(times[key])
            print(f"  {key:22s} {gb / t:5.2f} GB/s {base / t:5.2f}x   {gb / best:5.2f} GB/s {base_best / best:5.2f}x")


if __name__ == "__main__":
    main()
