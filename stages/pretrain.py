"""``megapipe pretrain``: Megatron-named flags -> the config tree -> megapipe.training.Trainer.

With ``--nproc-per-node N`` (and ``--nnodes``/``--node-rank``/``--rdzv-endpoint`` on several nodes) the command
re-runs itself under torchrun; under an existing torchrun/srun it joins the job. The layout is checked against the
world size, the model and the batch before any process starts.
"""

from __future__ import annotations

from typing import List, Optional

import typer

from megapipe.errors import ConfigError
from stages.common import CONFIG_OPTION, SET_OPTION, build_config, config_flags, multi_value_command

TRAINING_SECTIONS = ("model", "data", "train", "optim", "checkpoint", "parallel")


@config_flags(*TRAINING_SECTIONS)
def pretrain(
    ctx: typer.Context,
    config: Optional[str] = CONFIG_OPTION,
    bf16: bool = typer.Option(False, "--bf16", help="Same as --precision bf16."),
    fp16: bool = typer.Option(False, "--fp16", help="Same as --precision fp16."),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", help="Start this many processes here under torchrun (one per GPU)."
    ),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes of a multi-node run (every node runs the same command)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's index in [0, nnodes)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No console output but errors."),
    sets: Optional[List[str]] = SET_OPTION,
    flags: dict = None,
) -> None:
    """Pretrain a model on tokenized .bin/.idx data (Megatron's flag names)."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.training.recipes import PretrainRecipe

    cfg = training_config(config, flags, sets, bf16, fp16)
    launch_training(ctx, "pretrain", cfg, PretrainRecipe(), nproc_per_node, nnodes, node_rank, rdzv_endpoint, quiet)


def training_config(config: Optional[str], flags: dict, sets: Optional[list[str]], bf16: bool, fp16: bool):
    """The config of a training stage from its YAML, flags (--bf16/--fp16 included) and --set overrides."""
    if bf16 and fp16:
        raise ConfigError("--bf16 and --fp16 are both given: choose one")
    if (bf16 or fp16) and flags.get("train.precision") is not None:
        raise ConfigError("--precision and --bf16/--fp16 are both given: choose one")
    if bf16 or fp16:
        flags = {**flags, "train.precision": "bf16" if bf16 else "fp16"}
    cfg = build_config(config, flags, sets)
    if flags.get("parallel.pp_schedule") is not None and flags.get("parallel.pp_virtual_stages") is None:
        _default_virtual_stages(cfg.parallel)
    return cfg


def launch_training(ctx: typer.Context, command: str, cfg, recipe, nproc_per_node, nnodes, node_rank, rdzv_endpoint,
                    quiet: bool) -> None:
    """Check the run and its layout before any process starts, re-run under torchrun when asked, then train."""
    # lazy: not loaded by megapipe --help, which stays fast
    from megapipe.parallel.distributed import destroy_distributed
    from megapipe.parallel.launch import maybe_launch_torchrun, planned_world_size

    check_layout(cfg, planned_world_size(nproc_per_node, nnodes), recipe)
    argv = [*command.split(), *ctx.meta.get(ARGV_KEY, [])]
    rc = maybe_launch_torchrun(argv, nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    if rc is not None:
        raise typer.Exit(rc)
    run(cfg, quiet, recipe)
    destroy_distributed()  # only after a run that ended well: after an error other ranks may never get here


def _default_virtual_stages(pcfg) -> None:
    """--pp-schedule without --pp-virtual-stages: the stages per rank that schedule runs (2 for Interleaved1F1B)."""
    # lazy: not loaded by megapipe --help, which stays fast
    from megapipe.parallel.dims import SCHEDULE_STAGES_PER_RANK

    need = SCHEDULE_STAGES_PER_RANK[pcfg.pp_schedule]
    pcfg.pp_virtual_stages = need if need is not None else max(2, pcfg.pp_virtual_stages)


def check_layout(cfg, world_size: int, recipe=None):
    """Refuse an impossible run or layout for ``world_size`` processes before any starts (one sentence naming the
    key and the limit): the run is resolved as the trainer resolves it (megapipe.training.run.resolve_run).
    Returns the validated ParallelDims (no mesh)."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.parallel.dims import ParallelDims
    from megapipe.training.recipes import PretrainRecipe
    from megapipe.training.run import resolve_run

    recipe = recipe if recipe is not None else PretrainRecipe()
    run = resolve_run(cfg)
    recipe.check(run)
    c = run.cfg
    return ParallelDims.from_config(c.parallel, world_size, c.train, c.model, c.data.seq_length,
                                    recipe.packed_sequences(c))


def run(cfg, quiet: bool = False, recipe=None) -> dict:
    """Train with a built config (for launchers and tests that skip the flag parsing)."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.parallel.distributed import explain_collective_failure
    from megapipe.training.trainer import Trainer

    try:
        return Trainer(cfg, recipe, quiet=quiet).train()
    except RuntimeError as e:
        error = explain_collective_failure(e, cfg.parallel.timeout_s)
        if error is None:
            raise
        raise error from None


ARGV_KEY = "megapipe.pretrain.argv"


def training_command_class(command):
    """The command class of a training stage: multi-value flags (--data-path A B), and the raw arguments kept, since
    torchrun re-runs the command with them."""
    base = multi_value_command(*command.multi_value_flags)

    class TrainingCommand(base):
        def parse_args(self, ctx, args):
            ctx.meta[ARGV_KEY] = list(args)
            return super().parse_args(ctx, args)

    return TrainingCommand
