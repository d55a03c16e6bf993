"""``megapipe pretrain``: Megatron-named flags -> the config tree -> megapipe.training.Trainer."""

from __future__ import annotations

from enum import Enum
from typing import List, Optional

import typer

from stages.common import CONFIG_OPTION, SET_OPTION, build_config, multi_value_command

ORDER = 30


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class DecayStyle(str, Enum):
    cosine = "cosine"
    linear = "linear"
    wsd = "wsd"
    constant = "constant"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


def _value(x):
    return x.value if isinstance(x, Enum) else x


def pretrain(
    config: Optional[str] = CONFIG_OPTION,
    data_path: Optional[List[str]] = typer.Option(
        None, "--data-path", help="Data PREFIX, or a blend: --data-path 0.7 PREFIX_A 0.3 PREFIX_B."
    ),
    split: Optional[str] = typer.Option(None, "--split", help="train,valid,test weights, e.g. 969,30,1."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer directory or tokenizer.json."),
    model: Optional[str] = typer.Option(None, "--model", help="Model preset (tiny, llama3-1b, ...); --set model.*=."),
    seq_length: Optional[int] = typer.Option(None, "--seq-length"),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size"),
    global_batch_size: Optional[int] = typer.Option(None, "--global-batch-size"),
    train_iters: Optional[int] = typer.Option(None, "--train-iters"),
    train_tokens: Optional[int] = typer.Option(None, "--train-tokens", help="Instead of --train-iters."),
    lr: Optional[float] = typer.Option(None, "--lr"),
    min_lr: Optional[float] = typer.Option(None, "--min-lr"),
    lr_warmup_iters: Optional[int] = typer.Option(None, "--lr-warmup-iters"),
    lr_decay_iters: Optional[int] = typer.Option(None, "--lr-decay-iters", help="Default: --train-iters."),
    lr_decay_style: Optional[DecayStyle] = typer.Option(None, "--lr-decay-style"),
    weight_decay: Optional[float] = typer.Option(None, "--weight-decay"),
    clip_grad: Optional[float] = typer.Option(None, "--clip-grad", help="Max total gradient norm (0: no clipping)."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    precision: Optional[Precision] = typer.Option(None, "--precision"),
    bf16: bool = typer.Option(False, "--bf16", help="Same as --precision bf16."),
    fp16: bool = typer.Option(False, "--fp16", help="Same as --precision fp16."),
    save: Optional[str] = typer.Option(None, "--save", help="Run directory for checkpoints and metrics."),
    save_interval: Optional[int] = typer.Option(None, "--save-interval"),
    load: Optional[str] = typer.Option(None, "--load", help="Resume from the newest complete checkpoint here."),
    finetune: Optional[bool] = typer.Option(None, "--finetune", help="With --load: weights only, a new run."),
    eval_interval: Optional[int] = typer.Option(None, "--eval-interval"),
    eval_iters: Optional[int] = typer.Option(None, "--eval-iters"),
    log_interval: Optional[int] = typer.Option(None, "--log-interval"),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", help="metrics.jsonl + TensorBoard (default: --save)."),
    recompute: Optional[Recompute] = typer.Option(None, "--recompute", help="Activation recompute."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile each block."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No console output but errors."),
    sets: Optional[List[str]] = SET_OPTION,
) -> None:
    """Pretrain a model on tokenized .bin/.idx data (Megatron's flag names)."""
    from megapipe.errors import ConfigError

    if bf16 and fp16:
        raise ConfigError("--bf16 and --fp16 are both given: choose one")
    if (bf16 or fp16) and precision is not None:
        raise ConfigError("--precision and --bf16/--fp16 are both given: choose one")
    flags = {
        "data.data_path": list(data_path) if data_path else None,
        "data.split": split,
        "data.tokenizer": tokenizer,
        "data.seq_length": seq_length,
        "model.preset": model,
        "train.micro_batch_size": micro_batch_size,
        "train.global_batch_size": global_batch_size,
        "train.train_iters": train_iters,
        "train.train_tokens": train_tokens,
        "train.lr": lr,
        "train.min_lr": min_lr,
        "train.lr_warmup_iters": lr_warmup_iters,
        "train.lr_decay_iters": lr_decay_iters,
        "train.lr_decay_style": _value(lr_decay_style),
        "train.seed": seed,
        "train.precision": "bf16" if bf16 else "fp16" if fp16 else _value(precision),
        "train.eval_interval": eval_interval,
        "train.eval_iters": eval_iters,
        "train.log_interval": log_interval,
        "train.log_dir": log_dir,
        "train.recompute": _value(recompute),
        "train.compile": compile,
        "optim.weight_decay": weight_decay,
        "optim.clip_grad": clip_grad,
        "checkpoint.save": save,
        "checkpoint.save_interval": save_interval,
        "checkpoint.load": load,
        "checkpoint.finetune": finetune,
    }
    cfg = build_config(config, flags, sets)
    run(cfg, quiet)


def run(cfg, quiet: bool = False) -> dict:
    """Train with a built config (for launchers and tests that skip the flag parsing)."""
    from megapipe.training.trainer import Trainer

    return Trainer(cfg, quiet=quiet).train()


def register(app: typer.Typer) -> None:
    app.command("pretrain", cls=multi_value_command("--data-path"))(pretrain)
