"""Training-step benchmark: megapipe's Trainer step vs Hugging Face ``LlamaForCausalLM`` on the same config.

Same shapes (default: Llama h256 x 6 layers, vocab 49152, batch 8 x 256, as in PROBES.md), same AdamW
hyper-parameters and kernel (torch's fused AdamW, which megapipe and HF's Trainer use; --hf-adamw foreach gives HF
a plain ``torch.optim.AdamW``), same precision, same random batch; eager and torch.compile. Every case runs in its
own process so its peak memory (max RSS) is its own, and the cases take turns for --rounds rounds, so a slow spell
of a shared machine hits all of them alike; the summary gives the median step time over all rounds, the range of
the per-round ratios, and the ratio of CPU seconds per step. Both sides run with the same number of threads
(--threads). megapipe's Trainer keeps freed memory in the process on CPU (megapipe.training.cpu_memory);
--hf-keep-freed-memory gives the HF baseline the same allocator setting, to compare the kernels alone.

Implementations: ``hf`` = ``LlamaForCausalLM(input_ids).logits`` + ``F.cross_entropy`` (the usual user code; HF's
default attention), ``megapipe`` = the Trainer's step (fused chunked output projection + cross-entropy),
``megapipe-unfused`` = the same with the plain logits -> cross-entropy loss. Modes: ``eager``, ``compiled`` (HF:
``torch.compile(model)``; megapipe: ``--compile`` as the Trainer does it, per block), ``compiled-model`` (megapipe
with the whole model under one ``torch.compile``).

    .venv/bin/python tools/bench_train.py                      # eager + compiled, fp32, 3 rounds
    .venv/bin/python tools/bench_train.py --modes eager --precision bf16 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench_steps import peak_rss_mb, run_worker, speed_ratio, summarize, time_steps

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--impls", default="hf,megapipe")
    p.add_argument("--threads", type=int, default=2, help="torch threads in every case")
    p.add_argument("--rounds", type=int, default=3, help="every case this many times, round-robin; medians reported")
    p.add_argument("--hf-adamw", choices=["fused", "foreach"], default="fused",
                   help="HF's AdamW kernel: fused = megapipe's and HF Trainer's default; foreach = a plain "
                        "torch.optim.AdamW(...)")
    p.add_argument("--hf-keep-freed-memory", action="store_true",
                   help="give HF megapipe's CPU allocator setting too (megapipe.training.cpu_memory), to compare "
                        "the kernels alone")
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "MODE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _batch(a):
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def megapipe_step(a, mode: str, fused: bool = True):
    import torch

    from megapipe.config import Config, ModelConfig, OptimConfig, TrainConfig
    from megapipe.training.trainer import Trainer

    cfg = Config(
        model=ModelConfig(
            vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_layers=a.layers,
            num_heads=a.heads, num_kv_heads=a.kv_heads, max_position_embeddings=a.seq, tie_embeddings=False,
        ),
        train=TrainConfig(
            micro_batch_size=a.batch, global_batch_size=a.batch, train_iters=a.steps + a.warmup, lr=1e-4,
            lr_decay_style="constant", precision=a.precision, compile=mode == "compiled",
        ),
        optim=OptimConfig(weight_decay=0.01, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8),
    )
    cfg.data.seq_length = a.seq
    recipe = None
    if not fused:  # the same cross-entropy, declared not fusable: the Trainer keeps the logits path
        from megapipe.models.objective import TokenCrossEntropy
        from megapipe.training.recipes import PretrainRecipe

        class LogitsLoss(TokenCrossEntropy):
            fusable = False

        class Unfused(PretrainRecipe):
            def loss(self):
                return LogitsLoss()

        recipe = Unfused()
    trainer = Trainer(cfg, recipe, quiet=True, with_data=False)
    if mode == "compiled-model":
        trainer.model = torch.compile(trainer.model)
    batch = _batch(a)
    return lambda: trainer.train_step([batch])["loss"]


def hf_step(a, mode: str):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from megapipe.training.precision import autocast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )
    model = LlamaForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                            **{a.hf_adamw: True})
    fwd = torch.compile(model) if mode != "eager" else model
    scaler = torch.amp.GradScaler("cpu") if a.precision == "fp16" else None
    batch = _batch(a)

    def step():
        with autocast(a.precision, "cpu"):
            logits = fwd(input_ids=batch["tokens"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def worker(a) -> None:
    import torch

    impl, mode = a.worker
    torch.set_num_threads(a.threads)
    if impl == "hf" and a.hf_keep_freed_memory:
        from megapipe.training.cpu_memory import keep_freed_memory

        keep_freed_memory()
    start_rss = peak_rss_mb()
    if impl == "hf":
        step = hf_step(a, mode)
    else:
        step = megapipe_step(a, mode, fused=impl == "megapipe")
    print(json.dumps({**time_steps(step, a.warmup, a.steps), "start_rss_mb": start_rss}))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    passthrough = list(argv if argv is not None else sys.argv[1:])
    cases = [(impl, mode) for mode in a.modes.split(",") for impl in a.impls.split(",")]
    runs = {case: [] for case in cases}
    for rnd in range(a.rounds):  # round-robin, so a slow spell of a shared machine hits every case alike
        for impl, mode in cases:
            r = run_worker(__file__, passthrough, impl, mode)
            if r is None:
                return 1
            runs[impl, mode].append(r)
            print(f"round {rnd + 1}  {impl:16s} {mode:14s} step {statistics.median(r['walls']):.3f}s "
                  f"(CPU {statistics.median(r['cpus']):.3f}s)  warmup {r['warmup_s']:.1f}s  "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB  loss {r['first_loss']:.3f}->{r['last_loss']:.3f}", flush=True)
    tokens = a.batch * a.seq
    summary = {}
    print(f"\nmodel h{a.hidden} x {a.layers} layers, vocab {a.vocab}, batch {a.batch} x {a.seq}, {a.precision}, "
          f"AdamW (HF: {a.hf_adamw}{', kept freed memory' if a.hf_keep_freed_memory else ''}), {a.threads} threads; "
          f"median over {a.rounds} rounds x {a.steps} timed steps (after {a.warmup} warm-up steps each)")
    for case, rs in runs.items():
        s = summary[case] = summarize(rs)
        print(f"{case[0]:16s} {case[1]:14s} {tokens / s['step']:7.0f} tok/s  step {s['step']:.3f}s  CPU {s['cpu']:.3f}s  "
              f"peak RSS {s['peak']:.0f} MB")
    for mode in a.modes.split(","):
        hf = summary.get(("hf", mode)) or summary.get(("hf", "compiled"))
        for impl in ("megapipe", "megapipe-unfused"):
            ours = summary.get((impl, mode))
            if not (ours and hf):
                continue
            print(f"{mode:14s} {impl} / HF: {speed_ratio(ours, hf)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
