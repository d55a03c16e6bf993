"""Hugging Face <-> megapipe checkpoints, one tensor group at a time.

Import reads config.json (normalised by the installed transformers, so its defaults apply), maps it to a
ModelConfig, streams the safetensors into a model built without initialisation and writes a megapipe checkpoint
(stage ``import-hf``). Export reads the DCP shards of any parallel layout a shard-full of tensors at a time and
writes config.json, safetensors (sharded past ``max_shard_size``), the tokenizer files and generation_config.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megapipe.checkpoint.dcp import checkpoint_tokenizer, dcp_load, verify_checkpoint, write_checkpoint
from megapipe.checkpoint.hf.base import Adapter, Conversion, adapter_for_arch, adapter_for_hf
from megapipe.checkpoint.hf.files import (
    DTYPES,
    HF_DTYPE_NAMES,
    SHORT,
    SafetensorsReader,
    parse_size,
    plan_shards,
    read_json,
    shard_names,
    write_index,
)
from megapipe.checkpoint.hf.fp8_blocks import DequantizingReader, block_fp8_config
from megapipe.checkpoint.hf.mxfp4 import QUANTIZATION_CONFIG, Mxfp4Reader, is_mxfp4, is_packed, pack_experts
from megapipe.checkpoint.hf.peft import write_peft_adapter
from megapipe.checkpoint.manifest import make_tmp_dir, read_manifest, resolve_checkpoint
from megapipe.checkpoint.safe_dcp import read_metadata
from megapipe.config import ModelConfig, from_dict
from megapipe.data.readers import first_line
from megapipe.data.tokenizer import load_tokenizer
from megapipe.errors import CheckpointError, MegapipeError
from megapipe.fileio import refuse_overlap, replace_dir
from megapipe.models import build_model
from megapipe.models.capabilities import describe, require
from megapipe.models.lora import LoRASpec, adapter_names, is_adapter, merge_state_dict

Progress = Optional[Callable[[int, int], None]]  # (done, total) after each tensor group
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# generation_config.json's sampling defaults, kept through import and export (serve applies them as vLLM does)
SAMPLING_FIELDS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def _names(names, limit: int = 5) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# --------------------------------------------------------------------------------------------------- config


def normalise_hf_config(raw: dict[str, Any], adapter: Adapter, where: str) -> dict[str, Any]:
    """config.json as the installed transformers reads it (its defaults filled in, old RoPE fields standardised)."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[adapter.model_type].from_dict(json_floats(raw, decode=True)).to_dict()
    except Exception as e:  # noqa: BLE001 - transformers validates with many exception types
        raise MegapipeError(f"{where} is not a valid {adapter.architecture} config ({e})") from None


# transformers writes the floats JSON has no number for as {"__float__": "Infinity"} (Falcon-H1's time_step_limit)
SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def json_floats(obj: Any, decode: bool) -> Any:
    """``obj`` with transformers' tagged non-finite floats decoded to floats (``decode``) or such floats encoded."""
    if isinstance(obj, dict):
        if decode and obj.keys() == {"__float__"} and obj["__float__"] in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[obj["__float__"]]
        return {k: json_floats(v, decode) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_floats(v, decode) for v in obj]
    if not decode and isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else "Infinity" if obj > 0 else "-Infinity"}
    return obj


def read_hf_config(hf_dir: Path) -> tuple[Adapter, ModelConfig, dict[str, Any]]:
    path = hf_dir / "config.json"
    raw = read_json(path, "config.json")
    if not isinstance(raw, dict):
        raise MegapipeError(f"{path} must hold a JSON object")
    adapter = adapter_for_hf(raw, str(path))
    hf = normalise_hf_config(raw, adapter, str(path))
    cfg = from_dict(ModelConfig, adapter.config_from_hf(hf, str(path)), "model.", f"{path}: ")
    return adapter, cfg, hf


def _tokenizer(path: Path, cfg: ModelConfig, where: str):
    tok = load_tokenizer(path)
    if tok.vocab_size > cfg.vocab_size:
        raise MegapipeError(
            f"{where}: the tokenizer has {tok.vocab_size} tokens but the model's embedding has only "
            f"{cfg.vocab_size} rows (vocab_size)"
        )
    return tok


class _TokenizerFiles:
    """What write_checkpoint copies: the tokenizer files only (not the whole HF directory), source recorded."""

    def __init__(self, tokenizer, source: Path):
        self.tokenizer, self.name_or_path = tokenizer, str(source.absolute())

    def save_pretrained(self, directory: str) -> None:
        self.tokenizer.save(directory)


# --------------------------------------------------------------------------------------------------- import


class HFModel(NamedTuple):
    adapter: Adapter
    cfg: ModelConfig
    hf: dict[str, Any]  # config.json as transformers normalises it
    tokenizer: Any
    model: torch.nn.Module
    reader: SafetensorsReader
    notes: list[str]  # one sentence each: what the import did that a user should know (dequantized, left out)


def load_hf_model(hf_dir: str | Path, progress: Progress = None, mtp_num_layers: Optional[int] = None) -> HFModel:
    """A Hugging Face model directory -> megapipe model (fp32, on CPU) in memory, with its config and tokenizer.
    ``mtp_num_layers``: how many of the checkpoint's multi-token-prediction layers to import (None: all that
    config.json declares; 0: none)."""
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise MegapipeError(f"Hugging Face model directory {hf_dir} does not exist")
    adapter, cfg, hf = read_hf_config(hf_dir)
    if not (hf_dir / "tokenizer.json").is_file():
        raise MegapipeError(f"{hf_dir} has no tokenizer.json (megapipe needs a fast Hugging Face tokenizer)")
    tok = _tokenizer(hf_dir, cfg, str(hf_dir))
    reader = SafetensorsReader(hf_dir)
    notes = []
    block = block_fp8_config(hf, str(hf_dir / "config.json"))
    if block is not None:
        reader = DequantizingReader(reader, block)
        notes.append(f"the FP8 weights (block-scaled {block[0]}x{block[1]}, weight_scale_inv or .scale) were "
                     "dequantized to fp32 on import")
    if is_mxfp4(hf):
        reader = Mxfp4Reader(reader)
        notes.append("the MXFP4 expert weights (*_blocks, *_scales: e2m1 values, one e8m0 scale per 32) were "
                     "dequantized to fp32 on import")
    cfg, left_out = adapter.fit(cfg, reader.names(), mtp_num_layers, str(hf_dir))
    notes += left_out
    file_name = {canon: name for name, canon in adapter.aliases(reader.names()).items()}
    conversions = adapter.conversions(cfg)
    _check_names(
        {h for c in conversions for h in c.hf},
        {n for n in file_name if not adapter.ignored(n, cfg)},
        f"the safetensors in {hf_dir}",
        f"the {adapter.architecture} config",
    )

    model = build_model(cfg, device="meta").to_empty(device="cpu")  # every value is overwritten below
    params = model.state_dict()
    with torch.no_grad():
        for done, conv in enumerate(conversions, 1):
            tensors = conv.to_mp([reader.get(file_name[h]) for h in conv.hf])
            for name, tensor in zip(conv.mp, tensors, strict=True):
                target = params[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise MegapipeError(
                        f"{hf_dir}: tensor {_names(conv.hf)} has shape {list(tensor.shape)} but config.json implies "
                        f"{list(target.shape)}"
                    )
                target.copy_(tensor)
            if progress:
                progress(done, len(conversions))
    if getattr(reader, "fp4", False):
        notes.append("the FP4 expert weights (e2m1, two a byte, one e8m0 scale per 32 values) were dequantized to "
                     "fp32 on import")
    return HFModel(adapter, cfg, hf, tok, model, reader, notes)


def import_hf(hf_dir: str | Path, out_ckpt: str | Path, overwrite: bool = False, progress: Progress = None,
              mtp_num_layers: Optional[int] = None) -> dict:
    """Hugging Face model directory -> megapipe checkpoint at ``out_ckpt``; returns a summary (``mtp_num_layers``:
    as in ``load_hf_model``)."""
    started = time.perf_counter()
    hf_dir, out_ckpt = Path(hf_dir).expanduser(), Path(out_ckpt).expanduser()
    if not hf_dir.is_dir():
        raise MegapipeError(f"Hugging Face model directory {hf_dir} does not exist")
    refuse_overlap([out_ckpt], [hf_dir])
    if out_ckpt.exists() and not overwrite:
        raise MegapipeError(f"{out_ckpt} already exists: pick another output or pass --overwrite")
    if mtp_num_layers is not None and mtp_num_layers < 0:
        raise MegapipeError(f"--mtp-num-layers {mtp_num_layers} must be >= 0 (0: leave the MTP layers out)")
    adapter, cfg, hf, tok, model, reader, notes = load_hf_model(hf_dir, progress, mtp_num_layers)

    generation = hf_dir / "generation_config.json"
    source_dtype = reader.dtype()
    extra = {
        "architecture": adapter.architecture,
        "dtype": SHORT.get(source_dtype),
        "generation_config": _token_ids(read_json(generation, "generation_config.json") if generation.is_file() else hf),
    }
    manifest = {"model": cfg, "stage": "import-hf", "parent": str(hf_dir.absolute()), "hf": extra}
    final = write_checkpoint(out_ckpt, model, step=0, manifest=manifest, tokenizer=_TokenizerFiles(tok, hf_dir))
    return {
        "checkpoint": str(final),
        "architecture": adapter.architecture,
        "tensors": len(reader.names()),
        "parameters": sum(p.numel() for p in model.parameters()),
        "source_dtype": str(source_dtype).replace("torch.", ""),
        "seconds": time.perf_counter() - started,
        "notes": notes,
    }


def _check_names(needed: set[str], found: set[str], where: str, reference: str) -> None:
    missing, unexpected = needed - found, found - needed
    if missing:
        raise MegapipeError(f"{where} lack tensors that {reference} needs: {_names(missing)}")
    if unexpected:
        raise MegapipeError(f"{where} hold tensors that {reference} has no place for: {_names(unexpected)}")


def _token_ids(config: Any) -> dict[str, Any]:
    """The token ids and sampling defaults of a generation config (or of config.json, which may hold the ids)."""
    config = config if isinstance(config, dict) else {}
    return {k: config[k] for k in TOKEN_FIELDS + SAMPLING_FIELDS if config.get(k) is not None}


# --------------------------------------------------------------------------------------------------- export


def export_hf(
    ckpt: str | Path,
    out_dir: str | Path,
    dtype: Optional[str] = None,
    max_shard_size: str | int = "5GB",
    tokenizer: Optional[str | Path] = None,
    overwrite: bool = False,
    progress: Progress = None,
    lora_adapter_only: bool = False,
    mxfp4: bool = False,
) -> dict:
    """megapipe checkpoint (any layout) -> Hugging Face directory ``out_dir``; returns a summary. A LoRA checkpoint
    is written merged, or with ``lora_adapter_only`` as a peft adapter directory (megapipe.checkpoint.hf.peft).
    ``mxfp4``: GPT-OSS's expert weights packed as the published checkpoints hold them (megapipe.checkpoint.hf.mxfp4),
    the rest in ``dtype``."""
    if lora_adapter_only and mxfp4:
        raise MegapipeError("--mxfp4 packs a whole model's experts and --lora-adapter-only writes adapters only: "
                            "pass one of them")
    if lora_adapter_only:
        return write_peft_adapter(ckpt, out_dir, overwrite, Path(tokenizer).expanduser() if tokenizer else None)
    started = time.perf_counter()
    out_dir = Path(out_dir).expanduser()
    given = Path(ckpt).expanduser()
    refuse_overlap([out_dir], [given, tokenizer])  # before resolving: the input may be a run directory
    if out_dir.exists() and not overwrite:
        raise MegapipeError(f"{out_dir} already exists: pick another output or pass --overwrite")
    if dtype is not None and dtype not in DTYPES:
        raise MegapipeError(f"--dtype {dtype!r} is not supported (allowed: {', '.join(DTYPES)})")
    max_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    ckpt = resolve_checkpoint(given)
    refuse_overlap([out_dir], [ckpt])
    manifest = read_manifest(ckpt)
    where = str(ckpt / "megapipe.json")
    if not isinstance(manifest.get("model"), dict):
        raise CheckpointError(f"{where} has no model config")
    if manifest.get("quantization"):
        fmt = manifest["quantization"].get("format") if isinstance(manifest["quantization"], dict) else None
        raise CheckpointError(
            f"{where}: the checkpoint is quantized ({fmt}) and `export hf` writes unquantized weights only: use "
            "`megapipe export trt CKPT OUT --format unified` for the quantized Hugging Face layout (hf_quant_config.json) "
            "that TensorRT-LLM, vLLM and SGLang load")
    cfg = from_dict(ModelConfig, manifest["model"], "model.", f"{where}: ")
    require(cfg, "export_hf", where)
    if mxfp4 and cfg.arch != "gpt_oss":
        raise MegapipeError(f"{where}: --mxfp4 writes the experts as the published GPT-OSS checkpoints pack them, and "
                            f"this is a {describe(cfg)} model: export it without --mxfp4")
    adapter = adapter_for_arch(cfg.arch)
    hf_cfg = adapter.hf_config(dataclasses.replace(cfg, num_labels=None))  # a classifier's head: below
    architecture, conversions, hf_cfg = _head(adapter, cfg, hf_cfg, manifest, where)
    hf_extra = manifest.get("hf") if isinstance(manifest.get("hf"), dict) else {}
    out_dtype = DTYPES[dtype or hf_extra.get("dtype") or "bf16"]

    tok_dir = Path(tokenizer).expanduser() if tokenizer is not None else checkpoint_tokenizer(ckpt, manifest)
    if tok_dir is None:
        raise CheckpointError(f"{ckpt} holds no tokenizer/ directory: pass --tokenizer with the model's tokenizer")
    tok = _tokenizer(tok_dir, cfg, str(tok_dir))
    verify_checkpoint(ckpt, manifest, ["model/"])

    stored = {
        k: m for k, m in read_metadata(ckpt / "model").state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)
    }
    lora = _lora_scale(manifest)
    weights = {k for k in stored if lora is None or not is_adapter(k)}
    _check_names({m for c in conversions for m in c.mp}, weights, f"the model shards of {ckpt}", "model config")
    itemsize = torch.empty((), dtype=out_dtype).element_size()
    packed = [mxfp4 and any(is_packed(h) for h in c.hf) for c in conversions]  # 4 bits a value + a byte per 32
    sizes = [sum(stored[m].size.numel() for m in c.mp) * (17 / 32 if p else itemsize)
             for c, p in zip(conversions, packed, strict=True)]
    sizes = [int(size) for size in sizes]
    plan = plan_shards(sizes, max_bytes)
    files = shard_names(len(plan))

    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    make_tmp_dir(tmp, out_dir)
    try:
        weight_map: dict[str, str] = {}
        done = 0
        for file, items in zip(files, plan, strict=True):
            group = [conversions[i] for i in items]
            tensors = _read_group(group, stored, ckpt / "model", out_dtype, lora, mxfp4)
            _save_safetensors(tensors, tmp / file)
            weight_map.update({name: file for name in tensors})
            done += len(group)
            if progress:
                progress(done, len(conversions))
            del tensors
        if len(files) > 1:
            write_index(tmp, weight_map, sum(sizes))
        tokens = _write_tokenizer(tok, tmp)
        generation = {**tokens, **_token_ids(hf_extra.get("generation_config"))}
        config = {"architectures": [architecture], **generation, **hf_cfg,
                  "dtype": HF_DTYPE_NAMES[out_dtype], "torch_dtype": HF_DTYPE_NAMES[out_dtype],
                  **({"quantization_config": QUANTIZATION_CONFIG} if mxfp4 else {})}
        _write_json(tmp / "config.json", json_floats(config, decode=False))
        _write_json(tmp / "generation_config.json", generation)
        replace_dir(tmp, out_dir)
    except OSError as e:  # disk full, file-size limit: name the file; OUT_DIR is as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise MegapipeError(f"cannot write {out_dir}: writing {e.filename or tmp} failed ({e.strerror or e}); "
                            "nothing was kept") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "output": str(out_dir),
        "architecture": architecture,
        "dtype": HF_DTYPE_NAMES[out_dtype],
        **({"quantization": "mxfp4 (experts)"} if mxfp4 else {}),
        "tensors": len(weight_map),
        "shards": len(files),
        "bytes": sum(sizes),
        "seconds": time.perf_counter() - started,
    }


def _head(adapter: Adapter, cfg: ModelConfig, hf_cfg: dict, manifest: dict, where: str):
    """(architecture, conversions, config) of the export: a language model's, or a sequence classifier's (a reward
    model, ``model.num_labels``): transformers' ...ForSequenceClassification, the head named ``score``, the pad token
    the scores were read by (the last token that is not it)."""
    conversions = adapter.conversions(cfg)
    if not cfg.num_labels:
        return adapter.architecture, conversions, hf_cfg
    import transformers

    architecture = adapter.architecture.replace("ForCausalLM", "ForSequenceClassification")
    if not hasattr(transformers, architecture):
        raise MegapipeError(f"{where}: the checkpoint is a sequence classifier (model.num_labels = {cfg.num_labels}) "
                            f"and transformers has no {architecture} to export it as")
    head = ("output.weight",)
    conversions = [c for c in conversions if c.mp != head] + [Conversion(hf=("score.weight",), mp=head)]
    labels = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
    hf_cfg = {**hf_cfg, "num_labels": cfg.num_labels, "id2label": labels,
              "label2id": {v: int(k) for k, v in labels.items()}}
    pad = (manifest.get("reward_model") or {}).get("pad_id")
    if pad is not None:
        hf_cfg["pad_token_id"] = pad
    return architecture, conversions, hf_cfg


def _lora_scale(manifest: dict) -> Optional[float]:
    """alpha / rank of a LoRA checkpoint's adapters (None: no LoRA)."""
    if not manifest.get("lora"):
        return None
    return LoRASpec.from_manifest(manifest["lora"]).scale


def _read_group(group: list[Conversion], stored: dict, model_dir: Path, out_dtype,
                lora: Optional[float] = None, mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """Load the megapipe tensors of ``group`` from DCP (as plain tensors, whatever layout saved them), convert them;
    with ``lora`` (the adapters' scale) each weight's adapters are loaded too and merged into it; with ``mxfp4`` the
    expert weights are packed (from the stored values, not from ``out_dtype``'s)."""
    names = [m for c in group for m in c.mp]
    if lora is not None:
        names += [a for m in list(names) for a in adapter_names(m) if a in stored]
    state = {m: torch.empty(tuple(stored[m].size), dtype=stored[m].properties.dtype) for m in names}
    dcp_load(state, model_dir, "model", strict=False)
    if lora is not None:
        state = merge_state_dict(state, lora)
    out: dict[str, torch.Tensor] = {}
    for conv in group:
        for name, tensor in zip(conv.hf, conv.to_hf([state.pop(m) for m in conv.mp]), strict=True):
            if mxfp4 and is_packed(name):
                out.update(pack_experts(name, tensor))
            else:
                out[name] = tensor.to(out_dtype).contiguous()
    return out


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:  # its I/O errors (disk full, file-size limit) come as this type
        raise OSError(None, first_line(e), str(path)) from None
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)  # safetensors creates 0600 files; the other outputs follow the umask


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(tok, out: Path) -> dict[str, int]:
    """Write the tokenizer files; tokenizer_config.json carries the chat template and a class name that both
    transformers 4 and 5 know. Returns the special token ids (bos/eos/pad) for config.json."""
    tok.save(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    template = out / "chat_template.jinja"
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text(encoding="utf-8")
    if config.get("tokenizer_class") in (None, "TokenizersBackend"):
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(config_path, config)
    ids = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and tok.token_to_id(value) is not None:
            ids[f"{key}_id"] = tok.token_to_id(value)
    ids.setdefault("eos_token_id", tok.eod_id)
    if tok.pad_id is not None:
        ids.setdefault("pad_token_id", tok.pad_id)
    return {k: v for k, v in ids.items() if v is not None}
