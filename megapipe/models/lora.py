"""LoRA: low-rank adapters on a megapipe model's linear layers, in peft's layout (the module surgery).

Each targeted ``nn.Linear`` stays where it is (so the base weights keep their names, and checkpoints, FSDP and the
HF names are unchanged) and gets two child layers, ``lora_A`` [rank, in] and ``lora_B`` [out, rank], plus a forward
hook adding ``lora_B(lora_A(dropout(x))) * alpha / rank`` to its output; every other weight is frozen. Initialised
as peft does by default (A: Kaiming-uniform with a = sqrt(5), B: zeros), so training starts from the base model.
Dropout only acts while gradients are on, so evaluation (under no_grad) sees the adapters without it.

In the shared checkpoint format the adapters are extra tensors (``layers.3.attention.wq.lora_A.weight``) and the
manifest's ``lora`` field holds their config; ``merge_state_dict`` folds them into the base weights
(W + alpha / rank * B @ A), which is what inference loads and ``export hf`` writes by default
(megapipe.checkpoint.hf.peft writes them as a peft adapter directory instead). A run's LoRA settings and its
refusals are post-training's: megapipe.posttrain.lora.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from megapipe.errors import ConfigError
from megapipe.models.capabilities import capabilities, describe

# --lora-targets short names -> the block submodules they name, the first a block has (peft's names on the HF
# side: q_proj ... down_proj). In an MoE block the MLP names are its shared expert's; the router and the routed
# experts (3-D weights) are never adapted. Multi-latent attention (megapipe.models.mla) has no k / v: its "q" is the
# query projection or, under a q bottleneck, its up projection wq_b (DeepSeek's q_b_proj), "q_a" that bottleneck's
# down projection wq_a (q_a_proj), "kv_a" the latent's down projection wkv_a (kv_a_proj_with_mqa, the shared rope key
# included) and "kv_b" its up projection to the heads' keys and values wkv_b (kv_b_proj).
TARGETS = {
    "q": ("attention.wq", "attention.wq_b"), "k": ("attention.wk",), "v": ("attention.wv",), "o": ("attention.wo",),
    "gate": ("feed_forward.w1", "moe.shared_experts.w1"), "up": ("feed_forward.w3", "moe.shared_experts.w3"),
    "down": ("feed_forward.w2", "moe.shared_experts.w2"),
    "q_a": ("attention.wq_a",), "kv_a": ("attention.wkv_a",), "kv_b": ("attention.wkv_b",),
}
MLP = ("gate", "up", "down")


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


def present_targets(model_cfg) -> list[str]:
    """The targets a model of ``model_cfg`` has: those its architecture declares (megapipe.models.capabilities),
    less the MLP ones where no layer has a dense MLP (an MoE without a shared expert), ``up`` in a GELU MLP and
    ``q_a`` in multi-latent attention without a q bottleneck."""
    declared = capabilities(model_cfg).lora
    has_mlp = len(model_cfg.moe_layers) < model_cfg.num_layers or bool(model_cfg.moe_shared_expert_intermediate_size)
    return [t for t in TARGETS if t in declared and (t not in MLP or has_mlp)
            and (t != "up" or model_cfg.activation == "swiglu") and (t != "q_a" or model_cfg.q_lora_rank)]


def parse_targets(text: str, model_cfg) -> tuple[str, ...]:
    """``all-linear`` (every projection the model has) or ``q,k,v,...``; unknown or absent names are errors."""
    present = present_targets(model_cfg)
    if not present:
        raise ConfigError(f"LoRA (--lora-rank) is not supported for {describe(model_cfg)} models yet: no layer of "
                          f"theirs is declared a LoRA target")
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
            raise ConfigError(f"lora.targets (--lora-targets) names {n!r}, which {describe(model_cfg)} models do not "
                              f"have as a LoRA target (theirs: {','.join(present)})")
    return tuple(t for t in TARGETS if t in names)


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
    if getattr(module, "lora_off", False):
        return output
    x = args[0]
    if module.lora_dropout and module.training and torch.is_grad_enabled():
        x = nn.functional.dropout(x, module.lora_dropout)
    return output + module.lora_B(module.lora_A(x)) * module.lora_scale


def lora_layers(model: nn.Module):
    """(name, linear) of every layer carrying adapters."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and hasattr(m, "lora_A")]


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model: every adapter of ``model`` skipped inside the context (a reference without a second copy)."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m.lora_off = True
    try:
        yield model
    finally:
        for m in layers:
            m.lora_off = False


def apply_lora(model: nn.Module, spec: LoRASpec, seed: Optional[int] = None) -> nn.Module:
    """Freeze ``model`` and add adapters to the targeted layers of every block (in place; returns the model)."""
    for p in model.parameters():
        p.requires_grad_(False)
    layers = targeted_layers(model, spec.targets)
    check_rank(layers, spec.rank)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for _, linear in layers:
        _add(linear, spec, generator)
    return model


def targeted_layers(model: nn.Module, targets) -> list[tuple[str, nn.Linear]]:
    """(name, linear) of every layer the short-named ``targets`` select, block by block."""
    out = []
    for key, block in model.layers.items():
        for t in targets:
            path = next((p for p in TARGETS[t] if _has(block, p)), None)
            if path is not None:
                out.append((f"layers.{key}.{path}", block.get_submodule(path)))
    return out


def check_rank(layers: list[tuple[str, nn.Linear]], rank: int) -> None:
    """B @ A has rank at most min(in, out) of its layer: a larger --lora-rank only adds memory (100000 on a
    256-wide model exhausts the host's), so it is refused naming the narrowest layer."""
    if not layers:
        return
    name, narrowest = min(layers, key=lambda nl: min(nl[1].in_features, nl[1].out_features))
    width = min(narrowest.in_features, narrowest.out_features)
    if rank > width:
        raise ConfigError(f"lora.rank (--lora-rank) = {rank} is more than the width of {name} ({narrowest.in_features}"
                          f" -> {narrowest.out_features}): an adapter's rank is at most {width} there")


def _has(block: nn.Module, path: str) -> bool:
    try:
        return isinstance(block.get_submodule(path), nn.Linear)
    except AttributeError:
        return False


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
