"""LoRA: low-rank adapters on a megapipe model's linear layers, in peft's layout.

Each targeted ``nn.Linear`` stays where it is (so the base weights keep their names, and checkpoints, FSDP and the
HF names are unchanged) and gets two child layers, ``lora_A`` [rank, in] and ``lora_B`` [out, rank], plus a forward
hook adding ``lora_B(lora_A(dropout(x))) * alpha / rank`` to its output; every other weight is frozen. Initialised
as peft does by default (A: Kaiming-uniform with a = sqrt(5), B: zeros), so training starts from the base model.
Dropout only acts while gradients are on, so evaluation (under no_grad) sees the adapters without it.

In the shared checkpoint format the adapters are extra tensors (``layers.3.attention.wq.lora_A.weight``) and the
manifest's ``lora`` field holds their config; ``merge_state_dict`` folds them into the base weights
(W + alpha / rank * B @ A), which is what inference loads and ``export hf`` writes by default;
``write_peft_adapter`` writes a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
that ``peft.PeftModel.from_pretrained`` loads onto the exported base model.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from megapipe.errors import ConfigError, MegapipeError

# --lora-targets short names -> the block's submodules (peft's names on the HF side: q_proj ... down_proj)
TARGETS = {
    "q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
    "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2",
}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # short names, in TARGETS order

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_manifest(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}

    @classmethod
    def from_manifest(cls, d: dict) -> "LoRASpec":
        return cls(int(d["rank"]), float(d["alpha"]), float(d.get("dropout", 0.0)), tuple(d["targets"]))


def parse_targets(text: str, model_cfg) -> tuple[str, ...]:
    """``all-linear`` (every projection the model has) or ``q,k,v,...``; unknown or absent names are errors."""
    has_up = model_cfg.activation == "swiglu"
    present = [t for t in TARGETS if t != "up" or has_up]
    if text.strip() == "all-linear":
        return tuple(present)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ConfigError(f"lora.targets (--lora-targets) {text!r} names no layer (all-linear or "
                          f"{','.join(TARGETS)})")
    for n in names:
        if n not in TARGETS:
            raise ConfigError(f"lora.targets (--lora-targets) has unknown layer {n!r} (allowed: all-linear or "
                              f"{','.join(TARGETS)})")
        if n not in present:
            raise ConfigError(f"lora.targets (--lora-targets) names {n!r}, which a {model_cfg.activation} MLP "
                              "does not have")
    return tuple(t for t in TARGETS if t in names)


def lora_spec(cfg) -> Optional[LoRASpec]:
    """The LoRA of a run's config (``cfg.lora``, model resolved), or None when ``lora.rank`` is 0."""
    lo = cfg.lora
    if lo.rank == 0:
        return None
    return LoRASpec(lo.rank, float(lo.alpha if lo.alpha is not None else lo.rank), lo.dropout,
                    parse_targets(lo.targets, cfg.model))


def check_lora_run(cfg, resume, parent) -> None:
    """Refusals before launch: layouts LoRA cannot run in yet, and parents whose adapters would be lost."""
    from megapipe.checkpoint import read_manifest

    spec = lora_spec(cfg)
    if spec is not None and cfg.parallel.tp > 1:
        raise ConfigError("LoRA (--lora-rank) with tensor parallelism (--tensor-model-parallel-size "
                          f"{cfg.parallel.tp}) is not supported yet: use data parallelism (FSDP or DDP) instead")
    if parent is None:
        return
    had = read_manifest(parent).get("lora")
    if resume is not None:
        want = spec.to_manifest() if spec else None
        if had != want:
            raise ConfigError(f"{resume} was trained with LoRA {had} but this run asks for {want}: resume with the "
                              "same --lora-* flags, or start a new --save directory")
    elif had:
        raise ConfigError(f"{parent} holds LoRA adapters: export it merged (megapipe export hf) and import that, "
                          "or resume its run with the same --lora-* flags")


# --------------------------------------------------------------------------------------------------- modules


def _add(module: nn.Linear, spec: LoRASpec, generator: Optional[torch.Generator]) -> None:
    w = module.weight
    module.lora_A = nn.Linear(module.in_features, spec.rank, bias=False, device=w.device, dtype=w.dtype)
    module.lora_B = nn.Linear(spec.rank, module.out_features, bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        nn.init.kaiming_uniform_(module.lora_A.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(module.lora_B.weight)
    module.lora_scale = spec.scale
    module.lora_dropout = spec.dropout
    module._lora_hook = module.register_forward_hook(_lora_forward)


def _lora_forward(module, args, output):
    x = args[0]
    if module.lora_dropout and module.training and torch.is_grad_enabled():
        x = nn.functional.dropout(x, module.lora_dropout)
    return output + module.lora_B(module.lora_A(x)) * module.lora_scale


def lora_layers(model: nn.Module):
    """(name, linear) of every layer carrying adapters."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and hasattr(m, "lora_A")]


def apply_lora(model: nn.Module, spec: LoRASpec, seed: Optional[int] = None) -> nn.Module:
    """Freeze ``model`` and add adapters to the targeted layers of every block (in place; returns the model)."""
    for p in model.parameters():
        p.requires_grad_(False)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for block in model.layers.values():
        for t in spec.targets:
            _add(block.get_submodule(TARGETS[t]), spec, generator)
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold the adapters into the base weights and remove them (in place)."""
    for _, m in lora_layers(model):
        delta = (m.lora_B.weight.float() @ m.lora_A.weight.float()) * m.lora_scale
        m.weight.add_(delta.to(m.weight.dtype))
        m._lora_hook.remove()
        del m.lora_A, m.lora_B
        for name in ("lora_scale", "lora_dropout", "_lora_hook"):
            delattr(m, name)
    return model


def load_base_weights(ckpt, model: nn.Module) -> None:
    """Load checkpoint ``ckpt``'s weights into a model whose new adapters it does not hold (any layout)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from megapipe.checkpoint.dcp import dcp_load
    from megapipe.checkpoint.manifest import resolve_checkpoint

    ckpt = resolve_checkpoint(ckpt)
    state = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}
    dcp_load(state, ckpt / "model", "model")
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def adapter_names(weight_name: str) -> tuple[str, str]:
    """``X.weight`` -> (``X.lora_A.weight``, ``X.lora_B.weight``)."""
    base = weight_name.removesuffix(".weight")
    return f"{base}.lora_A.weight", f"{base}.lora_B.weight"


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@torch.no_grad()
def merge_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state dict with adapters -> the merged base weights (adapter tensors removed), computed in fp32."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for name, w in list(out.items()):
        a, b = adapter_names(name)
        if a in state:
            out[name] = (w.float() + (state[b].float() @ state[a].float()) * scale).to(w.dtype)
    return out


# --------------------------------------------------------------------------------------------------- peft export


def write_peft_adapter(ckpt, out_dir, overwrite: bool = False, tokenizer_dir: Optional[Path] = None) -> dict:
    """The adapters of LoRA checkpoint ``ckpt`` as a peft adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors`` in fp32, the tokenizer); returns a summary."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megapipe.checkpoint.dcp import dcp_load
    from megapipe.checkpoint.hf.base import adapter_for_arch
    from megapipe.checkpoint.manifest import make_tmp_dir, read_manifest, resolve_checkpoint
    from megapipe.checkpoint.safe_dcp import read_metadata
    from megapipe.config import ModelConfig, from_dict

    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and not overwrite:
        raise MegapipeError(f"{out_dir} already exists: pick another output or pass --overwrite")
    ckpt = resolve_checkpoint(Path(ckpt).expanduser())
    manifest = read_manifest(ckpt)
    if not manifest.get("lora"):
        raise MegapipeError(f"{ckpt} holds no LoRA adapters (its manifest has no 'lora'): --lora-adapter-only "
                            "needs a checkpoint of a --lora-rank run")
    spec = LoRASpec.from_manifest(manifest["lora"])
    cfg = from_dict(ModelConfig, manifest["model"], "model.", f"{ckpt / 'megapipe.json'}: ")
    adapter = adapter_for_arch(cfg.arch)
    stored = {k: m for k, m in read_metadata(ckpt / "model").state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata) and is_adapter(k)}
    names: dict[str, str] = {}  # megapipe adapter tensor -> peft key
    modules = set()
    for conv in adapter.conversions(cfg):
        has = [m for m in conv.mp if adapter_names(m)[0] in stored]
        if not has:
            continue
        if len(conv.mp) != 1 or len(conv.hf) != 1:
            raise MegapipeError(
                f"{ckpt}: the {adapter.architecture} layer {conv.hf[0]} fuses {len(conv.mp)} megapipe layers, so "
                "its adapters have no peft equivalent; export the merged model instead (without --lora-adapter-only)")
        hf_module = conv.hf[0].removesuffix(".weight")
        modules.add(hf_module.rsplit(".", 1)[-1])
        for mp_name, part in zip(adapter_names(conv.mp[0]), ("lora_A", "lora_B"), strict=True):
            names[mp_name] = f"base_model.model.{hf_module}.{part}.weight"
    state = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in names}
    dcp_load(state, ckpt / "model", "model", strict=False)
    tensors = {names[k]: v.float().contiguous() for k, v in state.items()}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout, "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
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
            from megapipe.data.tokenizer import load_tokenizer

            load_tokenizer(tok).save(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"output": str(out_dir), "adapters": len(tensors) // 2, "rank": spec.rank, "alpha": spec.alpha,
            "target_modules": ", ".join(sorted(modules))}
