"""Helpers of the RL tests (tests/posttrain/rl): run configs, in-process runs, metrics records."""

from __future__ import annotations

from pathlib import Path

TINY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
            max_position_embeddings=256)


def rl_overrides(base: Path, save: Path, **rl) -> dict:
    """Dotted overrides of a small, fast run (4 prompts x 4 completions of <= 8 tokens, SGD-free AdamW)."""
    o = {
        "checkpoint.load": str(base), "checkpoint.save": str(save), "train.train_iters": 3,
        "train.micro_batch_size": 4, "train.lr": 1e-3, "train.log_interval": 1, "train.lr_decay_style": "constant",
        "rl.task": "arithmetic", "rl.prompts_per_step": 4, "rl.group_size": 4, "rl.max_completion_tokens": 8,
        "rl.max_prompt_tokens": 48,
    }
    o.update({k if "." in k else f"rl.{k}": v for k, v in rl.items()})
    return o


def make_config(base: Path, save: Path, **rl):
    from megapipe.config import load_config
    from megapipe.training.recipes.rl import rl_config

    return rl_config(load_config(None, rl_overrides(base, save, **rl)))


def train(cfg, **kw):
    """Run the config in this process; returns (summary, trainer)."""
    from megapipe.training.recipes.rl import RLRecipe
    from megapipe.training.trainer import Trainer

    trainer = Trainer(cfg, RLRecipe(cfg.rl), quiet=True, **kw)
    return trainer.train(), trainer


def records(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# metrics of a run's timing: the only values an exact resume or another layout may change
TIMING = ("tokens_per_s", "mfu", "weight_sync_s", "rollout_s", "logprob_s", "rollout_tokens_per_s")

_calls = 0


def has_e(prompts, completions, **fields):
    """A user reward (``--reward tests.helpers.rl:has_e``) that a random tiny model earns about half the time: 1 for
    a completion holding the letter e. With MEGAPIPE_TEST_HANG=FILE:N its N-th call writes FILE and then waits for
    the test to kill the process (a kill -9 placed at a known point of the run)."""
    import os
    import time

    global _calls
    _calls += 1
    hang = os.environ.get("MEGAPIPE_TEST_HANG")
    if hang:
        path, n = hang.rsplit(":", 1)
        if _calls == int(n):
            Path(path).write_text("hanging\n")
            time.sleep(600)
    return [1.0 if "e" in c else 0.0 for c in completions]
