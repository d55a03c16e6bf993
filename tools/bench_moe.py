"""MoE training-step benchmark: megapipe's Trainer step vs Hugging Face Mixtral / Qwen3-MoE / DeepSeek-V3 at the
identical config, and megapipe's grouped GEMM vs its loop over experts.

Same shapes (default: h256 x 4 layers, 8 experts of FFN 512, top-2, vocab 8192, batch 8 x 256), same AdamW
(torch's fused kernel on both sides), same precision, same random batch, same number of threads, no balancing loss
on either side (HF computes its aux loss only with output_router_logits; megapipe with --moe-aux-loss-coeff > 0).
Every case runs in its own process (its peak RSS is its own); cases take turns for --rounds rounds and the summary
gives medians, so a slow spell of a shared machine hits all of them alike; the ratio of CPU seconds per step is
the figure least moved by other processes.

``deepseek_v3`` is the ``deepseek-v3-tiny`` preset's block (multi-latent attention with YaRN, sigmoid group-limited
routing, a shared expert, the first layer dense) at the shapes given; the expert bias is not updated on either side.

Implementations: ``hf`` = ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM`` with transformers' default experts
kernel (``grouped_mm`` where torch has it, as on CPU with torch 2.13) + ``F.cross_entropy``; ``hf-eager`` = the
same with ``experts_implementation="eager"`` (its loop over experts); ``megapipe`` = the Trainer's step (grouped
GEMM, fused output + cross-entropy); ``megapipe-loop`` = the same with ``--no-moe-grouped-gemm``.

    .venv/bin/python tools/bench_moe.py                          # both families, fp32, 3 rounds
    .venv/bin/python tools/bench_moe.py --families mixtral --precision bf16 --rounds 2
    .venv/bin/python tools/bench_moe.py --families deepseek_v3 --experts 16 --topk 4 --expert-ffn 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench_steps import run_worker, speed_ratio, summarize, time_steps

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=704, help="dense layers' FFN (deepseek_v3's first layer)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--families", default="mixtral,qwen3_moe")
    p.add_argument("--impls", default="hf,hf-eager,megapipe,megapipe-loop")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", nargs=2, metavar=("IMPL", "FAMILY"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _batch(a):
    import torch

    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def model_fields(a, family: str) -> dict:
    """The megapipe ModelConfig both sides are built from (the HF side through megapipe's adapter)."""
    fields = dict(arch=family, vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.expert_ffn,
                  num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads, max_position_embeddings=a.seq,
                  norm_eps=1e-6, tie_embeddings=False, num_experts=a.experts, moe_router_topk=a.topk,
                  moe_ffn_hidden_size=a.expert_ffn)
    if family == "qwen3_moe":
        fields.update(qk_norm=True, moe_router_pre_softmax=True, moe_router_norm_topk_prob=True)
    if family == "deepseek_v3":
        from megapipe.presets import PRESETS

        fields.pop("num_kv_heads")  # MLA has no kv heads
        fields = {**PRESETS["deepseek-v3-tiny"], **fields, "intermediate_size": a.intermediate,
                  "moe_shared_expert_intermediate_size": a.expert_ffn,
                  "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
                  "moe_router_bias_update_rate": 0.0}
    return fields


def megapipe_step(a, family: str, grouped: bool):
    from megapipe.config import Config, ModelConfig, OptimConfig, TrainConfig
    from megapipe.training.trainer import Trainer

    cfg = Config(
        model=ModelConfig(**model_fields(a, family), moe_grouped_gemm=grouped),
        train=TrainConfig(micro_batch_size=a.batch, global_batch_size=a.batch, train_iters=a.steps + a.warmup,
                          lr=1e-4, lr_decay_style="constant", precision=a.precision),
        optim=OptimConfig(weight_decay=0.01, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8),
    )
    cfg.data.seq_length = a.seq
    trainer = Trainer(cfg, quiet=True, with_data=False)
    batch = _batch(a)
    return lambda: trainer.train_step([batch])["loss"]


def hf_step(a, family: str, experts: str | None):
    import torch
    import torch.nn.functional as F
    import transformers

    from megapipe.checkpoint.hf import adapter_for_arch
    from megapipe.config import ModelConfig
    from megapipe.training.precision import autocast

    cfg = ModelConfig(**model_fields(a, family))
    adapter = adapter_for_arch(family)
    config = getattr(transformers, type(transformers.AutoConfig.for_model(adapter.model_type)).__name__)(
        **adapter.hf_config(cfg), architectures=[adapter.architecture])
    if experts is not None:
        config._experts_implementation = experts
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True)
    batch = _batch(a)

    def step():
        with autocast(a.precision, "cpu"):
            logits = model(input_ids=batch["tokens"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, model.config._experts_implementation


def worker(a) -> None:
    import torch

    impl, family = a.worker
    torch.set_num_threads(a.threads)
    kernel = "grouped_mm" if impl == "megapipe" else "loop"
    if impl.startswith("hf"):
        step, kernel = hf_step(a, family, "eager" if impl == "hf-eager" else None)
    else:
        step = megapipe_step(a, family, grouped=impl == "megapipe")
    print(json.dumps({**time_steps(step, a.warmup, a.steps), "kernel": kernel}))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    passthrough = list(argv if argv is not None else sys.argv[1:])
    cases = [(impl, fam) for fam in a.families.split(",") for impl in a.impls.split(",")]
    runs: dict = {c: [] for c in cases}
    for rnd in range(a.rounds):
        for impl, fam in cases:
            r = run_worker(__file__, passthrough, impl, fam)
            if r is None:
                return 1
            runs[impl, fam].append(r)
            print(f"round {rnd + 1}  {fam:10s} {impl:14s} ({r['kernel']:10s}) step {statistics.median(r['walls']):.3f}s"
                  f"  peak RSS {r['peak_rss_mb']:.0f} MB  loss {r['first_loss']:.3f}->{r['last_loss']:.3f}", flush=True)
    tokens = a.batch * a.seq
    print(f"\nMoE h{a.hidden} x {a.layers} layers, {a.experts} experts (FFN {a.expert_ffn}) top-{a.topk}, vocab "
          f"{a.vocab}, batch {a.batch} x {a.seq}, {a.precision}, fused AdamW, {a.threads} threads; median over "
          f"{a.rounds} rounds x {a.steps} steps")
    summary = {}
    for (impl, fam), rs in runs.items():
        s = summary[impl, fam] = summarize(rs)
        print(f"{fam:10s} {impl:14s} {tokens / s['step']:7.0f} tok/s  step {s['step']:.3f}s  CPU {s['cpu']:.3f}s  "
              f"peak RSS {s['peak']:.0f} MB")
    for fam in a.families.split(","):
        for ours, base in (("megapipe", "hf"), ("megapipe-loop", "hf-eager"), ("megapipe", "megapipe-loop"),
                           ("hf", "hf-eager")):
            x, y = summary.get((ours, fam)), summary.get((base, fam))
            if not (x and y):
                continue
            print(f"{fam:10s} {ours} / {base}: {speed_ratio(x, y)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
