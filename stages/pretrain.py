"""``megapipe pretrain``: Megatron-named flags -> the config tree -> megapipe.training.Trainer.

With ``--nproc-per-node N`` (and ``--nnodes``/``--node-rank``/``--rdzv-endpoint`` on several nodes) the command
re-runs itself under torchrun; under an existing torchrun/srun it joins the job. The layout is checked against the
world size, the model and the batch before any process starts.
"""

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


class PPSchedule(str, Enum):
    GPipe = "GPipe"
    one_f_one_b = "1F1B"
    Interleaved1F1B = "Interleaved1F1B"
    ZBVZeroBubble = "ZBVZeroBubble"
    DualPipeV = "DualPipeV"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


def _value(x):
    return x.value if isinstance(x, Enum) else x


def pretrain(
    ctx: typer.Context,
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
    tp: Optional[int] = typer.Option(None, "--tp", "--tensor-model-parallel-size", help="Tensor parallel size."),
    pp: Optional[int] = typer.Option(None, "--pp", "--pipeline-model-parallel-size", help="Pipeline stages."),
    cp: Optional[int] = typer.Option(None, "--cp", "--context-parallel-size", help="Context parallel size."),
    dp_shard: Optional[int] = typer.Option(None, "--dp-shard", help="FSDP sharding size (-1: the rest, default)."),
    dp_replicate: Optional[int] = typer.Option(None, "--dp-replicate", help="Replicas (HSDP with --dp-shard)."),
    pp_schedule: Optional[PPSchedule] = typer.Option(None, "--pp-schedule", help="Pipeline schedule."),
    pp_virtual_stages: Optional[int] = typer.Option(
        None, "--pp-virtual-stages", help="Stages per pipeline rank (Interleaved1F1B; default: what the schedule needs)."
    ),
    pp_layer_split: Optional[str] = typer.Option(
        None, "--pp-layer-split", help="Layers per pipeline stage, comma-separated, e.g. 3,5."
    ),
    timeout_minutes: Optional[float] = typer.Option(
        None, "--distributed-timeout-minutes", help="A collective waiting longer than this fails (default 10)."
    ),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", help="Start this many processes here under torchrun (one per GPU)."
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes of a multi-node run (every node runs the same command)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's index in [0, nnodes)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous."),
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
        "parallel.tp": tp,
        "parallel.pp": pp,
        "parallel.cp": cp,
        "parallel.dp_shard": dp_shard,
        "parallel.dp_replicate": dp_replicate,
        "parallel.pp_schedule": _value(pp_schedule),
        "parallel.pp_virtual_stages": pp_virtual_stages,
        "parallel.pp_layer_split": _layer_split(pp_layer_split),
        "parallel.timeout_s": None if timeout_minutes is None else 60.0 * timeout_minutes,
    }
    cfg = build_config(config, flags, sets)
    if pp_schedule is not None and pp_virtual_stages is None:
        _default_virtual_stages(cfg.parallel)

    from megapipe.parallel.distributed import destroy_distributed
    from megapipe.parallel.launch import maybe_launch_torchrun, planned_world_size

    check_layout(cfg, planned_world_size(nproc_per_node, nnodes))
    argv = ["pretrain", *ctx.meta.get(ARGV_KEY, [])]
    rc = maybe_launch_torchrun(argv, nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    if rc is not None:
        raise typer.Exit(rc)
    run(cfg, quiet)
    destroy_distributed()  # only after a run that ended well: after an error other ranks may never get here


def _layer_split(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        from megapipe.errors import ConfigError

        raise ConfigError(f"--pp-layer-split {text!r} is not a comma-separated list of layer counts (e.g. 3,5)") from None


def _default_virtual_stages(pcfg) -> None:
    """--pp-schedule without --pp-virtual-stages: the stages per rank that schedule runs (2 for Interleaved1F1B)."""
    from megapipe.parallel.dims import SCHEDULE_STAGES_PER_RANK

    need = SCHEDULE_STAGES_PER_RANK[pcfg.pp_schedule]
    pcfg.pp_virtual_stages = need if need is not None else max(2, pcfg.pp_virtual_stages)


def check_layout(cfg, world_size: int):
    """Refuse an impossible layout for ``world_size`` processes before any starts (ConfigError naming the key and
    the limit). The model is the one the run will build: the checkpoint's when --load gives none, the vocabulary
    the tokenizer's. Returns the validated ParallelDims (no mesh)."""
    from megapipe.data.tokenizer import load_tokenizer
    from megapipe.parallel.dims import ParallelDims
    from megapipe.training.trainer import base_model_config, find_checkpoint, resolve_vocab

    _, parent = find_checkpoint(cfg.checkpoint)
    tok = cfg.data.tokenizer
    if tok is None and parent is not None and (parent / "tokenizer").is_dir():
        tok = parent / "tokenizer"
    model = base_model_config(cfg.model, parent)
    if model.vocab_size is None:
        model = resolve_vocab(model, load_tokenizer(tok) if tok is not None else None)
    return ParallelDims.from_config(cfg.parallel, world_size, cfg.train, model, cfg.data.seq_length)


def run(cfg, quiet: bool = False) -> dict:
    """Train with a built config (for launchers and tests that skip the flag parsing)."""
    from megapipe.parallel.distributed import explain_collective_failure
    from megapipe.training.trainer import Trainer

    try:
        return Trainer(cfg, quiet=quiet).train()
    except RuntimeError as e:
        error = explain_collective_failure(e, cfg.parallel.timeout_s)
        if error is None:
            raise
        raise error from None


ARGV_KEY = "megapipe.pretrain.argv"


def _command_class():
    """The multi-value command class, also keeping the raw arguments: torchrun re-runs the command with them."""
    base = multi_value_command("--data-path")

    class PretrainCommand(base):
        def parse_args(self, ctx, args):
            ctx.meta[ARGV_KEY] = list(args)
            return super().parse_args(ctx, args)

    return PretrainCommand


def register(app: typer.Typer) -> None:
    app.command("pretrain", cls=_command_class())(pretrain)
