"""The RL demonstration on a real model: GRPO on SmolLM2-135M-Instruct (prepared by tools/prepare_smollm2.py) with
the built-in ``arithmetic`` task (small additions, "Reply with only the number."): reward 1 for the exact answer
(``accuracy``) plus, with --format-weight W > 0, W when the completion ends in the answer format "= N" (``format``),
on this machine's CPUs. Every step is a megapipe command (import hf, posttrain rl, plot).

    python tools/demo_rl.py [--model-dir ~/.cache/megapipe/smollm2] [--work /tmp/megapipe-demo-rl] [--steps 20]
        [--prompts-per-step 8] [--group-size 4] [--max-completion-tokens 12] [--temperature 0.7] [--lr 2e-5]
        [--format-weight 0] [--format-regex REGEX] [--seeds 1234,1,2]

Each seed (--seeds: the run's --seed, which draws the prompts and the samples) is one run, WORK/rl-seed<N>. Prints
each run's reward curve (reward = accuracy here, completion length), writes WORK/rl-seed<N>/curve.json and
WORK/rl-seed<N>/plots/{reward,length,...}.png (``megapipe plot``) and WORK/demo.json with the figures: mean reward of
the first and last --window steps per seed and over the seeds, steps, wall time, machine load, and the greedy
accuracy on --held-out additions no run trained on (another prompt seed), of the base model and of each run's final
checkpoint. Exits 1 unless the reward rose by at least --min-gain on average over the seeds and rose in every one. A --work that already holds a
run resumes it (``posttrain rl`` resumes exactly from its newest checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def megapipe(*args: str) -> None:
    exe = Path(sys.executable).with_name("megapipe")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "megapipe.cli"]
    subprocess.run([*cmd, *args], check=True, cwd=ROOT)


def load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg() + f" on {os.cpu_count()} CPUs"


def seed_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/megapipe/smollm2"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-completion-tokens", type=int, default=12)
    ap.add_argument("--arithmetic-max", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--format-weight", type=float, default=0.0, help="Weight of the format reward (0: accuracy alone).")
    ap.add_argument("--format-regex", default=r"=\s*-?\d+\.?\s*$",
                    help="The answer format rewarded (default: the completion ends with '= N').")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--window", type=int, default=5, help="Steps averaged for the start and end reward.")
    ap.add_argument("--min-gain", type=float, default=0.15,
                    help="Required rise of the reward (end - start), on average over the seeds.")
    ap.add_argument("--seeds", type=seed_list, default=[1234], help="Comma-separated run seeds, one run each (default 1234).")
    ap.add_argument("--held-out", type=int, default=100, help="Held-out additions scored greedily at the end.")
    args = ap.parse_args()
    if not (Path(args.model_dir) / "config.json").is_file():
        print(f"{args.model_dir} holds no HF model: run tools/prepare_smollm2.py first", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="megapipe-demo-rl-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    if not base.exists():
        megapipe("import", "hf", args.model_dir, str(base), "--quiet")
    runs = [run_seed(args, base, work / f"rl-seed{seed}", seed) for seed in args.seeds]
    held_out = {"base": held_out_accuracy(base, args)}
    for r in runs:
        r["held_out_accuracy"] = held_out[f"seed {r['seed']}"] = held_out_accuracy(Path(r["run"]), args)
    n = len(runs)
    figures = {
        "model": args.model_dir, "task": f"arithmetic 0..{args.arithmetic_max} (+)", "seeds": args.seeds,
        "prompts_per_step": args.prompts_per_step, "group_size": args.group_size, "lr": args.lr,
        "max_completion_tokens": args.max_completion_tokens, "temperature": args.temperature,
        "reward_start": sum(r["reward_start"] for r in runs) / n, "reward_end": sum(r["reward_end"] for r in runs) / n,
        "held_out": {"prompts": args.held_out, "greedy_accuracy": held_out}, "runs": runs,
    }
    (work / "demo.json").write_text(json.dumps(figures, indent=1) + "\n")
    for r in runs:
        print(f"seed {r['seed']}: reward (mean of {r['window']} steps) {r['reward_start']:.3f} -> {r['reward_end']:.3f} "
              f"over {r['steps']} steps; completion length {r['length_start']:.1f} -> {r['length_end']:.1f}; "
              f"mismatch KL <= {r['mismatch_kl_max']:.2g}; {r['s_per_step']:.1f} s/step ({r['load_before']})")
    print(f"mean over {n} seed(s): {figures['reward_start']:.3f} -> {figures['reward_end']:.3f}; greedy accuracy on "
          f"{args.held_out} held-out additions: " + ", ".join(f"{k} {v:.3f}" for k, v in held_out.items()) +
          f"; figures in {work / 'demo.json'}")
    rose = all(r["reward_end"] > r["reward_start"] for r in runs)
    return 0 if rose and figures["reward_end"] - figures["reward_start"] >= args.min_gain else 1


def run_seed(args, base: Path, run: Path, seed: int) -> dict:
    load_before, t0 = load(), time.monotonic()
    megapipe("posttrain", "rl", "--load", str(base), "--save", str(run), "--task", "arithmetic",
             "--arithmetic-max", str(args.arithmetic_max), "--prompts-per-step", str(args.prompts_per_step),
             "--group-size", str(args.group_size), "--max-completion-tokens", str(args.max_completion_tokens),
             "--max-prompt-tokens", "64", "--temperature", str(args.temperature),
             "--reward", "accuracy", *([f"format={args.format_weight:g}"] if args.format_weight else []),
             "--format-regex", args.format_regex, "--micro-batch-size", str(args.prompts_per_step * args.group_size),
             "--train-iters", str(args.steps), "--lr", str(args.lr), "--lr-decay-style", "constant",
             "--lr-warmup-iters", "0", "--precision", "fp32", "--log-interval", "1", "--save-interval", "5",
             "--keep-last", "1", "--seed", str(seed), "--quiet")
    wall, load_after = time.monotonic() - t0, load()
    megapipe("plot", str(run), "--output", str(run / "plots"), "--quiet")

    from megapipe.plot import read_metrics

    recs = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind", "train") == "train" and "reward" in r]
    curve = [{k: r.get(k) for k in ("step", "reward", "accuracy", "reward/format", "completion_len", "truncated",
                                    "mismatch_kl", "mismatch_max", "rollout_s", "logprob_s")} for r in recs]
    print(f"seed {seed}\n{'step':>4} {'reward':>7} {'accuracy':>8} {'format':>7} {'length':>7} {'truncated':>9} "
          f"{'mismatch_kl':>11}")
    for c in curve:
        print(f"{c['step']:>4} {c['reward']:>7.3f} {c['accuracy']:>8.3f} {c.get('reward/format') or 0:>7.3f} "
              f"{c['completion_len']:>7.2f} {c['truncated']:>9.2f} {c['mismatch_kl']:>11.2e}")
    (run / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    w = min(args.window, max(1, len(curve) // 2))

    def mean(key: str, part: list) -> float:
        return sum(c[key] for c in part) / len(part)

    return {
        "seed": seed, "steps": len(curve), "window": w, "reward_start": mean("reward", curve[:w]),
        "reward_end": mean("reward", curve[-w:]), "accuracy_start": mean("accuracy", curve[:w]),
        "accuracy_end": mean("accuracy", curve[-w:]), "length_start": mean("completion_len", curve[:w]),
        "length_end": mean("completion_len", curve[-w:]), "mismatch_kl_max": max(c["mismatch_kl"] for c in curve),
        "wall_s": wall, "s_per_step": wall / max(len(curve), 1), "load_before": load_before, "load_after": load_after,
        "run": str(run), "curve": str(run / "curve.json"), "plots": str(run / "plots"),
    }


HELD_OUT_SEED = 987654321  # the prompt stream of the held-out additions: none of the runs' seeds


def held_out_accuracy(ckpt: Path, args) -> float:
    """Greedy accuracy of the checkpoint on --held-out additions rendered as the runs render theirs (the model's
    chat template), at the runs' completion limit, through megapipe's engine."""
    from megapipe.config import RLConfig
    from megapipe.posttrain.rl.tasks import build_task

    task = build_task(RLConfig(task="arithmetic", arithmetic_max=args.arithmetic_max), HELD_OUT_SEED)
    prompts = [task.prompt(i) for i in range(args.held_out)]
    texts = greedy(ckpt, [p.prompt for p in prompts], args.max_completion_tokens)
    return sum(task.accuracy(t, p.fields) for t, p in zip(texts, prompts, strict=True)) / len(prompts)


def greedy(ckpt: Path, prompts: list, max_tokens: int) -> list[str]:
    """The checkpoint's greedy completions of the prompts (strings or chat messages) under its chat template, on
    megapipe's engine, as ``posttrain rl`` renders its prompts."""
    from megapipe.data.chat_template import load_chat_template
    from megapipe.inference import LLMEngine, SamplingParams
    from megapipe.posttrain.rl.rollout import PromptRenderer

    engine = LLMEngine.from_pretrained(ckpt, device="cpu", dtype="fp32", max_num_seqs=len(prompts))
    renderer = PromptRenderer(engine.tokenizer, load_chat_template(engine.tokenizer.path), None, 64)
    outputs = engine.generate([renderer.encode(p, f"prompt {i}") for i, p in enumerate(prompts)],
                              SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].text for o in outputs]

if __name__ == "__main__":
    sys.exit(main())
