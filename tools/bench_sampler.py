"""The sampler's cost per step: ``megapipe.inference.sampling.sample`` over a batch of rows of a real-sized
vocabulary for the sampling settings clients send (temperature, top-k, top-p, min-p), against greedy in the same
run; and its truncation (``filter_logits``) over the whole batch against the same truncation one row at a time with
top-p by a sort of each row (``TOP_P_CANDIDATES = ()``), the way it was done before, in the same run.

The logits are model-like: a few strong tokens over a random tail (``--peak``), so a top-p of 0.9 keeps a few
tokens, as it does for a trained model's next-token distribution; ``--peak 0`` makes them flat.

    .venv/bin/python tools/bench_sampler.py                     # under a minute on 2 CPU cores
    .venv/bin/python tools/bench_sampler.py --rows 8 --vocab 151936 --peak 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64, help="sequences sampled per step")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    ap.add_argument("--peak", type=float, default=12.0, help="logit added to the 20 strong tokens (0: flat)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()

    import torch

    from megapipe.inference import sampling
    from megapipe.inference.host_memory import keep_freed_buffers

    torch.set_num_threads(args.threads)
    keep_freed_buffers()  # as the engine's runner does: big freed buffers are reused, not page-faulted in anew
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(args.rows, args.vocab, generator=g)
    logits[:, :20] += torch.linspace(args.peak, args.peak / 2, 20)
    P = sampling.SamplingParams

    def step(params):
        rows = [sampling.SampleRow(params, None, [1], [2]) for _ in range(args.rows)]
        return median_ms(lambda: sampling.sample(logits, rows), args.reps)

    greedy = step(P(temperature=0.0))
    print(f"{args.rows} rows x {args.vocab} vocabulary, {args.threads} threads, median of {args.reps} steps")
    print(f"  {'setting':<22} {'step':>9} {'x greedy':>9} {'truncation':>11} {'row by row':>11}")
    print(f"  {'greedy':<22} {greedy:8.2f}  {1.0:8.1f}")
    x = logits / 0.7
    for name, params in [("temperature 0.7", P(temperature=0.7)), ("0.7, top-k 50", P(temperature=0.7, top_k=50)),
                         ("0.7, top-p 0.9", P(temperature=0.7, top_p=0.9)),
                         ("0.7, min-p 0.05", P(temperature=0.7, min_p=0.05)),
                         ("0.7, top-k 50, top-p 0.9", P(temperature=0.7, top_k=50, top_p=0.9))]:
        ms = step(params)
        line = f"  {name:<22} {ms:8.2f}  {ms / greedy:8.1f}"
        if (params.top_k, params.top_p, params.min_p) != (0, 1.0, 0.0):
            cut = (params.top_k, params.top_p, params.min_p)
            batch = median_ms(lambda cut=cut: sampling.filter_logits(x, *cut), args.reps)
            candidates, sampling.TOP_P_CANDIDATES = sampling.TOP_P_CANDIDATES, ()
            try:
                one_by_one = median_ms(lambda cut=cut: [sampling.filter_logits(row, *cut) for row in x],
                                       max(2, args.reps // 3))
            finally:
                sampling.TOP_P_CANDIDATES = candidates
            line += f"  {batch:9.2f}  {one_by_one:9.2f}  ({one_by_one / batch:.1f}x)"
        print(line)


if __name__ == "__main__":
    main()
