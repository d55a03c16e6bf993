"""The sampler's cost per step: ``megapipe.inference.sampling.sample`` over a batch of rows of a real-sized
vocabulary, for the sampling settings clients send (temperature, top-p, top-k, min-p), against greedy in the same
run; top-p also against finding its set by a sort of every row (``TOP_P_CANDIDATES = ()``, the way it was done
before), in the same run.

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


def step_ms(sampling, logits, params, reps: int) -> float:
    rows = [sampling.SampleRow(params, None, [1], [2]) for _ in range(logits.shape[0])]
    sampling.sample(logits, rows)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sampling.sample(logits, rows)
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

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(args.rows, args.vocab, generator=g)
    logits[:, :20] += torch.linspace(args.peak, args.peak / 2, 20)
    P = sampling.SamplingParams
    greedy = step_ms(sampling, logits, P(temperature=0.0), args.reps)
    print(f"{args.rows} rows x {args.vocab} vocabulary, {args.threads} threads, median of {args.reps} steps")
    print(f"  {'greedy':<26} {greedy:8.2f} ms")
    for name, params in [("temperature 0.7", P(temperature=0.7)), ("0.7, top-k 50", P(temperature=0.7, top_k=50)),
                         ("1.0, min-p 0.05", P(temperature=1.0, min_p=0.05)),
                         ("0.7, top-p 0.9", P(temperature=0.7, top_p=0.9))]:
        ms = step_ms(sampling, logits, params, args.reps)
        print(f"  {name:<26} {ms:8.2f} ms  ({ms / greedy:.1f}x greedy)")
    candidates = sampling.TOP_P_CANDIDATES
    try:
        sampling.TOP_P_CANDIDATES = ()
        sorted_ms = step_ms(sampling, logits, P(temperature=0.7, top_p=0.9), max(2, args.reps // 3))
    finally:
        sampling.TOP_P_CANDIDATES = candidates
    ms = step_ms(sampling, logits, P(temperature=0.7, top_p=0.9), args.reps)
    print(f"  {'0.7, top-p 0.9, row sorts':<26} {sorted_ms:8.2f} ms  ({sorted_ms / ms:.1f}x the candidates' time)")


if __name__ == "__main__":
    main()
