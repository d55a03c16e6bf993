"""Many LoRA adapters in one batch: output tokens/s of concurrent requests spread over 8 adapters against the base
model alone, same engine settings, same load, taking turns (median of ``--reps``), one run.

The model is the real SmolLM2-135M (``MEGAPIPE_SMOLLM2_DIR``, default ~/.cache/megapipe/smollm2,
tools/prepare_smollm2.py) in bf16 where the CPU has AVX512-BF16 (``--dtype``), else the ``tiny`` preset with random
weights. The adapters are random, rank ``--rank`` on every projection (q, k, v, o, gate, up, down: the most work
an adapter can add) or on ``--targets`` (e.g. q,v, a common peft choice); requests go to them round-robin, all
admitted at once (``--concurrency`` at most running).

    .venv/bin/python tools/bench_lora.py                          # a few minutes on 2 CPU cores
    .venv/bin/python tools/bench_lora.py --requests 128 --concurrency 64 --new-tokens 64
    .venv/bin/python tools/bench_lora.py --targets q,v
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]


def random_adapter(model, rank: int, generator, targets=None) -> dict:
    """{weight name: (A [rank, in], B [out, rank])} on every projection of ``targets`` (short names; default: all
    the model has, q, k, v, o, gate, up, down)."""
    import torch

    from megapipe.models.lora import present_targets, targeted_layers

    out = {}
    for name, linear in targeted_layers(model, targets or present_targets(model.cfg)):
        a = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features ** 0.5
        b = torch.randn(linear.out_features, rank, generator=generator) * 0.01
        out[f"{name}.weight"] = (a, b)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="", help="comma-separated projections to adapt (default: all)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 where the CPU has AVX512-BF16, else float32")
    args = ap.parse_args()
    import torch

    from megapipe.checkpoint.load import load_model
    from megapipe.config import ModelConfig
    from megapipe.inference import LLMEngine, SamplingParams
    from megapipe.inference.engine import EngineConfig
    from megapipe.models import build_model
    from megapipe.models.lora import present_targets
    from megapipe.presets import PRESETS

    torch.set_num_threads(args.threads)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    dtype = {"auto": torch.bfloat16 if "avx512_bf16" in flags else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    smollm2 = Path(os.environ.get("MEGAPIPE_SMOLLM2_DIR", "~/.cache/megapipe/smollm2")).expanduser()
    label = "SmolLM2-135M" if (smollm2 / "config.json").is_file() else "tiny (random weights)"

    def fresh_model():  # one per engine: an engine packs and wraps its model's layers
        if (smollm2 / "config.json").is_file():
            return load_model(smollm2, torch.device("cpu"), dtype).model
        return build_model(ModelConfig(**PRESETS["tiny"]), seed=0).to(dtype).eval()

    model = fresh_model()
    gen = torch.Generator().manual_seed(0)
    targets = [t for t in args.targets.split(",") if t] or None
    unknown = sorted(set(targets or ()) - set(present_targets(model.cfg)))
    if unknown:
        raise SystemExit(f"--targets: {', '.join(unknown)} not among this model's projections "
                         f"({', '.join(present_targets(model.cfg))})")
    adapters = [random_adapter(model, args.rank, gen, targets) for _ in range(args.adapters)]  # before packing
    config = dict(max_num_seqs=args.concurrency, max_model_len=args.prompt_tokens + args.new_tokens + 16)
    base = LLMEngine(model, None, EngineConfig(**config), eos_token_ids=[])
    served = LLMEngine(fresh_model(), None, EngineConfig(max_loras=args.adapters, max_lora_rank=args.rank, **config),
                       eos_token_ids=[])
    for i, weights in enumerate(adapters):
        served.add_lora(f"lora{i}", "random", args.rank, 1.0, weights)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)

    def serve(engine, loras) -> float:
        """Seconds to finish every request, all added at once (request i with adapter loras[i % len])."""
        engine.blocks.reset_prefix_cache()
        started = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params, lora=loras[i % len(loras)])
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - started

    cases = {"base model alone": (base, [None]),
             f"{args.adapters} adapters, round-robin": (served, [f"lora{i}" for i in range(args.adapters)])}
    for engine, loras in cases.values():  # warm-up
        serve(engine, loras)
    times = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, (engine, loras) in cases.items():
            times[name].append(serve(engine, loras))
    tokens = args.requests * args.new_tokens
    speed = {name: tokens / statistics.median(t) for name, t in times.items()}
    print(f"{label} {str(dtype).removeprefix('torch.')}, {args.requests} requests ({args.prompt_tokens} prompt + "
          f"{args.new_tokens} new tokens) at concurrency {args.concurrency}, rank {args.rank} on "
          f"{args.targets or 'every projection'}, "
          f"{args.threads} thread(s), median of {args.reps}")
    first = next(iter(speed))
    for name, s in speed.items():
        print(f"  {name}: {s:.1f} output tokens/s = {s / speed[first]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
