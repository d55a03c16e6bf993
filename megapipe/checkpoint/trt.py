"""``megapipe export trt``: TensorRT-LLM checkpoints, unified (HF layout) or legacy (``trtllm-build`` rank files).

- ``unified`` (default): what TensorRT-LLM >= 1.0 loads directly (``trtllm-serve OUT``, ``LLM(model=OUT)``), and vLLM
  and SGLang too: Hugging Face safetensors + config.json + tokenizer + generation_config.json. A quantized checkpoint
  adds ``hf_quant_config.json`` and ``quantization_config`` in config.json, with the weights and scales laid out the
  way NVIDIA ModelOpt's ``export_hf_checkpoint`` writes them. An unquantized one is ``export hf``'s output.
- ``legacy``: config.json + ``rank{N}.safetensors`` per tp x pp rank for ``trtllm-build`` (TRT-LLM <= 1.2), the way
  ModelOpt's ``export_tensorrt_llm_checkpoint`` writes them (see trt_legacy).

GPT-OSS: unified only, its published Hugging Face layout (``export hf --mxfp4``: MXFP4 ``*_blocks`` / ``*_scales``
experts, the rest bf16), which TensorRT-LLM's PyTorch backend reads (``GptOssHfWeightMapper``, ``trtllm-serve OUT``).

MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE): unquantized, unified as ``export hf`` writes them and legacy; fp8
and int8_sq unified (per-expert HF names and scales), fp8 legacy (TensorRT-LLM's MoE plugin has no SmoothQuant mode).
INT4 experts are refused: ModelOpt's own exporter, which every export here is checked against, cannot write them.

Both read the DCP shards of any parallel layout one group of tensors (a layer) at a time (trt_source.Source), so
memory stays near one output shard, and write through trt_files. The writes go to a temporary sibling that is
renamed at the end: a failure leaves nothing behind.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import torch

from megapipe.checkpoint.hf.base import adapter_for_arch
from megapipe.checkpoint.hf.files import DTYPES, HF_DTYPE_NAMES
from megapipe.checkpoint.manifest import make_tmp_dir
from megapipe.checkpoint.trt_legacy import check_legacy, write_legacy
from megapipe.checkpoint.trt_source import AWQ, Source
from megapipe.checkpoint.trt_unified import check_unified, write_unified
from megapipe.errors import MegapipeError
from megapipe.fileio import refuse_overlap, replace_dir
from megapipe.models.capabilities import require

Progress = Optional[Callable[[int, int], None]]
FORMATS = ("unified", "legacy")
EXPORT_DTYPES = ("bf16", "fp16")


def check_blocks(src: Source) -> None:
    """INT4 weights are exported in whole 128-wide blocks along each linear's input (ModelOpt packs no partial ones)."""
    if src.fmt not in AWQ:
        return
    block, cfg = src.block_size(), src.cfg
    for name, width in (("hidden_size", cfg.hidden_size), ("heads x head_dim", cfg.num_heads * cfg.dim_per_head),
                        ("intermediate_size", cfg.intermediate_size)):
        if width % block:
            raise MegapipeError(f"{src.where}: {src.fmt} exports need linear inputs in whole {block}-wide INT4 blocks, "
                                f"but the model's {name} is {width}: TensorRT-LLM's INT4 kernels take no partial block "
                                "(quantize this model with fp8 or int8_sq)")


def check_gpt_oss(src: Source) -> None:
    """TensorRT-LLM's GPT-OSS model (tensorrt_llm/_torch/models/modeling_gpt_oss.py) windows the even layers and
    fixes the clamped SwiGLU's alpha and limit, whatever config.json says: a config it would run differently is
    refused."""
    cfg = src.cfg
    windowed, even = sorted(cfg.windowed_layers), list(range(0, cfg.num_layers, 2))
    if cfg.sliding_window is not None and windowed != even:
        raise MegapipeError(f"{src.where}: TensorRT-LLM's GPT-OSS model windows layers {even} (the even ones), but "
                            f"this model windows layers {windowed}: export it with `export hf` instead")
    for name, fixed in (("moe_swiglu_alpha", 1.702), ("moe_swiglu_limit", 7.0)):
        if getattr(cfg, name) != fixed:
            raise MegapipeError(f"{src.where}: model.{name} = {getattr(cfg, name)}, but TensorRT-LLM's GPT-OSS model "
                                f"fixes it at {fixed}: export it with `export hf` instead")


# --------------------------------------------------------------------------------------------------- entry point


def export_trt(
    ckpt: str | Path,
    out_dir: str | Path,
    fmt: str = "unified",
    dtype: Optional[str] = None,
    tp: int = 1,
    pp: int = 1,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: Progress = None,
) -> dict:
    """megapipe checkpoint (any layout, quantized or not) -> TensorRT-LLM checkpoint ``out_dir``; returns a summary."""
    started = time.perf_counter()
    out_dir = Path(out_dir).expanduser()
    if fmt not in FORMATS:
        raise MegapipeError(f"--format {fmt!r} is not supported (allowed: {', '.join(FORMATS)})")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise MegapipeError(f"--dtype {dtype!r} is not supported by TensorRT-LLM checkpoints "
                            f"(allowed: {', '.join(EXPORT_DTYPES)})")
    for name, value in (("--tp", tp), ("--pp", pp)):
        if value < 1:
            raise MegapipeError(f"{name} {value} must be at least 1")
    if fmt == "unified" and (tp, pp) != (1, 1):
        raise MegapipeError(f"--tp {tp} --pp {pp}: a unified checkpoint is one directory that TensorRT-LLM shards "
                            "itself when it loads it (trtllm-serve --tp_size/--pp_size); --tp/--pp apply to "
                            "--format legacy")
    src = Source(Path(ckpt).expanduser())
    require(src.cfg, "export_trt", src.where, trt=fmt)
    refuse_overlap([out_dir], [Path(ckpt).expanduser(), src.path])  # quantized or not, before --overwrite
    if out_dir.exists() and not overwrite and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise MegapipeError(f"{out_dir} already exists and is not empty: pick another output or pass --overwrite")
    if src.cfg.is_moe and src.fmt in AWQ:
        raise MegapipeError(f"{src.where}: an MoE checkpoint quantized with {src.fmt} has no TensorRT-LLM export in "
                            "megapipe: NVIDIA ModelOpt's own exporter, the reference megapipe's exports are checked "
                            "against, writes no INT4 experts for transformers' MoE models (quantize its parent "
                            f"{src.manifest.get('parent')} with fp8 or int8_sq to export it)")
    source_dtype = src.hf_extra.get("dtype")
    out_dtype = DTYPES[dtype or (source_dtype if source_dtype in EXPORT_DTYPES else "bf16")]

    if fmt == "unified":
        if src.cfg.arch == "gpt_oss":
            check_gpt_oss(src)
        if src.fmt is None:
            short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[out_dtype]
            return _unquantized_unified(src, out_dir, short, max_shard_size, progress, started)
        check_blocks(src)
        check_unified(src)
        writer = write_unified
    else:
        check_blocks(src)
        check_legacy(src, tp, pp)
        writer = write_legacy

    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    make_tmp_dir(tmp, out_dir)
    try:
        summary = writer(src, tmp, out_dtype, tp=tp, pp=pp, max_shard_size=max_shard_size, progress=progress)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"output": str(out_dir), "format": fmt, "architecture": adapter_for_arch(src.cfg.arch).architecture,
            "quantization": describe(src), "dtype": HF_DTYPE_NAMES[out_dtype], **summary,
            "seconds": time.perf_counter() - started}


def describe(src: Source) -> str:
    if src.fmt is None:
        return "none"
    return src.fmt + (f" + kv {src.kv_cache}" if src.kv_cache else "")


def _unquantized_unified(src: Source, out_dir: Path, dtype, max_shard_size, progress, started) -> dict:
    """An unquantized unified checkpoint is a Hugging Face directory: ``export hf`` writes it (GPT-OSS's with the
    experts in MXFP4, as TensorRT-LLM reads the published checkpoints)."""
    from megapipe.checkpoint.hf import export_hf

    summary = export_hf(src.path, out_dir, dtype=dtype, max_shard_size=max_shard_size, overwrite=True,
                        progress=progress, mxfp4=src.cfg.arch == "gpt_oss")
    summary.pop("output", None)
    summary.pop("seconds", None)
    return {"output": str(out_dir), "format": "unified", "quantization": "none", **summary,
            "seconds": time.perf_counter() - started}


