"""Optimizer benchmark: the same small Llama trained with AdamW and with Muon (--optimizer muon) at the same token
budget, and the time of one optimizer step of each, in one process and under FSDP over 2 processes.

Data: the first --max-docs paragraphs of the Shakespeare corpus, tokenized as tools/bench_distill.py prepares them
(a byte-level BPE of --vocab tokens, split 969,30,1). Both runs: ``megapipe pretrain --model tiny`` (Llama h256 x 4
layers), the same initialisation, batches, lr schedule (--lr, warmup, cosine), weight decay and clipping; Muon takes
AdamW's lr and weight decay unchanged (Moonlight's update scale, the default). Held-out loss: the trainer's final
evaluation (--eval-iters batches of the valid split). Optimizer-step time: ``optimizer.step()`` alone on random
gradients, median of --step-reps, in this process (dp1) and in a torchrun launch of 2 processes with FSDP
(dp_shard2, gloo: Muon gathers each matrix's shards for Newton-Schulz).

    .venv/bin/python tools/bench_optim.py                      # 400 steps each
    .venv/bin/python tools/bench_optim.py --steps 150 --no-fsdp
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
OPTIMIZERS = ("adamw", "muon")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(Path.home() / ".cache/megapipe/bench_optim"))
    p.add_argument("--max-docs", type=int, default=30000)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-iters", type=int, default=16, help="held-out batches of --batch x --seq tokens")
    p.add_argument("--step-reps", type=int, default=10, help="timed optimizer steps per case")
    p.add_argument("--no-fsdp", action="store_true", help="skip the 2-process FSDP timing")
    p.add_argument("--fsdp-worker", metavar="OUT", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def train(a, prefix: str, tok: Path, optimizer: str) -> dict:
    """One ``megapipe pretrain`` run; its final held-out loss and wall time."""
    from megapipe.cli import main as megapipe

    run = Path(a.work) / f"run_{optimizer}"
    import shutil

    shutil.rmtree(run, ignore_errors=True)
    started = time.perf_counter()
    assert megapipe([
        "pretrain", "--model", "tiny", "--data-path", prefix, "--tokenizer", str(tok), "--seq-length", str(a.seq),
        "--micro-batch-size", str(a.batch), "--global-batch-size", str(a.batch), "--train-iters", str(a.steps),
        "--lr", str(a.lr), "--min-lr", str(a.lr / 10), "--lr-warmup-iters", str(max(1, a.steps // 20)),
        "--weight-decay", str(a.weight_decay), "--optimizer", optimizer, "--eval-iters", str(a.eval_iters),
        "--eval-interval", "0", "--log-interval", "50", "--save", str(run), "--quiet",
    ]) == 0
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["kind"] == "valid"]
    last_train = [r for r in records if r["kind"] == "train"][-1]
    return {"valid_loss": valid[-1]["loss"], "train_loss": last_train["loss"], "seconds": seconds}


def tiny_config(a, optimizer: str, dp_shard: int = 1):
    from megapipe.config import Config, ModelConfig, OptimConfig, ParallelConfig, resolve_preset

    cfg = Config(model=ModelConfig(**{**resolve_preset("tiny"), "vocab_size": a.vocab}),
                 optim=OptimConfig(optimizer=optimizer, weight_decay=a.weight_decay),
                 parallel=ParallelConfig(dp_shard=dp_shard))
    cfg.data.seq_length = a.seq
    return cfg


def time_steps(model, optim_cfg, reps: int) -> float:
    """Median seconds of ``optimizer.step()`` on random gradients (two untimed steps first: state allocation)."""
    import torch

    from megapipe.training.optim import build_optimizer

    opt = build_optimizer(model, optim_cfg, 1e-3)
    times = []
    for i in range(reps + 2):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        t0 = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_times_dp1(a) -> dict:
    from megapipe.models import build_model

    out = {}
    for name in OPTIMIZERS:
        cfg = tiny_config(a, name)
        out[name] = time_steps(build_model(cfg.model, seed=0), cfg.optim, a.step_reps)
    return out


def fsdp_worker(a) -> None:
    """One rank of the dp_shard2 timing (under torchrun)."""
    import torch.distributed as dist

    from megapipe.models import build_model
    from megapipe.parallel.dims import ParallelDims
    from megapipe.parallel.parallelize import parallelize_model

    dist.init_process_group("gloo")
    out = {}
    for name in OPTIMIZERS:
        cfg = tiny_config(a, name, dp_shard=dist.get_world_size())
        dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size(), cfg.train, cfg.model, a.seq)
        dims.build_mesh("cpu")
        model = parallelize_model(build_model(cfg.model, seed=0), dims, cfg)
        out[name] = time_steps(model, cfg.optim, a.step_reps)
    if dist.get_rank() == 0:
        Path(a.fsdp_worker).write_text(json.dumps(out))
    dist.destroy_process_group()


def step_times_fsdp2(a) -> dict:
    out = Path(a.work) / "fsdp2_times.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--fsdp-worker", str(out), "--vocab", str(a.vocab), "--seq", str(a.seq), "--step-reps", str(a.step_reps),
           "--weight-decay", str(a.weight_decay)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the FSDP timing launch failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.fsdp_worker:
        fsdp_worker(a)
        return 0
    from bench_distill import prepare_data

    work = Path(a.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    a.work = str(work)
    load_before = os.getloadavg()[0]
    prefix, tok = prepare_data(work, a.max_docs, a.vocab)
    runs = {name: train(a, prefix, tok, name) for name in OPTIMIZERS}
    times = {"dp1": step_times_dp1(a)}
    if not a.no_fsdp:
        times["fsdp_dp2"] = step_times_fsdp2(a)
    tokens = a.steps * a.batch * a.seq
    print(f"tiny Llama (h256 x 4, vocab {a.vocab}), {a.steps} steps x {a.batch} x {a.seq} = {tokens:,} tokens, "
          f"lr {a.lr:g} (cosine to {a.lr / 10:g}), weight decay {a.weight_decay:g}; load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'optimizer':>9} {'held-out loss':>13} {'train loss':>10} {'run s':>7} "
          + " ".join(f"{'step ms ' + k:>16}" for k in times))
    for name in OPTIMIZERS:
        r = runs[name]
        print(f"{name:>9} {r['valid_loss']:>13.4f} {r['train_loss']:>10.4f} {r['seconds']:>7.1f} "
              + " ".join(f"{1e3 * times[k][name]:>16.1f}" for k in times))
    print(json.dumps({"tokens": tokens, "runs": runs, "optimizer_step_s": times,
                      "load_average": [load_before, os.getloadavg()[0]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
