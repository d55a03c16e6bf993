"""`megapipe import hf` and `megapipe export hf`: Hugging Face checkpoints in and out (other formats join the
``import`` and ``export`` groups from their own modules: ``export trt`` in export_trt.py)."""

from __future__ import annotations

from typing import Optional

import typer

from stages.common import print_table


def _progress(description: str, quiet: bool):
    """A rich progress bar and the (done, total) callback that drives it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    # no bar on a pipe or file: a transient bar still leaves an empty line there
    bar = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   transient=True, disable=quiet or not Console().is_terminal)
    task = bar.add_task(description, total=None)
    return bar, lambda done, total: bar.update(task, completed=done, total=total)


def _summary(title: str, summary: dict, quiet: bool) -> None:
    if quiet:
        return

    def show(key, value) -> str:
        return f"{value:.1f} s" if key == "seconds" else f"{value:,}" if isinstance(value, int) else str(value)

    print_table(title, [(k, show(k, v)) for k, v in summary.items()])


def import_hf_command(
    hf_dir: str = typer.Argument(..., help="Hugging Face model directory: config.json, *.safetensors, tokenizer.json."),
    out_ckpt: str = typer.Argument(..., help="Checkpoint directory to write."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT_CKPT if it exists."),
    mtp_num_layers: Optional[int] = typer.Option(
        None, "--mtp-num-layers", help="Multi-token-prediction layers to import (DeepSeek-V3; default: all that "
                                       "config.json declares, 0: none)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Import a Hugging Face model (Llama, Qwen2, Qwen3, Mistral, GPT-2) as a megapipe checkpoint."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.checkpoint.hf import import_hf

    bar, progress = _progress("importing tensors", quiet)
    with bar:
        summary = import_hf(hf_dir, out_ckpt, overwrite=overwrite, progress=progress, mtp_num_layers=mtp_num_layers)
    notes = summary.pop("notes")
    if not quiet:
        for note in notes:
            typer.echo(f"note: {note[0].upper()}{note[1:]}.", err=True)
    _summary("import hf", summary, quiet)


def export_hf_command(
    ckpt: str = typer.Argument(..., help="megapipe checkpoint (or run directory: its newest checkpoint)."),
    out_dir: str = typer.Argument(..., help="Hugging Face model directory to write."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="bf16, fp16 or fp32 (default: the dtype the model was imported in, else bf16)."
    ),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Split the safetensors above this size."),
    tokenizer: Optional[str] = typer.Option(
        None, "--tokenizer", help="Tokenizer directory to ship (default: the checkpoint's tokenizer/)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT_DIR if it exists."),
    lora_adapter_only: bool = typer.Option(
        False, "--lora-adapter-only", help="LoRA checkpoints: write a peft adapter directory instead of the merged "
                                           "model (load it onto the exported base with peft)."),
    mxfp4: bool = typer.Option(
        False, "--mxfp4", help="GPT-OSS: write the expert weights as MXFP4 *_blocks / *_scales, the layout of the "
                               "published checkpoints (the rest in --dtype)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Export a checkpoint (any parallel layout) for transformers / vLLM: config, safetensors, tokenizer."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.checkpoint.hf import export_hf

    bar, progress = _progress("exporting tensors", quiet)
    with bar:
        summary = export_hf(ckpt, out_dir, dtype=dtype, max_shard_size=max_shard_size, tokenizer=tokenizer,
                            overwrite=overwrite, progress=progress, lora_adapter_only=lora_adapter_only,
                            mxfp4=mxfp4)
    _summary("export hf", summary, quiet)
