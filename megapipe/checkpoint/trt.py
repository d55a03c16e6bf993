"""``megapipe export trt``: TensorRT-LLM checkpoints, unified (HF layout) or legacy (``trtllm-build`` rank files).

- ``unified`` (default): what TensorRT-LLM >= 1.0 loads directly (``trtllm-serve OUT``, ``LLM(model=OUT)``), and vLLM
  and SGLang too: Hugging Face safetensors + config.json + tokenizer + generation_config.json. A quantized checkpoint
  adds ``hf_quant_config.json`` and ``quantization_config`` in config.json, with the weights and scales laid out the
  way NVIDIA ModelOpt's ``export_hf_checkpoint`` writes them. An unquantized one is ``export hf``'s output.
- ``legacy``: config.json + ``rank{N}.safetensors`` per tp x pp rank for ``trtllm-build`` (TRT-LLM <= 1.2), the way
  ModelOpt's ``export_tensorrt_llm_checkpoint`` writes them (see trt_legacy).

MoE checkpoints export unquantized (``posttrain quantize`` does not quantize their experts): unified as ``export hf``
writes them, legacy for Mixtral, Qwen2-MoE and Qwen3-MoE.

Both read the DCP shards of any parallel layout one group of tensors (a layer) at a time, so memory stays near one
output shard. The writes go to a temporary sibling that is renamed at the end: a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megapipe.checkpoint import quantized_linear as ql
from megapipe.checkpoint.dcp import dcp_load
from megapipe.checkpoint.hf.base import adapter_for_arch
from megapipe.checkpoint.hf.files import DTYPES, HF_DTYPE_NAMES, SINGLE, parse_size, shard_names, write_index
from megapipe.checkpoint.manifest import MANIFEST_NAME, make_tmp_dir, read_manifest, resolve_checkpoint
from megapipe.checkpoint.safe_dcp import read_metadata
from megapipe.config import ModelConfig, from_dict
from megapipe.errors import CheckpointError, MegapipeError
from megapipe.fileio import refuse_overlap, replace_dir

Progress = Optional[Callable[[int, int], None]]
FORMATS = ("unified", "legacy")
EXPORT_DTYPES = ("bf16", "fp16")
QUANT_ALGO = {"fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ"}
AWQ = ("int4_awq", "w4a8_awq")
LAYER_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


# --------------------------------------------------------------------------------------------------- the source


class Source:
    """A checkpoint to export: its config, quantization, and its tensors read a group at a time."""

    def __init__(self, ckpt: Path):
        self.path = resolve_checkpoint(ckpt)
        self.manifest = read_manifest(self.path)
        self.where = str(self.path / MANIFEST_NAME)
        if not isinstance(self.manifest.get("model"), dict):
            raise CheckpointError(f"{self.where} has no model config")
        self.cfg: ModelConfig = from_dict(ModelConfig, self.manifest["model"], "model.", f"{self.where}: ")
        self.stored = {k: m for k, m in read_metadata(self.path / "model").state_dict_metadata.items()
                       if isinstance(m, TensorStorageMetadata)}
        q = self.manifest.get("quantization") or None
        self.fmt: Optional[str] = q.get("format") if q else None
        self.kv_cache: Optional[str] = q.get("kv_cache") if q else None
        self.producer_version = _modelopt_version(q)
        self.enabled = _enabled_quantizers(q, self.cfg.num_layers) if q else {}
        hf = self.manifest.get("hf")
        self.hf_extra = hf if isinstance(hf, dict) else {}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The stored tensors ``names`` as plain tensors (whatever layout saved them)."""
        state = {n: torch.empty(tuple(self.stored[n].size), dtype=self.stored[n].properties.dtype) for n in names}
        if state:
            dcp_load(state, self.path / "model", "model", strict=False)
        return state

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        prefix = f"layers.{i}."
        return self.read([n for n in self.stored if n.startswith(prefix)])

    def block_size(self) -> int:
        return 128 if self.fmt in AWQ else 0

    def linear(self, state: dict, prefix: str, dtype: torch.dtype) -> Optional[ql.QLinear]:
        if f"{prefix}.weight" not in state:
            return None
        return ql.from_state(state, prefix, self.fmt, self.enabled, dtype, self.block_size())

    def kv_amax(self, state: dict, i: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        pre = f"layers.{i}.attention."
        return tuple(state.get(f"{pre}{q}_bmm_quantizer._amax") if self.enabled.get(f"{pre}{q}_bmm_quantizer") else None
                     for q in ("k", "v"))


def check_blocks(src: "Source") -> None:
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


def _modelopt_version(q: Optional[dict]) -> str:
    if not q:
        return ""
    return str((q.get("modelopt") or {}).get("modelopt_version") or "")


def _enabled_quantizers(q: dict, num_layers: int) -> dict[str, bool]:
    """quantizer name -> enabled, from the ModelOpt state in the manifest (its last mode is the final one)."""
    state = q.get("modelopt") or {}
    try:
        final = state["modes"][-1]["quantizers"]
        kinds = state["kinds"]
    except (KeyError, IndexError, TypeError):
        raise CheckpointError("the manifest's quantization.modelopt has no quantizer state") from None
    out = {}
    for name, kind in final.items():
        names = [name.replace("*", str(i), 1) for i in range(num_layers)] if name.startswith("layers.*.") else [name]
        for n in names:
            out[n] = not kinds[kind].get("_disabled", False)
    return out


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
    refuse_overlap([out_dir], [Path(ckpt).expanduser(), src.path])  # quantized or not, before --overwrite
    if out_dir.exists() and not overwrite and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise MegapipeError(f"{out_dir} already exists and is not empty: pick another output or pass --overwrite")
    if src.cfg.is_moe and src.fmt is not None:
        raise MegapipeError(f"{src.where}: a quantized MoE checkpoint ({src.fmt}) has no TensorRT-LLM export in "
                            "megapipe (its experts are not quantized): export its unquantized parent "
                            f"({src.manifest.get('parent')}) instead")
    source_dtype = src.hf_extra.get("dtype")
    out_dtype = DTYPES[dtype or (source_dtype if source_dtype in EXPORT_DTYPES else "bf16")]

    if fmt == "unified":
        if src.fmt is None:
            short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[out_dtype]
            return _unquantized_unified(src, out_dir, short, max_shard_size, progress, started)
        from megapipe.checkpoint.trt_unified import check_unified, write_unified

        check_blocks(src)
        check_unified(src)
        writer = write_unified
    else:
        from megapipe.checkpoint.trt_legacy import check_legacy, write_legacy

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
    """An unquantized unified checkpoint is a Hugging Face directory: ``export hf`` writes it."""
    from megapipe.checkpoint.hf import export_hf

    summary = export_hf(src.path, out_dir, dtype=dtype, max_shard_size=max_shard_size, overwrite=True,
                        progress=progress)
    summary.pop("output", None)
    summary.pop("seconds", None)
    return {"output": str(out_dir), "format": "unified", "quantization": "none", **summary,
            "seconds": time.perf_counter() - started}


# --------------------------------------------------------------------------------------------------- files


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=4) + "\n", encoding="utf-8")


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: Optional[dict] = None) -> None:
    """safetensors refuses tensors that share memory (a tied head, one shared scale): each gets its own copy."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    own = {}
    for name, t in tensors.items():
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        own[name] = t
    save_file(own, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)  # safetensors creates 0600 files; the other outputs follow the umask


class ShardWriter:
    """Safetensors shards of at most ``max_bytes``, written as tensor groups arrive (only one shard in memory)."""

    def __init__(self, directory: Path, max_shard_size: str | int):
        self.dir = directory
        self.max_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
        self.pending: dict[str, torch.Tensor] = {}
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        pending = sum(t.numel() * t.element_size() for t in self.pending.values())
        if self.pending and pending + size > self.max_bytes:
            self._flush()
        self.pending.update(tensors)
        self.total += size

    def _flush(self) -> None:
        path = self.dir / f".part-{len(self.parts):05d}.safetensors"
        save_safetensors(self.pending, path, metadata={"format": "pt"})
        self.parts.append((path, list(self.pending)))
        self.pending = {}

    def close(self) -> int:
        if self.pending or not self.parts:
            self._flush()
        names = shard_names(len(self.parts)) if len(self.parts) > 1 else [SINGLE]
        weight_map = {}
        for (path, keys), name in zip(self.parts, names, strict=True):
            path.rename(self.dir / name)
            weight_map.update({k: name for k in keys})
        if len(self.parts) > 1:
            write_index(self.dir, weight_map, self.total)
        return len(self.parts)
