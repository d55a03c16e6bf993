"""MixtralForCausalLM, Qwen2MoeForCausalLM (shared expert and its sigmoid gate) and Qwen3MoeForCausalLM.

The files keep the Hub's per-expert names (``...experts.{e}.w1.weight`` for Mixtral, ``...experts.{e}.gate_proj.weight``
for Qwen); megapipe stores each layer's experts as one 3-D tensor, so a conversion ties E HF tensors to one megapipe
tensor (stacked on import, split on export). Layers are named by their block kind's spec (megapipe.models.moe,
megapipe.models.dense). Training-only MoE settings (aux-loss coefficients, capacity, the kernel choice: base.UNMAPPED_FIELDS)
do not change what the model computes at inference and are not compared on export; the routing must be expressible.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from megapipe.checkpoint.hf.base import Conversion, meta_state_keys, refuse, register
from megapipe.checkpoint.hf.llama import TOP, LlamaAdapter, sliding_from_layer_types, sliding_to_layer_types
from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError
from megapipe.models.blocks import block_spec


def _stack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.stack(tensors)]


def _split(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors[0].unbind(0)]


def block_conversions(cfg: ModelConfig, family: str, top: Optional[dict[str, str]] = None, prefix: str = "model",
                      fused: Optional[Callable[[int], list[Conversion]]] = None) -> list[Conversion]:
    """Conversions of every megapipe tensor: outside the blocks by ``top`` (default Llama's names), in a block by
    its kind's ``hf_names`` (``family`` where the kind names it, else "llama") under ``{prefix}.layers.{i}``.
    ``fused(i)``: the conversions of layer i's tensors that are not renames (a Mamba mixer's fused in_proj /
    conv1d), which the renames leave out."""
    out, layer_names, done = [], {}, set()
    for key in meta_state_keys(cfg):
        if not key.startswith("layers."):
            module, param = key.rsplit(".", 1)
            out.append(Conversion(hf=(f"{(top or TOP)[module]}.{param}",), mp=(key,)))
            continue
        i = int(key.split(".", 2)[1])
        if i not in layer_names:
            spec = block_spec(cfg, i)
            names = spec.hf_names[family if family in spec.hf_names else "llama"]
            layer_names[i] = {f"layers.{i}.{k}": f"{prefix}.layers.{i}.{v}" for k, v in names.items()}
            if fused is not None:
                convs = fused(i)
                out += convs
                done |= {name for c in convs for name in c.mp}
        if key not in done:
            out.append(renamed(key, layer_names[i], cfg))
    return out


def renamed(key: str, names: dict[str, str], cfg: ModelConfig) -> Conversion:
    """The conversion of megapipe tensor ``key`` by ``names`` (megapipe module -> HF module, or a whole tensor's
    name -> HF tensor, e.g. a buffer's; an ``{e}`` in the HF name: E tensors, one per expert, stacked into ``key``)."""
    if key in names and "{e}" in names[key]:
        hf = tuple(names[key].format(e=e) for e in range(cfg.num_experts))
        return Conversion(hf=hf, mp=(key,), to_mp=_stack, to_hf=_split)
    if key in names:
        return Conversion(hf=(names[key],), mp=(key,))
    module, param = key.rsplit(".", 1)
    if module not in names:
        raise MegapipeError(f"model.arch = {cfg.arch!r}: megapipe tensor {key} has no Hugging Face name")
    return Conversion(hf=(f"{names[module]}.{param}",), mp=(key,))


def _pattern_from_hf(hf: dict[str, Any]) -> int | list[int]:
    """Qwen's decoder_sparse_step / mlp_only_layers -> model.moe_layer_freq (1 when every layer is MoE)."""
    step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(int(hf["num_hidden_layers"]))]
    return 1 if all(pattern) else pattern


class _MoEAdapter(LlamaAdapter):
    family: str

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        raise NotImplementedError

    def moe_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        fields = super().config_from_hf(hf, where)
        try:
            fields.update(self.moe_from_hf(hf, where))
        except KeyError as e:
            raise MegapipeError(f"{where}: the field {e.args[0]!r} is missing") from None
        n_moe = len(ModelConfig(**fields).moe_layers)
        coef = hf.get("router_aux_loss_coef")
        if coef is not None and n_moe:
            # transformers' loss is E * sum_e (tokens routed to e / T) * p_e averaged over layers (k times Megatron's
            # per-layer loss): the same objective is Megatron's coefficient coef * k / (MoE layers)
            fields["moe_aux_loss_coeff"] = float(coef) * fields["moe_router_topk"] / n_moe
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        n_moe = len(cfg.moe_layers)
        hf.update(num_experts_per_tok=cfg.moe_router_topk, output_router_logits=False,
                  router_aux_loss_coef=cfg.moe_aux_loss_coeff * n_moe / cfg.moe_router_topk if n_moe else 0.0)
        hf.update(self.moe_to_hf(cfg))
        return hf

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        return block_conversions(cfg, self.family)


@register
class MixtralAdapter(_MoEAdapter):
    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    arch = "mixtral"
    family = "mixtral"

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        window = hf.get("sliding_window")
        return dict(qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                    sliding_window=int(window) if window is not None else None)

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(sliding_window=cfg.sliding_window)

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
            raise refuse(where, "router_jitter_noise", hf["router_jitter_noise"], "the router has no jitter noise")
        # every layer routed; softmax over the top-k logits == softmax, top-k, renormalised (Mixtral)
        return dict(num_experts=int(hf["num_local_experts"]), moe_router_topk=int(hf["num_experts_per_tok"]),
                    moe_ffn_hidden_size=int(hf["intermediate_size"]), moe_router_score_function="softmax",
                    moe_router_pre_softmax=False, moe_layer_freq=1)

    def moe_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(num_local_experts=cfg.num_experts, intermediate_size=cfg.expert_ffn, router_jitter_noise=0.0)


class _QwenMoEAdapter(_MoEAdapter):
    family = "qwen_moe"

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise KeyError("num_experts")
        return dict(num_experts=int(experts), moe_router_topk=int(hf["num_experts_per_tok"]),
                    moe_ffn_hidden_size=int(hf["moe_intermediate_size"]), moe_router_score_function="softmax",
                    moe_router_pre_softmax=True, moe_router_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    moe_layer_freq=_pattern_from_hf(hf))

    def moe_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        moe = set(cfg.moe_layers)
        return dict(num_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_ffn,
                    norm_topk_prob=cfg.moe_router_norm_topk_prob, decoder_sparse_step=1,
                    mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe])


@register
class Qwen2MoeAdapter(_QwenMoEAdapter):
    architecture = "Qwen2MoeForCausalLM"
    model_type = "qwen2_moe"
    arch = "qwen2_moe"

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        bias = bool(hf.get("qkv_bias", True))
        return dict(qkv_bias=bias, attn_out_bias=False, mlp_bias=False,
                    sliding_window=sliding_from_layer_types(hf, where))

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(qkv_bias=cfg.qkv_bias, **sliding_to_layer_types(cfg))

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        fields = super().moe_from_hf(hf, where)
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        if shared <= 0:
            raise refuse(where, "shared_expert_intermediate_size", shared, "Qwen2-MoE always has a shared expert")
        return dict(fields, moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)

    def moe_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(super().moe_to_hf(cfg), shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size)


@register
class Qwen3MoeAdapter(_QwenMoEAdapter):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    arch = "qwen3_moe"

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", False))
        return dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=False, qk_norm=True,
                    sliding_window=sliding_from_layer_types(hf, where))

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=cfg.qkv_bias, **sliding_to_layer_types(cfg))
