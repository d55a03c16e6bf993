"""GRPO step time and rollout throughput: megapipe's `posttrain rl` against TRL's GRPOTrainer, in one run.

Both train the same Hugging Face model (default SmolLM2-135M-Instruct, prepared by tools/prepare_smollm2.py) in
fp32 on this machine's CPUs, on the same prompts (the built-in arithmetic task, through the model's chat template),
with the same reward (exact answer), group size, completion length, sampling (temperature 1, no truncation), loss
(token-mean, TRL's "dapo"; group-scaled advantages; clip 0.2; no KL) and optimiser (AdamW, same lr, betas, weight
decay, gradient clipping; constant schedule), one optimiser step per rollout batch, the same torch thread count.

    python tools/bench_rl.py [--model-dir DIR] [--steps 3] [--prompts 2] [--group-size 4]
        [--max-completion-tokens 16] [--threads N] [--only megapipe|trl]

Seconds per step are the mean over the steps after the first (warm-up: weight packing, allocator); rollout tokens/s
is completion tokens over the time spent generating them (megapipe: the engine's rollout; TRL: its
_generate_single_turn). Prints both, the ratio (target: megapipe >= 2x TRL), the train/inference mismatch each one
reports, and the machine load during each run (the two-core machine is shared: compare ratios, not absolutes).

TRL is a benchmark-only baseline, declared in the ``bench`` extra: pip install -e '.[bench]' (or trl==1.16.0; it
needs nothing the product does not already install).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

SEED = 1234


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def task_prompts(n: int, max_operand: int):
    from megapipe.config import RLConfig
    from megapipe.posttrain.rl.tasks import build_task

    task = build_task(RLConfig(task="arithmetic", arithmetic_max=max_operand), SEED)
    return task, [task.prompt(i) for i in range(n)]


def run_megapipe(args, work: Path) -> dict:
    from megapipe.cli import main as megapipe
    from megapipe.config import load_config
    from megapipe.plot import read_metrics
    from megapipe.training.recipes.rl import RLRecipe, rl_config
    from megapipe.training.trainer import Trainer

    base, run = work / "base", work / "megapipe"
    if not base.exists():
        assert megapipe(["import", "hf", args.model_dir, str(base), "--quiet"]) == 0
    overrides = {
        "checkpoint.load": str(base), "checkpoint.save": str(run), "train.train_iters": args.steps,
        "train.micro_batch_size": args.prompts * args.group_size, "train.lr": args.lr, "train.seed": SEED,
        "train.lr_decay_style": "constant", "train.lr_warmup_iters": 0, "train.log_interval": 1,
        "train.precision": "fp32", "optim.weight_decay": args.weight_decay, "optim.adam_beta1": 0.9,
        "optim.adam_beta2": 0.999, "optim.clip_grad": 1.0, "checkpoint.save_interval": 0,
        "rl.task": "arithmetic", "rl.arithmetic_max": args.arithmetic_max, "rl.prompts_per_step": args.prompts,
        "rl.group_size": args.group_size, "rl.max_completion_tokens": args.max_completion_tokens,
        "rl.max_prompt_tokens": 96, "rl.loss_aggregation": "token-mean", "rl.scale_rewards": "group",
    }
    cfg = rl_config(load_config(None, overrides))
    before = load()
    trainer = Trainer(cfg, RLRecipe(cfg.rl), quiet=True)
    trainer.train()
    recs = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
    tokens = cfg.train.global_batch_size * cfg.data.seq_length  # the loop's tokens per step (for its step time)
    steps = [tokens / r["tokens_per_s"] for r in recs]
    timed = recs[1:] or recs
    return {
        "step_s": [round(s, 2) for s in steps],
        "mean_step_s": sum(steps[1:] or steps) / len(steps[1:] or steps),
        "rollout_tokens_per_s": sum(r["rollout_tokens"] for r in timed) / sum(r["rollout_s"] for r in timed),
        "reward": [r["reward"] for r in recs], "completion_len": [r["completion_len"] for r in recs],
        "mismatch": {k: max(r[k] for r in recs) for k in ("mismatch_mean", "mismatch_max", "mismatch_kl")},
        "load_before": before, "load_after": load(),
    }


def run_trl(args, work: Path) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task, prompts = task_prompts(args.prompts * args.steps, args.arithmetic_max)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}], "answer": p.fields["answer"]}
                              for p in prompts])

    def accuracy(prompts, completions, answer, **kw):
        return [task.accuracy(c[0]["content"], {"answer": a}) for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=args.steps, per_device_train_batch_size=args.prompts *
        args.group_size, gradient_accumulation_steps=1, num_generations=args.group_size,
        max_completion_length=args.max_completion_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=args.weight_decay,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch", beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", num_iterations=1, use_vllm=False, bf16=False, fp16=False,
        use_cpu=True, logging_steps=1, report_to="none", save_strategy="no", seed=SEED, shuffle_dataset=False,
        dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=accuracy, args=config, train_dataset=data,
                          processing_class=tokenizer)
    stamps: list[float] = []
    gen_time = [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    generate = trainer._generate_single_turn

    def timed_generate(*a, **k):
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen_time.append(time.perf_counter() - t)

    trainer._generate_single_turn = timed_generate
    trainer.add_callback(Clock())
    before = load()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    steps = [stamps[i + 1] - stamps[i] for i in range(0, len(stamps) - 1, 2)]
    gens = gen_time[1:]
    n = args.prompts * args.group_size
    lengths = [h["completions/mean_length"] for h in logs]
    timed = slice(1, None) if len(gens) > 1 else slice(None)
    mismatch = {k: h[k] for h in logs for k in h if k.startswith("sampling/sampling_logp_difference")}
    return {
        "version": trl.__version__, "step_s": [round(s, 2) for s in steps],
        "mean_step_s": sum(steps[1:] or steps) / len(steps[1:] or steps),
        "rollout_tokens_per_s": sum(x * n for x in lengths[timed]) / sum(gens[timed]),
        "reward": [h["reward"] for h in logs], "completion_len": lengths,
        "mismatch": mismatch or "not reported: TRL measures it only with use_vllm=True (its in-process HF generate "
                                "samples with the training model and returns no sampling log-probs)",
        "load_before": before, "load_after": load(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/megapipe/smollm2"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-completion-tokens", type=int, default=16)
    ap.add_argument("--arithmetic-max", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    ap.add_argument("--only", choices=("megapipe", "trl"), default=None)
    args = ap.parse_args()
    if not (Path(args.model_dir) / "config.json").is_file():
        print(f"{args.model_dir} holds no HF model: run tools/prepare_smollm2.py first", file=sys.stderr)
        return 2
    if args.only != "megapipe":
        try:
            import trl  # noqa: F401
        except ImportError:
            print("TRL (the baseline) is not installed: pip install -e '.[bench]' (trl==1.16.0; it pulls nothing "
                  "the product does not already have), or run with --only megapipe", file=sys.stderr)
            return 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="megapipe-bench-rl-"))
    work.mkdir(parents=True, exist_ok=True)
    setup = {"model": args.model_dir, "steps": args.steps, "prompts": args.prompts, "group_size": args.group_size,
             "max_completion_tokens": args.max_completion_tokens, "threads": torch.get_num_threads(),
             "cpus": os.cpu_count()}
    print(json.dumps({"setup": setup}))
    out = {"setup": setup}
    for name, fn in (("megapipe", run_megapipe), ("trl", run_trl)):
        if args.only in (None, name):
            out[name] = fn(args, work)
            print(json.dumps({name: out[name]}), flush=True)
    if "megapipe" in out and "trl" in out:
        m, t = out["megapipe"], out["trl"]
        out["ratio"] = {"step": t["mean_step_s"] / m["mean_step_s"],
                        "rollout_tokens_per_s": m["rollout_tokens_per_s"] / t["rollout_tokens_per_s"]}
        print(f"seconds per GRPO step: megapipe {m['mean_step_s']:.2f}, TRL {t['mean_step_s']:.2f} -> "
              f"{out['ratio']['step']:.2f}x (target >= 2x)")
        print(f"rollout tokens/s: megapipe {m['rollout_tokens_per_s']:.1f}, TRL {t['rollout_tokens_per_s']:.1f} -> "
              f"{out['ratio']['rollout_tokens_per_s']:.2f}x")
        print(f"mismatch: megapipe {m['mismatch']}; TRL {t['mismatch']}")
        print(f"load: megapipe {m['load_before']} -> {m['load_after']}; TRL {t['load_before']} -> {t['load_after']}")
    (work / "bench_rl.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
