"""Hybrid Transformer-Mamba benchmark (Nemotron-H shape): megapipe's training step vs transformers'
``NemotronHForCausalLM``, and prefill time as the prompt grows, the hybrid against an all-attention model.

``train``: the ``nemotron-h-tiny`` preset's shape (h256, pattern M*-M-M*M: 4 Mamba-2, 2 attention, 2 MLP layers;
16 Mamba heads of 32 in 2 groups, state 32, chunk 16), vocab 8192, batch 8 x 256, fp32, the same AdamW
(torch's fused kernel), the same random batch, the same number of threads. ``megapipe`` = the Trainer's step
(fused output + cross-entropy); ``hf`` = ``NemotronHForCausalLM`` built from a ``NemotronHConfig`` of the same
widths and pattern (its CPU path: the torch reference scan, SDPA attention) + ``F.cross_entropy``, built from the config
megapipe's exporter writes and holding the megapipe Trainer's initial weights (megapipe's Nemotron-H bridge), so the
step-0 losses agree (printed). megapipe's Trainer keeps freed memory in the process on CPU
(megapipe.training.cpu_memory); --hf-keep-freed-memory gives HF the same allocator setting, to compare the kernels
alone.

``prefill``: megapipe's whole-sequence forward in inference mode (batch 1, logits of the last position, as an
engine's prefill) at prompt lengths 512 -> 8k, for the hybrid and for the same model with every Mamba layer
replaced by attention (``--attention-pattern``, default **-*-*** : same width, depth and MLPs). Hooks time each
layer kind; the Mamba layers' time per token must stay flat as the prompt grows (the SSD scan is linear in length)
while attention's grows.

Decode (tokens/s at batch 8 vs transformers' ``generate``) is not measured here: tools/bench_generate.py does that
for any model directory the HF bridge imports, Nemotron-H included.

Every case runs in its own process; the cases take turns for --rounds rounds and the summary gives medians and
the range of the per-round ratios, so a slow spell of a shared machine hits all of them alike. Nothing here
asserts a speed. On a machine whose cores are all busy with other work, use ``--threads 1``: with more threads than
free cores, OpenMP's barriers between the many small ops of a step measure the machine's load, not the kernels.

    .venv/bin/python tools/bench_hybrid.py                               # train + prefill, 3 rounds
    .venv/bin/python tools/bench_hybrid.py --sections train --rounds 5
    .venv/bin/python tools/bench_hybrid.py --sections prefill --lengths 512,1024,2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench_steps import peak_rss_mb, run_worker, speed_ratio, summarize, time_steps

ROOT = Path(__file__).resolve().parents[1]
PRESET = "nemotron-h-tiny"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="train,prefill")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed training steps per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--impls", default="hf,megapipe", help="training-step implementations")
    p.add_argument("--lengths", default="512,1024,2048,4096,8192", help="prefill prompt lengths")
    p.add_argument("--prefill-reps", type=int, default=2, help="timed forwards per length per round")
    p.add_argument("--attention-pattern", default=None,
                   help="the all-attention model's layer pattern (default: the preset's with M -> *)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hf-keep-freed-memory", action="store_true",
                   help="give HF megapipe's CPU allocator setting too (megapipe.training.cpu_memory), to compare "
                        "the kernels alone")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", nargs=2, metavar=("SECTION", "CASE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_fields(a, pattern: str | None = None) -> dict:
    from megapipe.presets import PRESETS

    fields = {**PRESETS[PRESET], "vocab_size": a.vocab, "max_position_embeddings": max(a.seq, *_lengths(a))}
    if pattern is not None:
        fields["hybrid_override_pattern"] = pattern
    return fields


def _lengths(a) -> list[int]:
    return [int(n) for n in a.lengths.split(",")]


def _batch(a):
    import torch

    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


# ------------------------------------------------------------------------------------------------ training step

def megapipe_step(a):
    from megapipe.config import Config, ModelConfig, OptimConfig, TrainConfig
    from megapipe.training.trainer import Trainer

    cfg = Config(
        model=ModelConfig(**model_fields(a)),
        train=TrainConfig(micro_batch_size=a.batch, global_batch_size=a.batch, train_iters=a.steps + a.warmup,
                          lr=1e-4, lr_decay_style="constant", precision="fp32"),
        optim=OptimConfig(weight_decay=0.01, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8),
    )
    cfg.data.seq_length = a.seq
    trainer = Trainer(cfg, quiet=True, with_data=False)
    batch = _batch(a)
    return lambda: trainer.train_step([batch])["loss"]


def hf_step(a):
    """transformers' NemotronHForCausalLM at the config megapipe's exporter writes, holding the megapipe Trainer's
    initial weights (converted by megapipe's Nemotron-H bridge), so both sides start from the same loss."""
    import torch
    import torch.nn.functional as F
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from megapipe.checkpoint.hf import adapter_for_arch
    from megapipe.config import ModelConfig

    cfg = ModelConfig(**model_fields(a))
    adapter = adapter_for_arch(cfg.arch)
    state = megapipe_model_state(a)
    hf_state = {}
    for conversion in adapter.conversions(cfg):
        tensors = conversion.to_hf([state[name] for name in conversion.mp])
        hf_state.update({name.replace("backbone.", "model.", 1): t for name, t in zip(conversion.hf, tensors, strict=True)})
    config = NemotronHConfig(**adapter.hf_config(cfg), architectures=[adapter.architecture])
    model = NemotronHForCausalLM(config).float()
    model.load_state_dict(hf_state, strict=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True)
    batch = _batch(a)

    def step():
        logits = model(input_ids=batch["tokens"], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def megapipe_model_state(a) -> dict:
    """The megapipe Trainer's initial weights (its build_model and seed; not the Trainer itself, whose CPU allocator
    setting would then speed up the HF side too, see --hf-keep-freed-memory)."""
    from megapipe.config import ModelConfig, TrainConfig
    from megapipe.models import build_model

    model = build_model(ModelConfig(**model_fields(a)), seed=TrainConfig().seed)
    return {k: v.detach() for k, v in model.state_dict().items()}


def train_worker(a, impl: str) -> dict:
    if impl == "hf" and a.hf_keep_freed_memory:
        from megapipe.training.cpu_memory import keep_freed_memory

        keep_freed_memory()
    step = hf_step(a) if impl == "hf" else megapipe_step(a)
    return time_steps(step, a.warmup, a.steps)


# ------------------------------------------------------------------------------------------------ prefill

def _kind_timers(model) -> dict:
    """Forward hooks that add each block's wall time to its kind's total (CPU ops are synchronous)."""
    totals: dict = {}
    for block in model.layers.values():
        kind = type(block).__name__
        totals.setdefault(kind, 0.0)
        starts = []
        block.register_forward_pre_hook(lambda mod, args, s=starts: s.append(time.perf_counter()))

        def done(mod, args, out, s=starts, k=kind):
            totals[k] += time.perf_counter() - s.pop()

        block.register_forward_hook(done)
    return totals


def prefill_worker(a, case: str) -> dict:
    import torch

    from megapipe.config import ModelConfig
    from megapipe.models import build_model

    pattern = None
    if case == "attention":
        pattern = a.attention_pattern or model_fields(a)["hybrid_override_pattern"].replace("M", "*")
    cfg = ModelConfig(**model_fields(a, pattern))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    totals = _kind_timers(model)
    gen = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        model(torch.randint(0, a.vocab, (1, 256), generator=gen), last_only=True)  # warm-up
        for n in _lengths(a):
            tokens = torch.randint(0, a.vocab, (1, n), generator=gen)
            runs = []
            for _ in range(a.prefill_reps):
                for k in totals:
                    totals[k] = 0.0
                t0 = time.perf_counter()
                model(tokens, last_only=True)
                runs.append({"total": time.perf_counter() - t0, **totals})
            out[str(n)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"lengths": out, "pattern": cfg.hybrid_override_pattern, "peak_rss_mb": peak_rss_mb()}


# ------------------------------------------------------------------------------------------------ driver

def worker(a) -> None:
    import torch

    section, case = a.worker
    torch.set_num_threads(a.threads)
    result = train_worker(a, case) if section == "train" else prefill_worker(a, case)
    print(json.dumps(result))


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min) / {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def report_train(a, runs: dict) -> None:
    kept = ", HF with megapipe's allocator setting" if a.hf_keep_freed_memory else ""
    print(f"\ntraining step: {PRESET} (vocab {a.vocab}), batch {a.batch} x {a.seq}, fp32, fused AdamW{kept}, {a.threads} "
          f"threads; median over {a.rounds} rounds x {a.steps} steps; {_load()}")
    summary = {}
    for impl, rs in runs.items():
        s = summary[impl] = summarize(rs)
        print(f"{impl:10s} {a.batch * a.seq / s['step']:7.0f} tok/s  step {s['step']:.3f}s  CPU {s['cpu']:.3f}s  "
              f"peak RSS {s['peak']:.0f} MB  loss {rs[0]['first_loss']:.5f}->{rs[0]['last_loss']:.5f}")
    ours, hf = summary.get("megapipe"), summary.get("hf")
    if ours and hf:
        print(f"megapipe / HF NemotronH: {speed_ratio(ours, hf, 'target >= 1.5x')}")


def report_prefill(a, runs: dict) -> None:
    hybrid, attention = runs["hybrid"], runs["attention"]
    print(f"\nprefill (whole-prompt forward, inference mode, batch 1, last-position logits): hybrid "
          f"{hybrid[0]['pattern']} vs all-attention {attention[0]['pattern']}, h256, {a.threads} threads; median "
          f"over {a.rounds} rounds x {a.prefill_reps} forwards; {_load()}")
    print(f"{'tokens':>6s} {'hybrid s':>9s} {'attn-only s':>11s} {'attn/hyb':>8s} {'Mamba share':>11s} "
          f"{'Mamba us/tok':>12s} {'attn us/tok (hybrid)':>20s}")
    def med(rs, n, key):
        return statistics.median(r["lengths"][str(n)].get(key, 0.0) for r in rs)

    for n in _lengths(a):
        ratios = sorted(at["lengths"][str(n)]["total"] / hy["lengths"][str(n)]["total"]
                        for hy, at in zip(hybrid, attention, strict=True))
        total, mamba, attn = (med(hybrid, n, k) for k in ("total", "MambaBlock", "AttentionBlock"))
        print(f"{n:6d} {total:9.3f} {med(attention, n, 'total'):11.3f} {statistics.median(ratios):7.2f}x "
              f"{mamba / total:10.0%} {mamba / n * 1e6:12.1f} {attn / n * 1e6:20.1f}")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    passthrough = list(argv if argv is not None else sys.argv[1:])
    sections = a.sections.split(",")
    cases = [("train", impl) for impl in a.impls.split(",")] if "train" in sections else []
    cases += [("prefill", m) for m in ("hybrid", "attention")] if "prefill" in sections else []
    runs: dict = {c: [] for c in cases}
    print(_load())
    for rnd in range(a.rounds):
        for section, case in cases:
            r = run_worker(__file__, passthrough, section, case)
            if r is None:
                return 1
            runs[section, case].append(r)
            if section == "train":
                detail = f"step {statistics.median(r['walls']):.3f}s  loss {r['first_loss']:.5f}->{r['last_loss']:.5f}"
            else:
                detail = "  ".join(f"{n}: {v['total']:.3f}s" for n, v in r["lengths"].items())
            print(f"round {rnd + 1}  {section:7s} {case:10s} {detail}", flush=True)
    if "train" in sections:
        report_train(a, {impl: runs["train", impl] for impl in a.impls.split(",")})
    if "prefill" in sections:
        report_prefill(a, {m: runs["prefill", m] for m in ("hybrid", "attention")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
