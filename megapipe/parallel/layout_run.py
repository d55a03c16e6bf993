"""Train a few steps in one layout and write per-step losses and times (for tools/loss_compare.py and
tools/bench_parallel.py). Launched under torchrun for layouts of more than one process:
    python -m megapipe.parallel.layout_run --layout tp2,pp2 --steps 5 --out r.json [--model tiny ...]
Batches are the same in every layout: deterministic random tokens (--seed), or consecutive windows of a
tokenized .bin/.idx prefix (--data PREFIX).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megapipe.config import Config, ModelConfig, ParallelConfig, resolve_preset
from megapipe.parallel.dims import ParallelDims, apply_layout, parse_layout


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
    cfg.data.seq_length = args.seq_length
    return cfg


def batches(args, vocab: int, steps: int) -> torch.Tensor:
    """[steps, global_batch, seq + 1] token ids, identical in every layout."""
    n, s = steps * args.global_batch_size, args.seq_length + 1
    if args.data is None:
        g = torch.Generator().manual_seed(args.seed)
        return torch.randint(0, vocab, (steps, args.global_batch_size, s), generator=g)
    from megapipe.data.indexed import IndexedDataset

    ds = IndexedDataset(args.data)
    flat, i = [], 0
    while sum(len(x) for x in flat) < n * s:
        flat.append(torch.from_numpy(ds[i % len(ds)].astype("int64")))
        i += 1
    return torch.cat(flat)[: n * s].view(steps, args.global_batch_size, s).clamp_(max=vocab - 1)


def main(argv=None) -> None:
    from megapipe.models import build_model
    from megapipe.parallel.distributed import destroy_distributed, get_rank, init_distributed
    from megapipe.parallel.parallelize import parallelize_model
    from megapipe.parallel.step import clip_grad_norm_, train_step

    args = build_parser().parse_args(argv)
    cfg = make_config(args)
    info = init_distributed(cfg)
    dims = ParallelDims.from_config(cfg.parallel, info.world_size, cfg.train, cfg.model, args.seq_length)
    dims.build_mesh(info.device.split(":")[0])
    model = parallelize_model(build_model(cfg.model, device=info.device, seed=args.seed), dims, cfg)
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    data = batches(args, cfg.model.vocab_size, args.steps + args.warmup)
    per_rank = args.global_batch_size // dims.dp_size
    lo = dims.dp_rank * per_rank
    context = None
    if args.precision == "bf16" and not dims.fsdp_enabled:
        def context():
            return torch.autocast(info.device.split(":")[0], dtype=torch.bfloat16)
    losses, times = [], []
    for step in range(args.steps + args.warmup):
        local = data[step, lo: lo + per_rank].to(info.device)
        mbs = [{"tokens": c[:, :-1], "labels": c[:, 1:]} for c in local.split(args.micro_batch_size)]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, mbs, dims, context=context)
        clip_grad_norm_(model, args.clip_grad, dims)
        opt.step()
        value = loss.item()  # also waits for the device
        if step >= args.warmup:
            losses.append(value)
            times.append(time.perf_counter() - t0)
    if get_rank() == 0:
        tokens = args.global_batch_size * args.seq_length
        with open(args.out, "w") as f:
            json.dump({"layout": dims.describe(), "world_size": info.world_size, "losses": losses,
                       "step_times": times, "tokens_per_step": tokens}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()


def launch_layout(layout: str, extra: list[str], out: str, timeout: float | None = None) -> dict:
    """Run this module for ``layout`` (under torchrun when it needs several processes) and return its results."""
    import os
    import subprocess
    import sys

    from megapipe.errors import MegapipeError
    from megapipe.parallel.dims import layout_world_size

    world = layout_world_size(parse_layout(layout))
    cmd = [sys.executable, "-m"]
    if world > 1:
        cmd += ["torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "-m"]
    cmd += ["megapipe.parallel.layout_run", "--layout", layout, "--out", out, *extra]
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not os.path.isfile(out):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise MegapipeError(f"layout {layout!r} failed (exit {proc.returncode}):\n{tail}")
    with open(out) as f:
        return json.load(f)
