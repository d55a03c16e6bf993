"""``megapipe posttrain quantize CKPT --quant FORMAT --calib-data P --output CKPT2``: NVIDIA ModelOpt PTQ."""

from __future__ import annotations

from typing import Optional

import typer

from stages.common import print_table
from stages.hf import _progress


def quantize(
    ckpt: str = typer.Argument(..., help="Checkpoint (or run directory: its newest checkpoint) to quantize."),
    quant: str = typer.Option(..., "--quant", help="fp8, int8_sq (SmoothQuant), int4_awq, w4a8_awq or nvfp4 (GPU)."),
    calib_data: str = typer.Option(..., "--calib-data", help="Calibration data: a .bin/.idx prefix or a JSONL file."),
    output: str = typer.Option(..., "--output", "-o", help="Quantized checkpoint to write."),
    kv_cache_quant: Optional[str] = typer.Option(None, "--kv-cache-quant", help="Also quantize the KV cache: fp8."),
    calib_samples: int = typer.Option(512, "--calib-samples", help="Calibration windows."),
    calib_seq_len: int = typer.Option(512, "--calib-seq-len", help="Tokens per calibration window."),
    calib_batch_size: int = typer.Option(4, "--calib-batch-size", help="Windows per forward pass."),
    eval_iters: int = typer.Option(8, "--eval-iters", help="Batches for the perplexity before/after (0: skip)."),
    eval_data: Optional[str] = typer.Option(
        None, "--eval-data", help="Evaluation data (default: windows of --calib-data after the calibration ones)."),
    json_key: str = typer.Option("text", "--json-key", help="Text field of JSONL data."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ...; default: cuda if present."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --output if it exists."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
) -> None:
    """Quantize a checkpoint with NVIDIA ModelOpt (fake-quant; export it with `megapipe export trt`)."""
    # lazy: imports torch; megapipe --help stays fast
    from megapipe.posttrain.quantize import quantize_checkpoint

    bar, progress = _progress("calibrating", quiet)
    with bar:
        summary = quantize_checkpoint(
            ckpt, output, quant, calib_data, kv_cache=kv_cache_quant, calib_samples=calib_samples,
            seq_length=calib_seq_len, batch_size=calib_batch_size, eval_iters=eval_iters, eval_data=eval_data,
            json_key=json_key, device=device, overwrite=overwrite, progress=progress)
    if quiet:
        return
    rows = [("checkpoint", summary["checkpoint"]), ("format", summary["format"]),
            ("calibration", f"{summary['calibration']} in {summary['calibration_seconds']:.1f} s")]
    if "perplexity_before" in summary:
        rows += [("perplexity before", f"{summary['perplexity_before']:.4f}"),
                 ("perplexity after", f"{summary['perplexity_after']:.4f}"),
                 ("perplexity change", f"{100 * summary['perplexity_change']:+.2f} %"),
                 ("evaluated on", f"{summary['eval_tokens']:,} tokens")]
    rows.append(("total", f"{summary['seconds']:.1f} s"))
    print_table("posttrain quantize", rows)
