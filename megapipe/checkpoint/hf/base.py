"""What an architecture adapter is: config mapping both ways plus tensor-name mapping, and the adapter registry.

An adapter turns a Hugging Face ``config.json`` (as normalised by the installed transformers) into ModelConfig
fields and back, and lists the tensor conversions between the two namings. A conversion ties one group of HF
tensors to one group of megapipe tensors (most are a rename; GPT-2's fused ``c_attn`` is three megapipe tensors),
so import and export stream one group at a time. Adding an architecture = one module with a registered subclass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError, MegapipeError
from megapipe.models import build_model

Tensors = list[torch.Tensor]


def _same(tensors: Tensors) -> Tensors:
    return list(tensors)


@dataclass(frozen=True)
class Conversion:
    """HF tensors ``hf`` <-> megapipe tensors ``mp``; ``to_mp``/``to_hf`` map the lists (identity: a rename)."""

    hf: tuple[str, ...]
    mp: tuple[str, ...]
    to_mp: Callable[[Tensors], Tensors] = _same
    to_hf: Callable[[Tensors], Tensors] = _same


# ModelConfig fields that say nothing about the weights or the maths, so they are not compared on export (the MoE
# ones only shape training: balancing losses, token dropping, the expert kernel; mamba_dt_min only the dt_bias init).
UNMAPPED_FIELDS = ("preset", "arch", "make_vocab_size_divisible_by", "init_std",
                   "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                   "moe_router_bias_update_rate", "moe_expert_capacity_factor", "moe_token_drop_policy",
                   "moe_grouped_gemm", "mtp_loss_scaling_factor", "mamba_dt_min")


class Adapter:
    """One Hugging Face architecture. Subclasses set the class variables and implement the three methods."""

    architecture: ClassVar[str]  # config.json "architectures"[0], e.g. "LlamaForCausalLM"
    model_type: ClassVar[str]  # config.json "model_type", e.g. "llama"
    arch: ClassVar[str]  # ModelConfig.arch
    # block tensors (names within a block) transformers keeps in fp32 whatever the model's dtype, so the quantized
    # exports, checked against ModelOpt's of the transformers twin, write them in fp32 too
    fp32_tensors: ClassVar[tuple[str, ...]] = ()

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """Normalised HF config -> ModelConfig fields; a MegapipeError names any field megapipe cannot represent."""
        raise NotImplementedError

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """ModelConfig -> the architecture's config.json fields (no token ids, dtype or architectures)."""
        raise NotImplementedError

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        raise NotImplementedError

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        """HF tensors that are not weights megapipe needs (cached buffers, a tied head saved anyway)."""
        return name.endswith(".rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")

    def fit(self, cfg: ModelConfig, names: set[str], mtp_num_layers: Optional[int], where: str
            ) -> tuple[ModelConfig, list[str]]:
        """The config to import the checkpoint's tensors ``names`` into (``mtp_num_layers``: how many of its
        multi-token-prediction layers the user keeps, None: what config.json declares), and sentences for the import
        log about what was left out."""
        if mtp_num_layers:
            raise MegapipeError(f"{where}: --mtp-num-layers {mtp_num_layers}: {self.architecture} checkpoints hold no "
                                "multi-token-prediction layers")
        return cfg, []

    def module_name(self, tensor: str) -> str:
        """The transformers module holding HF tensor ``tensor``, by its name in memory (peft's adapters use it)."""
        return tensor.rsplit(".", 1)[0]

    def aliases(self, names: set[str]) -> dict[str, str]:
        """Names as a checkpoint spells them -> the canonical names ``conversions`` uses (default: the same)."""
        return {n: n for n in names}

    def hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """``config_to_hf``, refusing a config whose fields the architecture cannot express (reads back different)."""
        hf = self.config_to_hf(cfg)
        back = ModelConfig(**{**self.config_from_hf(hf, f"{self.architecture} config"), "arch": cfg.arch})
        lost = [
            f.name
            for f in dataclasses.fields(ModelConfig)
            if f.name not in UNMAPPED_FIELDS
            and canonical(f.name, getattr(cfg, f.name), cfg) != canonical(f.name, getattr(back, f.name), back)
        ]
        if lost:
            have = ", ".join(f"model.{n} = {getattr(cfg, n)!r}" for n in lost)
            read = ", ".join(f"model.{n} = {getattr(back, n)!r}" for n in lost)
            raise ConfigError(
                f"{have} cannot be expressed in a Hugging Face {self.architecture} config (it would read back as {read})"
            )
        return hf


def canonical(name: str, value: Any, cfg: ModelConfig) -> Any:
    """A field's value in a form where equal maths compares equal (defaults resolved, numbers as floats)."""
    if name.startswith("rope_") and cfg.position_embedding != "rope":
        return None
    if name == "num_kv_heads":
        return cfg.kv_heads
    if name == "head_dim":
        return cfg.dim_per_head
    if name == "rope_scaling":
        return None if not value else {k: float(v) for k, v in value.items() if k not in ("rope_type", "type")}
    if name in ("rope_theta", "norm_eps"):
        return float(value)
    if name == "sliding_window" and value is not None and value >= cfg.max_position_embeddings:
        return None  # a window as long as the context is no window
    if name == "mtp_num_layers":
        return cfg.mtp_depth
    if name == "moe_layer_freq":
        return tuple(cfg.moe_layers)  # every-N-th, a pattern and first-K-dense are one list of MoE layers
    if name == "mamba_out_proj_bias":
        return cfg.mamba_out_bias  # unset: the in-projections'
    if name == "moe_first_k_dense_replace":
        return None
    if name == "moe_ffn_hidden_size":
        return cfg.expert_ffn if cfg.is_moe else None
    if name == "hybrid_override_pattern":
        return cfg.layer_kinds  # a pattern or the ratios that allocate one
    if name in ("hybrid_attention_ratio", "hybrid_mlp_ratio"):
        return None
    if name == "window_attn_skip_freq":
        return tuple(cfg.windowed_layers)  # every-N-th and a pattern are one list of windowed layers
    if name == "mamba_num_heads":
        return cfg.mamba_heads
    if name == "intermediate_size" and cfg.is_moe and len(cfg.moe_layers) == cfg.num_layers:
        return None  # no dense layer uses it
    return value


# --------------------------------------------------------------------------------------------------- registry

ADAPTERS: dict[str, Adapter] = {}  # by HF architecture name


def register(cls: type[Adapter]) -> type[Adapter]:
    ADAPTERS[cls.architecture] = cls()
    return cls


def supported() -> str:
    return ", ".join(sorted(ADAPTERS))


def adapter_for_hf(hf: dict[str, Any], where: str) -> Adapter:
    """The adapter for a config.json: by ``architectures``, else by ``model_type``."""
    names = hf.get("architectures") or []
    for name in names:
        if name in ADAPTERS:
            return ADAPTERS[name]
    if not names:
        for adapter in ADAPTERS.values():
            if adapter.model_type == hf.get("model_type"):
                return adapter
    found = ", ".join(names) if names else f"model_type {hf.get('model_type')!r}"
    raise MegapipeError(f"{where}: architecture {found} is not supported (supported: {supported()})")


def adapter_for_arch(arch: str) -> Adapter:
    for adapter in ADAPTERS.values():
        if adapter.arch == arch:
            return adapter
    raise MegapipeError(f"model.arch = {arch!r} has no Hugging Face adapter (supported: {supported()})")


# --------------------------------------------------------------------------------------------------- config helpers


def refuse(where: str, field: str, value: Any, why: str) -> MegapipeError:
    return MegapipeError(f"{where}: {field} = {value!r} cannot be represented by megapipe ({why})")


def rope_from_hf(hf: dict[str, Any], where: str) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from transformers 5 ``rope_parameters`` or the older ``rope_scaling``/``rope_theta``."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise refuse(where, "rope_parameters", params, "one RoPE setting for every layer is supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise refuse(where, "partial_rotary_factor", partial, "RoPE over the whole head is supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise refuse(where, "rope_parameters.rope_type", kind, "supported: 'default', 'llama3'")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise MegapipeError(f"{where}: llama3 rope_parameters lack {', '.join(missing)}")
    return theta, {k: params[k] for k in keys}


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_parameters`` (transformers >= 5) plus the same as ``rope_theta``/``rope_scaling`` (older readers, vLLM)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    scaling = None
    if cfg.rope_scaling:
        scaling = {"rope_type": "llama3", **{k: v for k, v in cfg.rope_scaling.items() if k not in ("rope_type", "type")}}
        params.update(scaling)
    return {"rope_parameters": params, "rope_theta": float(cfg.rope_theta), "rope_scaling": scaling}


def meta_state_keys(cfg: ModelConfig) -> list[str]:
    """The megapipe model's state-dict keys for ``cfg`` (built on the meta device: no memory)."""
    return list(build_model(cfg, device="meta").state_dict().keys())


def renames(keys: list[str], top: dict[str, str], layer: dict[str, str], layer_prefix: str) -> list[Conversion]:
    """1:1 conversions for megapipe ``keys``: module ``top[m]`` outside the blocks, ``layer_prefix{i}.layer[m]`` inside."""
    out = []
    for key in keys:
        module, param = key.rsplit(".", 1)
        if module.startswith("layers."):
            _, i, rest = module.split(".", 2)
            hf = f"{layer_prefix}{i}.{layer[rest]}.{param}"
        else:
            hf = f"{top[module]}.{param}"
        out.append(Conversion(hf=(hf,), mp=(key,)))
    return out
