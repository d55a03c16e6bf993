"""``megapipe export trt CKPT OUT``: TensorRT-LLM checkpoints (unified HF layout, or legacy trtllm-build rank files)."""

from __future__ import annotations

from typing import Optional

import typer

from stages.hf import _progress, _summary


def export_trt_command(
    ckpt: str = typer.Argument(..., help="megapipe checkpoint (quantized or not), or a run directory."),
    out_dir: str = typer.Argument(..., help="TensorRT-LLM checkpoint directory to write."),
    fmt: str = typer.Option("unified", "--format", help="unified (TRT-LLM >= 1.0, vLLM, SGLang) or legacy "
                                                        "(trtllm-build, TRT-LLM <= 1.2)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 or fp16 for the unquantized tensors "
                                                              "(default: the imported dtype, else bf16)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks (legacy: one rank file each)."),
    pp: int = typer.Option(1, "--pp", help="Pipeline stages (legacy)."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="unified: split the safetensors above this."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT_DIR if it exists and is not empty."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Export a checkpoint for TensorRT-LLM: `trtllm-serve OUT` / `LLM(model=OUT)`, or `trtllm-build`."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.checkpoint.trt import export_trt

    bar, progress = _progress("exporting", quiet)
    with bar:
        summary = export_trt(ckpt, out_dir, fmt, dtype=dtype, tp=tp, pp=pp, max_shard_size=max_shard_size,
                             overwrite=overwrite, progress=progress)
    _summary("export trt", summary, quiet)
