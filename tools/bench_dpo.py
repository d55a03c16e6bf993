"""megapipe's DPO training step vs TRL's DPOTrainer on the same pairs, batch, lengths, optimiser and threads:
seconds per step, peak memory, the ratio (target: megapipe >= 2x TRL's speed), and each side's losses.

TRL is a baseline, never part of megapipe's environment: its side runs as a worker process of the Python given by
--trl-python (default /work/.venv-trl/bin/python, made with ``python3 -m venv /work/.venv-trl &&
/work/.venv-trl/bin/pip install torch==2.13.0 trl``). The model: --model, else SmolLM2-135M at
$MEGAPIPE_SMOLLM2_DIR or /root/.cache/megapipe/smollm2, else a tiny random Llama (tools/make_random_hf.py).

Both sides: fp32, AdamW (betas 0.9 / 0.999, eps 1e-8, no weight decay), a constant learning rate, gradients clipped
at 1, sigmoid loss at beta 0.1, the frozen start checkpoint as the reference, one micro-batch of --batch pairs per
step (every step the same pairs: the whole set is one batch); megapipe packs each pair in one row (the prompt once),
TRL concatenates chosen and rejected rows. Peak memory is each worker process's peak RSS.

    .venv/bin/python tools/bench_dpo.py --threads 2 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools.bench_steps import ROOT, run_worker, speed_ratio, summarize, time_steps  # noqa: E402

WORDS = ("alpha beta gamma delta river stone cloud paper light music green north window quiet").split()


def make_pairs(path: Path, pairs: int, prompt_words: int, answer_words: int) -> Path:
    """Deterministic text pairs: a prompt ending on a newline (a token boundary), a terse chosen answer and a
    longer-worded rejected one, of about the given lengths in words."""
    def words(seed: int, n: int) -> str:
        return " ".join(WORDS[(seed * 7 + 3 * i) % len(WORDS)] for i in range(n))

    with path.open("w") as f:
        for i in range(pairs):
            rec = {"prompt": f"Question {i}: {words(i, prompt_words)}?\n",
                   "chosen": f"ANSWER: {words(i + 1, answer_words)}",
                   "rejected": f"Well, maybe {words(i + 2, answer_words)}"}
            f.write(json.dumps(rec) + "\n")
    return path


def model_dir(args, work: Path) -> Path:
    if args.model:
        return Path(args.model)
    smol = Path(os.environ.get("MEGAPIPE_SMOLLM2_DIR", "/root/.cache/megapipe/smollm2")).expanduser()
    if (smol / "config.json").is_file():
        return smol
    tiny = work / "tiny-llama"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_random_hf.py"), "--arch", "llama", "--output",
                    str(tiny), "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "128",
                    "--vocab", "512", "--dtype", "float32"], check=True, cwd=ROOT)
    return tiny


# ----------------------------------------------------------------------------------------------- workers


def megapipe_worker(args) -> dict:
    import torch

    from megapipe.checkpoint.hf.bridge import import_hf
    from megapipe.config import load_config
    from megapipe.posttrain.start import posttrain_checkpoints
    from megapipe.training.recipes.dpo import DPORecipe
    from megapipe.training.trainer import Trainer

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    ckpt = work / "megapipe-ckpt"
    if not ckpt.exists():
        import_hf(args.model, ckpt)
    cfg = load_config(None, {
        "checkpoint.load": str(ckpt), "checkpoint.save": str(work / "megapipe-run"), "sft.data": [args.pairs],
        "data.seq_length": args.seq_length, "data.split": "100,0,0", "data.cache_dir": str(work / "cache"),
        "train.micro_batch_size": args.batch, "train.global_batch_size": args.batch,
        "train.train_iters": args.warmup + args.steps, "train.lr": args.lr, "train.lr_warmup_iters": 0,
        "train.lr_decay_style": "constant", "train.precision": "fp32", "train.seed": 0,
        "optim.weight_decay": 0.0, "optim.adam_beta1": 0.9, "optim.adam_beta2": 0.999, "optim.adam_eps": 1e-8,
        "optim.clip_grad": 1.0, "dpo.beta": 0.1, "dpo.loss_type": "sigmoid"})
    cfg = posttrain_checkpoints(cfg, str(ckpt), "dpo")
    trainer = Trainer(cfg, DPORecipe(cfg.dpo, quiet=True), quiet=True)
    losses, logps = [], []

    def step() -> float:
        out = trainer.train_step(trainer.next_microbatches(trainer.train_data))
        losses.append(out["loss"])
        logps.append([out["logps/chosen"], out["logps/rejected"]])
        return losses[-1]

    return {**time_steps(step, args.warmup, args.steps), "losses": losses, "logps": logps}


def trl_worker(args) -> dict:
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in Path(args.pairs).read_text().splitlines()]
    config = DPOConfig(
        output_dir=str(Path(args.work) / "trl-run"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, max_steps=args.warmup + args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch", beta=0.1, loss_type=["sigmoid"],
        max_length=args.seq_length, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, bf16=False, fp16=False)
    walls, cpus, losses, logps, marks = [], [], [], [], {}

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks["t"], marks["c"] = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            walls.append(time.perf_counter() - marks["t"])
            cpus.append(time.process_time() - marks["c"])

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                logps.append([float(logs["logps/chosen"]), float(logs["logps/rejected"])])

    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer, callbacks=[Timer()])
    t0 = time.perf_counter()
    trainer.train()
    from tools.bench_steps import peak_rss_mb

    return {"walls": walls[args.warmup:], "cpus": cpus[args.warmup:], "warmup_s": sum(walls[:args.warmup]),
            "peak_rss_mb": peak_rss_mb(), "first_loss": losses[0], "last_loss": losses[-1], "losses": losses,
            "logps": logps, "total_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Hugging Face model directory (default: SmolLM2-135M if present, else tiny)")
    ap.add_argument("--trl-python", default=os.environ.get("MEGAPIPE_TRL_PYTHON", "/work/.venv-trl/bin/python"))
    ap.add_argument("--batch", type=int, default=4, help="pairs per step")
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--answer-words", type=int, default=24)
    ap.add_argument("--seq-length", type=int, default=256, help="megapipe's packed row, TRL's max_length")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--skip", choices=["trl", "megapipe"], default=None)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--pairs", help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fn = {"megapipe": megapipe_worker, "trl": trl_worker}[args.worker[0]]
        print(json.dumps(fn(args)))
        return

    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        work = Path(tmp)
        model = model_dir(args, work)
        pairs = make_pairs(work / "pairs.jsonl", args.batch, args.prompt_words, args.answer_words)
        # one batch is the whole set: every step of either side trains on the same pairs
        passthrough = ["--model", str(model), "--work", str(work), "--pairs", str(pairs), "--batch", str(args.batch),
                       "--seq-length", str(args.seq_length), "--steps", str(args.steps), "--warmup",
                       str(args.warmup), "--threads", str(args.threads), "--lr", str(args.lr)]
        env = {"OMP_NUM_THREADS": str(args.threads)}
        results = {}
        for side, python in (("megapipe", sys.executable), ("trl", args.trl_python)):
            if args.skip == side:
                continue
            if side == "trl" and not Path(python).is_file():
                print(f"trl: no Python at {python} (make the TRL venv, or pass --trl-python)", file=sys.stderr)
                continue
            out = run_worker(__file__, passthrough, side, python=python, env=env)
            if out is not None:
                results[side] = out
        print(f"DPO step, {model.name}: {args.batch} pairs of ~{args.prompt_words}+{args.answer_words} words, "
              f"{args.threads} threads, fp32 AdamW lr {args.lr}")
        for side, r in results.items():
            s = summarize([r])
            print(f"  {side:9s} {s['step']:.3f} s/step (CPU {s['cpu']:.3f} s), peak RSS {s['peak']:.0f} MB, "
                  f"losses {' '.join(f'{x:.5f}' for x in r['losses'][:args.warmup + 2])} ..., first log-probs "
                  f"{r['logps'][0][0]:.4f} / {r['logps'][0][1]:.4f}")
        if len(results) == 2:
            print(f"  megapipe vs TRL: {speed_ratio(summarize([results['megapipe']]), summarize([results['trl']]))}")


if __name__ == "__main__":
    main()
