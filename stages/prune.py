"""``megapipe posttrain prune CKPT --calib-data P --calib-samples N --output CKPT2``: Minitron-style structured
pruning from forward passes (megapipe.posttrain.prune). Recovery is ``posttrain distill`` with the original as the
teacher and the pruned checkpoint as the student."""

from __future__ import annotations

from typing import Optional

import typer

from stages.pretrain import ARGV_KEY
from stages.sft import NNODES, NODE_RANK, NPROC, RDZV


def prune(
    ctx: typer.Context,
    ckpt: str = typer.Argument(..., help="Checkpoint to prune (or a run directory: its newest checkpoint)."),
    output: str = typer.Option(..., "--output", help="Checkpoint directory to write."),
    calib_data: str = typer.Option(..., "--calib-data", help="Calibration data: a .bin/.idx PREFIX, or SFT records."),
    calib_samples: int = typer.Option(256, "--calib-samples", help="Calibration sequences (importance)."),
    valid_samples: int = typer.Option(64, "--valid-samples", help="Held-out sequences for the loss before/after."),
    target_params: Optional[float] = typer.Option(
        None, "--target-params", help="Keep this fraction (<= 1) or count of parameters: narrows hidden and FFN."),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="New hidden size (embedding channels)."),
    ffn: Optional[int] = typer.Option(None, "--ffn", help="New FFN (intermediate) size."),
    heads: Optional[int] = typer.Option(None, "--heads", help="New number of query heads."),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="New number of KV heads (GQA groups)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="New number of layers."),
    depth_metric: str = typer.Option("bi", "--depth-metric", help="Layer importance: bi (1 - cos(in, out)) or loss."),
    group_metric: str = typer.Option(
        "loss", "--group-metric", help="KV-group importance: loss (increase when removed) or norm (its heads' sum)."),
    importance: str = typer.Option("activation", "--importance", help="activation, or random (the baseline)."),
    seq_length: int = typer.Option(512, "--seq-length", help="Tokens per calibration sequence."),
    micro_batch_size: int = typer.Option(8, "--micro-batch-size", help="Sequences per forward pass."),
    split: str = typer.Option("969,30,1", "--split", help="train,valid,test weights: calibration from train."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="For SFT records: the template."),
    cache_dir: Optional[str] = typer.Option(None, "--data-cache-path", help="Index cache directory."),
    seed: int = typer.Option(1234, "--seed"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --output if it exists."),
    nproc_per_node: Optional[int] = NPROC,
    nnodes: int = NNODES,
    node_rank: int = NODE_RANK,
    rdzv_endpoint: Optional[str] = RDZV,
    json_output: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary table."),
) -> None:
    """Prune a checkpoint's width (hidden, FFN, heads, KV groups) and depth by activation importance."""
    import json

    # lazy: imports torch; megapipe --help stays fast
    from megapipe.parallel.distributed import destroy_distributed, init_distributed
    from megapipe.parallel.launch import maybe_launch_torchrun
    from megapipe.posttrain.prune import PruneTargets, ppl, prune_checkpoint

    rc = maybe_launch_torchrun(["posttrain", "prune", *ctx.meta.get(ARGV_KEY, [])], nproc_per_node, nnodes,
                               node_rank, rdzv_endpoint)
    if rc is not None:
        raise typer.Exit(rc)
    info = init_distributed()
    targets = PruneTargets(hidden, ffn, heads, kv_heads, layers, target_params)
    s = prune_checkpoint(ckpt, output, targets, calib_data, calib_samples, valid_samples, seq_length,
                         micro_batch_size, split, depth_metric, importance, seed, overwrite, cache_dir, chat_template,
                         group_metric)
    destroy_distributed()
    if info.rank != 0:
        return
    if json_output:
        typer.echo(json.dumps(s))
        return
    if quiet:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"posttrain prune -> {s['output']}", title_justify="left")
    for col in ("", "before", "after", "after / before"):
        table.add_column(col)
    pb, pa, lb, la = s["parameters_before"], s["parameters_after"], s["valid_loss_before"], s["valid_loss_after"]
    table.add_row("shape", s["shape_before"], s["shape_after"], "")
    table.add_row("parameters", f"{pb:,}", f"{pa:,}", f"{pa / pb:.3f}")
    table.add_row("validation loss", f"{lb:.4f}", f"{la:.4f}", f"{la / lb:.3f}")
    table.add_row("validation ppl", f"{ppl(lb):.2f}", f"{ppl(la):.2f}", f"{ppl(la) / ppl(lb):.3f}")
    Console().print(table)
    Console().print(f"importance {s['importance']}, layers by {s['depth_metric']}, kept layers {s['layers_kept']}; "
                    f"recover with: megapipe posttrain distill --teacher {s['input']} --student {s['output']} ...")


prune.multi_value_flags = ()
