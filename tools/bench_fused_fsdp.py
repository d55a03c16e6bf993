"""The fused output projection + cross-entropy under FSDP: step time and peak memory against the logits path, on
the same 2-process FSDP2 layout (gloo, CPU), the same model, batch and AdamW.

Under FSDP the output weight is a shard outside the model's forward, so the Trainer runs the loss inside the
forward (``Transformer.forward(head=...)``, megapipe.parallel.step.run_loss), where FSDP holds the whole weight; the
logits path materialises [tokens, vocab] fp32 logits plus their log-softmax and gradient instead. Each variant runs
in its own torchrun launch; peak = the largest max-RSS over the ranks; --rounds alternate the two.

    .venv/bin/python tools/bench_fused_fsdp.py                  # Llama h256 x 6, vocab 49152, 2 x (4 x 256) tokens
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--batch", type=int, default=4, help="rows per rank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worker", choices=["fused", "logits"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from megapipe.config import Config, ModelConfig, TrainConfig
    from megapipe.models.objective import TokenCrossEntropy
    from megapipe.training.recipes import PretrainRecipe
    from megapipe.training.trainer import Trainer

    torch.set_num_threads(1)

    class Logits(TokenCrossEntropy):
        fusable = False

    class Recipe(PretrainRecipe):
        def loss(self):
            return TokenCrossEntropy() if a.worker == "fused" else Logits()

    n = int(os.environ["WORLD_SIZE"])
    cfg = Config(model=ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=688,
                                   num_layers=a.layers, num_heads=8, max_position_embeddings=a.seq,
                                   tie_embeddings=False),
                 train=TrainConfig(micro_batch_size=a.batch, global_batch_size=a.batch * n,
                                   train_iters=a.steps + a.warmup, lr=1e-4, lr_decay_style="constant"))
    cfg.data.seq_length = a.seq
    trainer = Trainer(cfg, Recipe(), quiet=True, with_data=False)
    assert trainer.fused_loss == (a.worker == "fused") and trainer.dims.dp_shard == n
    g = torch.Generator().manual_seed(trainer.dims.dp_rank)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    losses = [trainer.train_step([batch])["loss"] for _ in range(a.warmup)]
    walls = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(trainer.train_step([batch])["loss"])
        walls.append(time.perf_counter() - t0)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps({"walls": walls, "peak_mb": peak.item(), "losses": losses}))
    dist.destroy_process_group()


def launch(a, passthrough, variant: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
               __file__, *passthrough, "--worker", variant, "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    passthrough = list(argv if argv is not None else sys.argv[1:])
    runs: dict = {"logits": [], "fused": []}
    for rnd in range(a.rounds):
        for variant in runs:
            r = launch(a, passthrough, variant)
            runs[variant].append(r)
            print(f"round {rnd + 1}  {variant:6s} step {statistics.median(r['walls']):.3f}s  peak RSS "
                  f"{r['peak_mb']:.0f} MB  loss {r['losses'][0]:.4f}->{r['losses'][-1]:.4f}", flush=True)
    step = {v: statistics.median(w for r in rs for w in r["walls"]) for v, rs in runs.items()}
    peak = {v: statistics.median(r["peak_mb"] for r in rs) for v, rs in runs.items()}
    same = all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(runs["fused"][0]["losses"], runs["logits"][0]["losses"],
                                                               strict=True))
    print(f"\nFSDP dp_shard{a.nproc}, Llama h{a.hidden} x {a.layers}, vocab {a.vocab}, {a.batch} x {a.seq} tokens per "
          f"rank, fp32 AdamW: fused / logits: speed {step['logits'] / step['fused']:.2f}x, peak memory "
          f"{peak['fused'] / peak['logits']:.2f}x ({peak['fused']:.0f} vs {peak['logits']:.0f} MB); losses equal "
          f"(1e-5): {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
