"""The preference demonstration on a real model: SmolLM2-135M-Instruct (prepared by tools/prepare_smollm2.py) and the
bundled preference set (pipelines/data/preference.jsonl: ``ANSWER: <n>`` preferred to the same number hedged), on
this machine's CPUs. Every step is a megapipe command (import hf, posttrain dpo, posttrain rm, posttrain rl).

    python tools/demo_preference.py [--model-dir ~/.cache/megapipe/smollm2] [--work /tmp/megapipe-demo-pref]
        [--dpo-steps 10] [--dpo-lr 2e-5] [--beta 0.1] [--rpo-alpha 1] [--rm-steps 10] [--rl-start-steps 2]
        [--rl-steps 12] [--prompts-per-step 4] [--group-size 4] [--max-completion-tokens 40] [--show 4]

The pairs are split 75 / 25 in file order (``--split 75,25,0``: the first 60 train, the last 20 are held out).
1. DPO from the base model on the training pairs, with RPO's NLL term on the chosen answer (``--rpo-alpha``), which
   raises the chosen answer's own likelihood, not only its ratio to the rejected's (an earlier run without it, lr
   5e-6 and 6 steps, left every greedy answer in the base's style). On the held-out pairs, under the base and the DPO
   model: the DPO loss, margin and accuracy against the base (0 for the base itself: its rewards are all 0), and how
   often the model's own log-probs rank the chosen answer first.
2. A reward model (``posttrain rm``) from the base model on the same pairs; its held-out accuracy and margin.
3. GRPO (``posttrain rl --reward-model RM --reward accuracy=0``: the reward model's score is the whole reward, the
   accuracy only logged) on the training pairs' prompts, from a DPO run of --rl-start-steps steps (0: from the
   base): the mean reward of the first and last --window steps. Not from the DPO model: its samples all read
   ``ANSWER: <n>`` and score alike, leaving GRPO's group advantages nothing to climb.
4. The greedy answers of the base, DPO, GRPO-start and GRPO models to the held-out prompts, with the reward model's score.

Prints each figure and writes WORK/demo.json. Exits 1 unless GRPO raised the reward model's reward. A --work that
already holds a step's run reuses it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.demo_rl import ROOT, greedy, load, megapipe  # noqa: E402

# what every run of the demonstration shares: fp32, a constant learning rate, a record every step, one checkpoint
RUN = "--precision fp32 --lr-decay-style constant --lr-warmup-iters 0 --log-interval 1 --save-interval 1000 " \
      "--keep-last 1 --quiet".split()
TRAIN = ["--split", "75,25,0", "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "4",
         "--eval-iters", "5", *RUN]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/megapipe/smollm2"))
    ap.add_argument("--data", default=str(ROOT / "pipelines/data/preference.jsonl"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--dpo-steps", type=int, default=10)
    ap.add_argument("--dpo-lr", type=float, default=2e-5)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--rpo-alpha", type=float, default=1.0, help="DPO's NLL term on the chosen answer (0: plain DPO).")
    ap.add_argument("--rm-steps", type=int, default=10)
    ap.add_argument("--rm-lr", type=float, default=1e-5)
    ap.add_argument(
        "--rl-start-steps",
        type=int,
        default=2,
        help="GRPO starts from a DPO run of this many steps (the DPO settings; 0: from the base).",
    )
    ap.add_argument("--rl-steps", type=int, default=12)
    ap.add_argument("--rl-lr", type=float, default=1e-5)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-completion-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--window", type=int, default=3, help="RL steps averaged for the start and end reward.")
    ap.add_argument("--show", type=int, default=4, help="Held-out greedy answers printed.")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if not (Path(args.model_dir) / "config.json").is_file():
        print(f"{args.model_dir} holds no HF model: run tools/prepare_smollm2.py first", file=sys.stderr)
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="megapipe-demo-pref-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    if not base.exists():
        megapipe("import", "hf", args.model_dir, str(base), "--quiet")
    train, held = split_pairs(Path(args.data))
    held_prompts = [prompt_of(p) for p in held]
    tokens = args.max_completion_tokens
    figures: dict = {"model": args.model_dir, "data": args.data, "pairs": {"train": len(train), "held_out": len(held)}}

    dpo_flags = ["--beta", str(args.beta), *(["--rpo-alpha", str(args.rpo_alpha)] if args.rpo_alpha else [])]
    dpo = train_step(work / "dpo", "dpo", base, args, args.dpo_steps, args.dpo_lr, dpo_flags)
    rm = train_step(work / "rm", "rm", base, args, args.rm_steps, args.rm_lr, [])
    figures["dpo"], figures["rm"] = dpo, rm

    rl_prompts = work / "rl_prompts.jsonl"
    rl_prompts.write_text("".join(json.dumps({"prompt": prompt_of(p), "answer": answer_of(p)}) + "\n" for p in train))
    start = base
    if args.rl_start_steps:
        figures["rl_start"] = train_step(
            work / "dpo_start", "dpo", base, args, args.rl_start_steps, args.dpo_lr, dpo_flags
        )
        start = Path(figures["rl_start"]["run"])
    figures["rl"] = rl = rl_step(work / "rl", start, rl_prompts, rm["run"], args)

    ref = pair_logps(base, held)
    figures["held_out_preference"] = {
        "base": preference(ref, ref, args.beta),
        "dpo": preference(pair_logps(Path(dpo["run"]), held), ref, args.beta),
    }

    models = {
        "base": base,
        "dpo": Path(dpo["run"]),
        **({"start": start} if start != base else {}),
        "rl": Path(rl["run"]),
    }
    answers = {name: greedy(ckpt, held_prompts, tokens) for name, ckpt in models.items()}
    from megapipe.posttrain.reward_model import RewardModel

    scorer = RewardModel.load(rm["run"])
    scores = {name: scorer.score(held_prompts, texts) for name, texts in answers.items()}
    figures["held_out"] = {
        name: {
            "rm_mean": sum(s) / len(s),
            "answers": [
                {"prompt": p[-1]["content"], "answer": a, "rm": r}
                for p, a, r in zip(held_prompts, answers[name], s, strict=True)
            ],
        }
        for name, s in scores.items()
    }
    (work / "demo.json").write_text(json.dumps(figures, indent=1) + "\n")

    for name in ("dpo", "rm"):
        f = figures[name]
        v = f["valid"] or {}
        print(
            f"{name}: {f['steps']} steps, {f['s_per_step']:.1f} s/step; first / last step loss "
            f"{f['first_step']['loss']:.4f} / {f['last_step']['loss']:.4f}, margin "
            f"{f['last_step']['rewards/margin']:.2f}; held-out: "
            + (", ".join(f"{k} {x:.3f}" for k, x in v.items()) if v else "no final evaluation")
        )
    for name, f in figures["held_out_preference"].items():
        print(
            f"held-out pairs under {name}: DPO loss {f['loss']:.4f}, margin {f['margin']:.2f}, accuracy "
            f"{f['accuracy']:.2f} (against the base); its log-probs rank the chosen first in "
            f"{f['logp_accuracy']:.2f} (summed) / {f['logp_per_token_accuracy']:.2f} (per token) of the pairs, "
            f"mean log-probs {f['logps/chosen']:.1f} / {f['logps/rejected']:.1f} (chosen / rejected)"
        )
    print(
        f"rl: reward-model reward (mean of {rl['window']} steps) {rl['reward_start']:.3f} -> {rl['reward_end']:.3f} "
        f"over {rl['steps']} steps, completion length {rl['length_start']:.1f} -> {rl['length_end']:.1f}, "
        f"{rl['s_per_step']:.1f} s/step ({rl['load_before']})"
    )
    print(
        "reward model's mean score of the greedy answers to the held-out prompts: "
        + ", ".join(f"{k} {v['rm_mean']:.2f}" for k, v in figures["held_out"].items())
    )
    for i, p in enumerate(held_prompts[: args.show]):
        print(f"Q: {p[-1]['content']}")
        for name in answers:
            print(f"  {name:5s} [{scores[name][i]:+6.2f}] {answers[name][i]!r}")
    print(f"figures in {work / 'demo.json'}")
    return 0 if rl["reward_end"] > rl["reward_start"] else 1


def split_pairs(path: Path) -> tuple[list[dict], list[dict]]:
    """The training and held-out pairs of ``--split 75,25,0`` (file order, as posttrain dpo / rm split them)."""
    from megapipe.data.gpt_dataset import parse_split, split_document_ranges

    pairs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    (lo, hi), (vlo, vhi) = split_document_ranges(parse_split("75,25,0"), len(pairs))[:2]
    return pairs[lo:hi], pairs[vlo:vhi]


def prompt_of(pair: dict) -> list[dict]:
    return pair["chosen"][:-1]


def answer_of(pair: dict) -> int:
    return int(re.search(r"-?\d+", pair["chosen"][-1]["content"]).group())


def train_step(run: Path, stage: str, base: Path, args, steps: int, lr: float, extra: list[str]) -> dict:
    load_before = load()
    if not run.exists():
        megapipe(
            "posttrain",
            stage,
            "--load",
            str(base),
            "--data",
            args.data,
            "--save",
            str(run),
            "--train-iters",
            str(steps),
            "--lr",
            str(lr),
            "--seed",
            str(args.seed),
            *TRAIN,
            *extra,
        )
    recs = metrics(run)
    train = [r for r in recs if r.get("kind", "train") == "train"]
    valid = [r for r in recs if r.get("kind") == "valid"]  # none when the run was stopped before its end
    keys = ("loss", "rewards/margin", "rewards/accuracy", "logps/chosen", "logps/rejected")
    return {
        "run": str(run),
        "steps": len(train),
        "lr": lr,
        "s_per_step": step_seconds(train),
        "load_before": load_before,
        "first_step": {k: train[0][k] for k in keys if k in train[0]},
        "last_step": {k: train[-1][k] for k in keys if k in train[-1]},
        "valid": {k: valid[-1][k] for k in keys if k in valid[-1]} if valid else None,
    }


def step_seconds(train: list[dict]) -> float:
    """Mean seconds per step, from each step's tokens and tokens_per_s as the run logged them."""
    seen = [0] + [r["tokens_seen"] for r in train]
    return sum((b - a) / r["tokens_per_s"] for a, b, r in zip(seen[:-1], seen[1:], train, strict=True)) / len(train)


def rl_step(run: Path, start: Path, prompts: Path, rm: str, args) -> dict:
    load_before, t0 = load(), time.monotonic()
    if not run.exists():
        megapipe(
            "posttrain",
            "rl",
            "--load",
            str(start),
            "--save",
            str(run),
            "--task",
            f"jsonl:{prompts}",
            "--answer-match",
            "numeric",
            "--reward",
            "accuracy=0",
            "--reward-model",
            rm,
            "--prompts-per-step",
            str(args.prompts_per_step),
            "--group-size",
            str(args.group_size),
            "--max-completion-tokens",
            str(args.max_completion_tokens),
            "--max-prompt-tokens",
            "64",
            "--temperature",
            str(args.temperature),
            "--micro-batch-size",
            str(args.prompts_per_step * args.group_size),
            "--train-iters",
            str(args.rl_steps),
            "--lr",
            str(args.rl_lr),
            "--seed",
            str(args.seed),
            *RUN,
        )
    wall = time.monotonic() - t0
    curve = [r for r in metrics(run) if r.get("kind", "train") == "train" and "reward" in r]
    print(f"{'step':>4} {'reward':>7} {'accuracy':>8} {'length':>7}")
    for c in curve:
        print(f"{c['step']:>4} {c['reward']:>7.3f} {c['accuracy']:>8.3f} {c['completion_len']:>7.2f}")
    w = min(args.window, max(1, len(curve) // 2))

    def mean(key: str, part: list) -> float:
        return sum(c[key] for c in part) / len(part)

    return {
        "run": str(run),
        "steps": len(curve),
        "window": w,
        "lr": args.rl_lr,
        "reward_start": mean("reward", curve[:w]),
        "reward_end": mean("reward", curve[-w:]),
        "length_start": mean("completion_len", curve[:w]),
        "length_end": mean("completion_len", curve[-w:]),
        "s_per_step": wall / max(len(curve), 1),
        "load_before": load_before,
        "curve": [{k: c.get(k) for k in ("step", "reward", "accuracy", "completion_len")} for c in curve],
    }


@torch.no_grad()
def pair_logps(ckpt: Path, pairs: list[dict]) -> list[tuple[float, float, int, int]]:
    """(summed log-prob of the chosen answer, of the rejected, their token counts) of each pair under a checkpoint,
    over the tokens posttrain dpo trains (rendered by the checkpoint's own chat template, as the runs here are)."""
    from megapipe.checkpoint.load import load_model
    from megapipe.data.preference import encode_pair, parse_pair
    from megapipe.data.sft import ChatEncoder
    from megapipe.posttrain.rl.logprobs import DEFAULT_CHUNK
    from megapipe.posttrain.rl.rollout import sequence_logprobs

    loaded = load_model(str(ckpt), "cpu", torch.float32)
    encoder = ChatEncoder(loaded.tokenizer_dir, None)
    out = []
    for i, pair in enumerate(pairs):
        prompt, *answers = encode_pair(encoder, *parse_pair(pair, f"held-out pair {i}"))
        sums = []
        for ids, mask in answers:
            seq = torch.from_numpy(np.concatenate([prompt, ids]))[None]
            on = torch.zeros_like(seq[:, 1:], dtype=torch.bool)  # the answer's trained tokens, as labels
            on[0, len(prompt) - 1 :] = torch.from_numpy(mask)
            with torch.no_grad():
                (logp,) = sequence_logprobs(loaded.model, {"tokens": seq[:, :-1], "labels": seq[:, 1:]}, on, [1.0],
                                            DEFAULT_CHUNK)
            sums.append((float(logp.sum()), int(mask.sum())))
        out.append((sums[0][0], sums[1][0], sums[0][1], sums[1][1]))
    return out


def preference(policy: list, reference: list, beta: float) -> dict:
    """Held-out preference figures of a policy: the DPO loss, margin and accuracy against the reference (the base;
    strict ``>``, so 0 when policy = reference; the loss as posttrain dpo computes it, sigmoid at ``beta``), and how
    often its own summed / per-token log-prob ranks the chosen answer above the rejected."""
    from megapipe.posttrain.dpo_losses import PreferenceSpec, preference_loss

    pc, pr, nc, nr = torch.tensor(policy, dtype=torch.float64).T
    rc, rr = torch.tensor(reference, dtype=torch.float64).T[:2]
    loss, chosen, rejected = preference_loss(PreferenceSpec(beta=beta), pc, pr, nc, nr, rc, rr)
    return {
        "loss": loss.mean().item(),
        "margin": (chosen - rejected).mean().item(),
        "accuracy": (chosen > rejected).double().mean().item(),
        "logp_accuracy": (pc > pr).double().mean().item(),
        "logp_per_token_accuracy": (pc / nc > pr / nr).double().mean().item(),
        "logps/chosen": pc.mean().item(),
        "logps/rejected": pr.mean().item(),
    }


def metrics(run: Path) -> list[dict]:
    from megapipe.plot import read_metrics

    return read_metrics(run / "metrics.jsonl")


if __name__ == "__main__":
    sys.exit(main())
