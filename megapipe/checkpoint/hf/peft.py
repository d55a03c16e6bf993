"""A LoRA checkpoint's adapters as a peft adapter directory (``export hf --lora-adapter-only``).

``adapter_config.json`` + ``adapter_model.safetensors`` (fp32, peft's tensor names on the Hugging Face module names),
plus the tokenizer: what ``peft.PeftModel.from_pretrained`` loads onto the exported base model.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megapipe.checkpoint.dcp import dcp_load, verify_checkpoint
from megapipe.checkpoint.hf.base import adapter_for_arch
from megapipe.checkpoint.manifest import make_tmp_dir, read_manifest, resolve_checkpoint
from megapipe.checkpoint.safe_dcp import read_metadata
from megapipe.config import ModelConfig, from_dict
from megapipe.data.tokenizer import load_tokenizer
from megapipe.errors import CheckpointError, MegapipeError
from megapipe.fileio import refuse_overlap
from megapipe.models.lora import TARGETS, LoRASpec, adapter_names, is_adapter, present_targets

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_WEIGHTS_BIN = "adapter_model.bin"  # older peft's (torch.save), still what many published adapters hold


def write_peft_adapter(ckpt, out_dir, overwrite: bool = False, tokenizer_dir: Optional[Path] = None) -> dict:
    """The adapters of LoRA checkpoint ``ckpt`` as a peft adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors`` in fp32, the tokenizer); returns a summary."""
    from safetensors.torch import save_file

    out_dir, given = Path(out_dir).expanduser(), Path(ckpt).expanduser()
    refuse_overlap([out_dir], [given, tokenizer_dir])  # before --overwrite: the input may be a run directory
    if out_dir.exists() and not overwrite:
        raise MegapipeError(f"{out_dir} already exists: pick another output or pass --overwrite")
    ckpt = resolve_checkpoint(given)
    refuse_overlap([out_dir], [ckpt])
    manifest, spec, cfg, stored = _adapter_checkpoint(ckpt, "--lora-adapter-only needs a checkpoint of a --lora-rank run")
    adapter = adapter_for_arch(cfg.arch)
    names: dict[str, str] = {}  # megapipe adapter tensor -> peft key
    modules = set()  # the HF modules adapted, by their full names
    for conv in adapter.conversions(cfg):
        has = [m for m in conv.mp if adapter_names(m)[0] in stored]
        if not has:
            continue
        if len(conv.mp) != 1 or len(conv.hf) != 1:
            raise MegapipeError(
                f"{ckpt}: the {adapter.architecture} layer {conv.hf[0]} fuses {len(conv.mp)} megapipe layers, so "
                "its adapters have no peft equivalent; export the merged model instead (without --lora-adapter-only), "
                f"or train only targets peft can hold ({','.join(peft_targets(cfg)) or 'none'})")
        hf_module = adapter.module_name(conv.hf[0])
        modules.add(hf_module)
        for mp_name, part in zip(adapter_names(conv.mp[0]), ("lora_A", "lora_B"), strict=True):
            names[mp_name] = f"base_model.model.{hf_module}.{part}.weight"
    tensors = {names[k]: v.float().contiguous() for k, v in _load_adapters(ckpt, stored, names).items()}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout, "target_modules": exact_modules(modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "base_model_name_or_path": str(manifest.get("parent") or ""),
    }
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    make_tmp_dir(tmp, out_dir)
    try:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tok = tokenizer_dir if tokenizer_dir is not None else ckpt / "tokenizer"
        if Path(tok).is_dir():
            load_tokenizer(tok).save(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"output": str(out_dir), "adapters": len(tensors) // 2, "rank": spec.rank, "alpha": spec.alpha,
            "target_modules": ", ".join(sorted({m.rsplit(".", 1)[-1] for m in modules}))}


def _adapter_checkpoint(ckpt: Path, why: str) -> tuple[dict, LoRASpec, ModelConfig, dict]:
    """A LoRA checkpoint's manifest, LoRA spec, model config and the metadata of its adapter tensors (checked)."""
    manifest = read_manifest(ckpt)
    if not manifest.get("lora"):
        raise MegapipeError(f"{ckpt} holds no LoRA adapters (its manifest has no 'lora'): {why}")
    spec = LoRASpec.from_manifest(manifest["lora"])
    cfg = from_dict(ModelConfig, manifest["model"], "model.", f"{ckpt / 'megapipe.json'}: ")
    verify_checkpoint(ckpt, manifest, ["model/"])  # before its metadata is read
    stored = {k: m for k, m in read_metadata(ckpt / "model").state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata) and is_adapter(k)}
    return manifest, spec, cfg, stored


def _load_adapters(ckpt: Path, stored: dict, names) -> dict[str, torch.Tensor]:
    state = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in names}
    dcp_load(state, ckpt / "model", "model", strict=False)
    return state


def read_adapters(path, cfg: ModelConfig) -> tuple[int, float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The LoRA adapters of a peft adapter directory or of a megapipe LoRA checkpoint / run directory, for a base
    model of ``cfg``: (rank, scale alpha / rank, {megapipe weight name: (A [rank, in], B [out, rank])}), fp32."""
    path = Path(path).expanduser()
    if (path / ADAPTER_CONFIG).is_file():
        return _read_peft(path, cfg)
    if not path.exists():
        raise MegapipeError(f"LoRA adapter {path} does not exist (give a peft adapter directory or a LoRA run)")
    try:
        ckpt = resolve_checkpoint(path)
    except CheckpointError:
        raise MegapipeError(f"{path} is not a LoRA adapter: neither a peft adapter directory (it has no "
                            f"{ADAPTER_CONFIG}) nor a megapipe LoRA run or checkpoint") from None
    _, spec, _, stored = _adapter_checkpoint(ckpt, "give a checkpoint of a --lora-rank run or a peft directory")
    state = _load_adapters(ckpt, stored, list(stored))
    pairs = {}
    for name in stored:
        if ".lora_A." in name:
            base = name.replace(".lora_A.", ".").removesuffix(".weight") + ".weight"
            pairs[base] = (state[name].float(), state[adapter_names(base)[1]].float())
    return spec.rank, spec.scale, pairs


def _read_peft(path: Path, cfg: ModelConfig) -> tuple[int, float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    from safetensors.torch import load_file

    where = path / ADAPTER_CONFIG
    try:
        config = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise MegapipeError(f"{where} cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise MegapipeError(f"{where} must hold a JSON object, not {type(config).__name__}")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise MegapipeError(f"{where}: r = {rank!r} must be the adapter's rank, an integer >= 1")
    if config.get("peft_type", "LORA") != "LORA":
        raise MegapipeError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, plain in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none"),
                       ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {})):
        if config.get(key, plain) not in (plain, None, {}, False):
            raise MegapipeError(f"{where}: {key} = {config[key]!r} is not supported (only plain LoRA: {key} "
                                f"{plain!r})")
    weights = path / ADAPTER_WEIGHTS
    if weights.is_file():
        try:
            tensors = load_file(str(weights))
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError for a truncated or corrupt file
            raise MegapipeError(f"{weights} cannot be read as safetensors ({e})") from None
    elif (path / ADAPTER_WEIGHTS_BIN).is_file():
        weights = path / ADAPTER_WEIGHTS_BIN
        try:  # tensors only: a pickle that holds code is refused, not run
            tensors = torch.load(weights, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
            raise MegapipeError(f"{weights} cannot be read as tensors ({type(e).__name__}: {e})") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise MegapipeError(f"{weights} does not hold a dict of tensors")
    else:
        raise MegapipeError(f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} or {ADAPTER_WEIGHTS_BIN}")
    adapter = adapter_for_arch(cfg.arch)
    pairs, used = {}, set()
    for conv in adapter.conversions(cfg):
        if len(conv.mp) != 1 or len(conv.hf) != 1 or not conv.mp[0].endswith(".weight"):  # a bias: its module's
            continue
        module = f"base_model.model.{adapter.module_name(conv.hf[0])}"
        a, b = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
        if a in tensors and b in tensors:
            pairs[conv.mp[0]] = (tensors[a].float(), tensors[b].float())
            used |= {a, b}
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise MegapipeError(f"{weights}: tensor {unknown[0]} adapts no layer of this {cfg.arch} model that megapipe "
                            f"adapts ({len(unknown)} such tensors)")
    alpha = float(config.get("lora_alpha", rank))  # rsLoRA scales by alpha / sqrt(rank), plain LoRA by alpha / rank
    return rank, alpha / (rank ** 0.5 if config.get("use_rslora") else rank), pairs


def exact_modules(modules: set[str]) -> str:
    """peft's ``target_modules`` as a regular expression matching exactly the adapted modules (layer indices
    generalised): a list of short names would also match same-named modules that carry no adapter here, such as the
    fused experts transformers builds for an MoE layer, which peft then adapts from a random start."""
    shapes = sorted({re.sub(r"\.layers\.\d+\.", ".layers.LAYER.", m) for m in modules})
    return "^(" + "|".join(re.escape(m).replace("LAYER", r"\d+") for m in shapes) + ")$"


def peft_targets(cfg) -> list[str]:
    """The --lora-targets short names whose adapters a peft directory can hold for ``cfg``'s architecture (its HF
    layer is the one megapipe layer, not several fused, e.g. GPT-2's c_attn holds q, k and v)."""
    one_to_one = {conv.mp[0] for conv in adapter_for_arch(cfg.arch).conversions(cfg)
                  if len(conv.mp) == 1 and len(conv.hf) == 1}
    present = present_targets(cfg)
    return [t for t in present if any(f"layers.{i}.{path}.weight" in one_to_one
                                      for i in range(cfg.num_layers) for path in TARGETS[t])]
