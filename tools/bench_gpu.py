"""GPU training-step benchmark (issue 17): megapipe's Trainer step vs Hugging Face ``LlamaForCausalLM`` on one
CUDA device, bf16 autocast with fp32 master weights, the same config, batch, optimizer (fused AdamW) and clipping.

For the model (default: the ``llama3-1b`` preset at seq 4096) it finds the largest micro-batch that fits (halving
from --max-micro-batch), then times --steps steps after --warmup and reports tokens/s, MFU against the device's
peak (megapipe.training.metrics.PEAK_FLOPS by device name, or --peak-flops) and peak memory, for megapipe and for
HF at the same micro-batch, with their ratio, as one JSON (--out). ``--fp8`` is reported as not available until
the Transformer Engine path exists.

Without CUDA it stops after the checks that need none (config, model on the meta device, FLOPs per token, the
planner's memory estimate per micro-batch) and says so; the exit status is 0 either way, 1 on an error.

    python tools/bench_gpu.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--max-micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="also time HF's step")
    p.add_argument("--fp8", action="store_true", help="also try fp8 (Transformer Engine)")
    p.add_argument("--peak-flops", type=float, default=None)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def model_config(a):
    from megapipe.config import ModelConfig, from_dict

    return from_dict(ModelConfig, {"preset": a.model, "max_position_embeddings": max(a.seq, 8192)})


def cpu_checks(a) -> dict:
    """What needs no GPU: the config, the model on the meta device, FLOPs per token, planned memory per batch."""
    from megapipe.config import load_config
    from megapipe.models import build_model, count_params, flops_per_token
    from megapipe.parallel.plan import plan

    m = model_config(a)
    params = count_params(build_model(m, device="meta"))
    planned = {}
    for mb in (1, 2, 4, 8, 16):
        cfg = load_config(None, {"model.preset": a.model, "data.seq_length": a.seq, "train.precision": "bf16",
                                 "train.micro_batch_size": mb, "train.global_batch_size": mb,
                                 "model.max_position_embeddings": m.max_position_embeddings})
        planned[mb] = round(plan(cfg, 1, "h200")["memory_bytes"] / 1e9, 1)
    return {"model": a.model, "params": params, "seq": a.seq, "flops_per_token": flops_per_token(m, a.seq),
            "planned_memory_gb_by_micro_batch": planned}


def _batch(vocab: int, mb: int, seq: int, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    data = torch.randint(0, vocab, (mb, seq + 1), generator=g).to(device)
    return {"tokens": data[:, :-1].contiguous(), "labels": data[:, 1:].contiguous()}


def megapipe_step(a, mb: int):
    from megapipe.config import Config, OptimConfig, TrainConfig
    from megapipe.training.trainer import Trainer

    cfg = Config(model=model_config(a),
                 train=TrainConfig(micro_batch_size=mb, global_batch_size=mb, train_iters=a.steps + a.warmup,
                                   lr=1e-4, lr_decay_style="constant", precision="bf16", compile=a.compile),
                 optim=OptimConfig(weight_decay=0.01, clip_grad=1.0))
    cfg.data.seq_length = a.seq
    trainer = Trainer(cfg, quiet=True, with_data=False)
    batch = _batch(cfg.model.vocab_size, mb, a.seq, trainer.device)
    return lambda: trainer.train_step([batch])["loss"]


def hf_step(a, mb: int):
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from megapipe.checkpoint.hf.base import adapter_for_arch

    m = model_config(a)
    from transformers import LlamaConfig

    config = LlamaConfig(**adapter_for_arch(m.arch).hf_config(m))
    config.use_cache = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    fwd = torch.compile(model) if a.compile else model
    batch = _batch(m.vocab_size, mb, a.seq, "cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(input_ids=batch["tokens"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def measure(make, a, mb: int) -> dict:
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step = make(a, mb)
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()  # .item() inside: waits for the device
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    return {"micro_batch": mb, "step_s": median, "tokens_per_s": mb * a.seq / median,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}


def largest_fitting(make, a) -> dict:
    import torch

    mb = a.max_micro_batch
    while mb >= 1:
        try:
            return measure(make, a, mb)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            mb //= 2
    raise RuntimeError("even micro-batch 1 does not fit")


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    result = {"cpu_checks": cpu_checks(a)}
    print(json.dumps(result["cpu_checks"], indent=1))
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here: stopped after the checks that need none (the measurements need a GPU)")
        return _write(a, result)
    from megapipe.training.metrics import device_peak_flops, mfu

    peak = device_peak_flops("cuda", a.peak_flops)
    fpt = result["cpu_checks"]["flops_per_token"]
    result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    mp = largest_fitting(megapipe_step, a)
    mp["mfu"] = mfu(mp["tokens_per_s"], fpt, peak)
    result["megapipe_bf16"] = mp
    if a.hf:
        try:
            hf = measure(hf_step, a, mp["micro_batch"])
            hf["mfu"] = mfu(hf["tokens_per_s"], fpt, peak)
            result["hf_bf16"] = hf
            result["ratio_vs_hf"] = mp["tokens_per_s"] / hf["tokens_per_s"]
        except torch.OutOfMemoryError:
            result["hf_bf16"] = {"error": f"out of memory at micro-batch {mp['micro_batch']}"}
    if a.fp8:
        result["megapipe_fp8"] = {"error": "not available: megapipe's Transformer Engine fp8 path is not built yet"}
    print(json.dumps({k: v for k, v in result.items() if k != "cpu_checks"}, indent=1))
    return _write(a, result)


def _write(a, result: dict) -> int:
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
