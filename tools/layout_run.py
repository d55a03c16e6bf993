"""Train a few steps in one layout through the one training loop (megapipe.training.Trainer) and write per-step
losses and times (for tools/loss_compare.py and tools/bench_parallel.py). Launched under torchrun for layouts of
more than one process:
    python tools/layout_run.py --layout tp2,pp2 --steps 5 --out r.json [--model tiny ...]
Batches are the same in every layout: deterministic random tokens (--seed), or consecutive windows of a
tokenized .bin/.idx prefix (--data PREFIX). Constant learning rate, no warm-up, no eval, no checkpoints.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megapipe.config import Config, ModelConfig, ParallelConfig, resolve_preset
from megapipe.parallel.dims import apply_layout, parse_layout
from megapipe.training.recipes import Recipe


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", default="single")
    p.add_argument("--schedule", default=None, help="pipeline schedule (GPipe, 1F1B, Interleaved1F1B, ...)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=0, help="steps left out of the timing (compile, caches)")
    p.add_argument("--model", default="tiny", help="preset name")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", default=None, help="tokenized .bin/.idx prefix (default: random tokens)")
    p.add_argument("--out", required=True)
    return p


def make_config(args) -> Config:
    model = {**resolve_preset(args.model), "vocab_size": args.vocab_size}
    if args.num_layers:
        model["num_layers"] = args.num_layers
    cfg = Config(model=ModelConfig(**model))
    cfg.parallel = apply_layout(ParallelConfig(), parse_layout(args.layout), args.schedule)
    t = cfg.train
    t.global_batch_size, t.micro_batch_size, t.seed = args.global_batch_size, args.micro_batch_size, args.seed
    t.precision, t.recompute, t.compile = args.precision, args.recompute, args.compile
    t.train_iters, t.lr, t.lr_decay_style, t.eval_iters = args.steps + args.warmup, args.lr, "constant", 0
    cfg.optim.optimizer, cfg.optim.clip_grad, cfg.optim.weight_decay = args.optimizer, args.clip_grad, 0.0
    cfg.data.seq_length = args.seq_length
    return cfg


def batches(args, vocab: int, steps: int) -> torch.Tensor:
    """[steps * global_batch, seq + 1] token ids, identical in every layout."""
    n, s = steps * args.global_batch_size, args.seq_length + 1
    if args.data is None:
        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab, (n, s), generator=g)
    from megapipe.data.indexed import IndexedDataset

    ds = IndexedDataset(args.data)
    flat, i = [], 0
    while sum(len(x) for x in flat) < n * s:
        flat.append(torch.from_numpy(ds[i % len(ds)].astype("int64")))
        i += 1
    return torch.cat(flat)[: n * s].view(n, s).clamp_(max=vocab - 1)


class FixedSamples(Recipe):
    """Pretraining on a fixed array of samples, read in order (the same global batches in every layout)."""

    stage = "layout_run"

    def __init__(self, samples: torch.Tensor):
        self.samples = samples.numpy()

    def train_data(self, ctx, model, state):
        from megapipe.data.loader import PretrainingLoader

        t = ctx.cfg.train
        return PretrainingLoader(self.samples, t.micro_batch_size, t.global_batch_size, ctx.dims.dp_rank,
                                 ctx.dims.dp_size)


def main(argv=None) -> None:
    from megapipe.parallel.distributed import destroy_distributed, get_rank
    from megapipe.training.trainer import Trainer

    args = build_parser().parse_args(argv)
    cfg = make_config(args)
    recipe = FixedSamples(batches(args, cfg.model.vocab_size, args.steps + args.warmup))
    trainer = Trainer(cfg, recipe, quiet=True)
    it = iter(trainer.train_data)
    losses, times = [], []
    for step in range(args.steps + args.warmup):
        microbatches = trainer.next_microbatches(it)
        t0 = time.perf_counter()
        value = trainer.train_step(microbatches)["loss"]  # .item() inside: also waits for the device
        if step >= args.warmup:
            losses.append(value)
            times.append(time.perf_counter() - t0)
    if get_rank() == 0:
        tokens = args.global_batch_size * args.seq_length
        with open(args.out, "w") as f:
            json.dump({"layout": trainer.dims.describe(), "world_size": trainer.dist.world_size, "losses": losses,
                       "step_times": times, "tokens_per_step": tokens}, f)
    destroy_distributed()


def launch_layout(layout: str, extra: list[str], out: str, timeout: float | None = None) -> dict:
    """Run this script for ``layout`` (under torchrun when it needs several processes) and return its results."""
    import os
    import subprocess
    import sys

    from megapipe.errors import MegapipeError
    from megapipe.parallel.dims import layout_world_size

    world = layout_world_size(parse_layout(layout))
    cmd = [sys.executable]
    if world > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    cmd += [os.path.abspath(__file__), "--layout", layout, "--out", out, *extra]
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not os.path.isfile(out):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise MegapipeError(f"layout {layout!r} failed (exit {proc.returncode}):\n{tail}")
    with open(out) as f:
        return json.load(f)


if __name__ == "__main__":
    main()
