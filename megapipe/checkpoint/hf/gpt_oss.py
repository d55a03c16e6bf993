"""GptOssForCausalLM (openai/gpt-oss-20b, -120b): biased GQA attention with per-head sinks, sliding-window and full
layers as ``layer_types`` says, YaRN rope (its ramp not truncated); every layer an MoE with a biased router (top-k of
the logits, softmax over the k) and biased experts with the clamped SwiGLU.

transformers holds each layer's experts fused: ``gate_up_proj`` [E, H, 2F] (x @ W: inputs first) with gate and up
interleaved along the last dim (gate the even columns, up the odd ones), its bias [E, 2F] likewise, ``down_proj``
[E, F, H]; megapipe's experts are nn.Linear-shaped [E, out, in], gate and up apart. The published checkpoints' MXFP4
experts (``*_blocks`` / ``*_scales``) import dequantized (megapipe.checkpoint.hf.mxfp4); export writes them
unquantized.
"""

from __future__ import annotations

from typing import Any

import torch

from megapipe.checkpoint.hf.base import Conversion, refuse, register
from megapipe.checkpoint.hf.deepseek import yarn_from_hf, yarn_to_hf
from megapipe.checkpoint.hf.moe import _MoEAdapter, block_conversions
from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError

EXPERTS = "mlp.experts"


def _deinterleave(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF's gate_up [E, H, 2F] (or its bias [E, 2F]) -> [gate, up] as megapipe holds them ([E, F, H] / [E, F])."""
    t = tensors[0].transpose(1, 2) if tensors[0].dim() == 3 else tensors[0]  # [E, 2F(, H)]
    return [t[:, 0::2].contiguous(), t[:, 1::2].contiguous()]


def _interleave(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    gate, up = tensors
    fused = torch.stack([gate, up], dim=2).flatten(1, 2)  # [E, 2F, ...]: gate row f at 2f, up row f at 2f + 1
    return [fused.transpose(1, 2).contiguous() if fused.dim() == 3 else fused]


def _transposed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors[0].transpose(1, 2).contiguous()]


def layer_types_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """``layer_types`` + ``sliding_window`` -> model.sliding_window and model.window_attn_skip_freq (None when every
    layer is alike; 2 for GPT-OSS's alternation from a windowed layer 0; else the 0/1 pattern)."""
    layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown or len(kinds) != layers:
        raise refuse(where, "layer_types", kinds, "one of sliding_attention / full_attention per layer")
    pattern = [int(k == "sliding_attention") for k in kinds]
    window = hf.get("sliding_window")
    if not any(pattern) or window is None:
        return dict(sliding_window=None, window_attn_skip_freq=None)
    if all(pattern):
        return dict(sliding_window=int(window), window_attn_skip_freq=None)
    alternating = pattern == [int((i + 1) % 2 != 0) for i in range(layers)]
    return dict(sliding_window=int(window), window_attn_skip_freq=2 if alternating else pattern)


@register
class GptOssAdapter(_MoEAdapter):
    architecture = "GptOssForCausalLM"
    model_type = "gpt_oss"
    arch = "gpt_oss"
    family = "gpt_oss"

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        rope_free = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
        fields = super().config_from_hf({**rope_free, "rope_theta": 10000.0}, where)
        fields.pop("rope_scaling", None)
        fields.update(yarn_from_hf(hf, where, "GPT-OSS"))
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        hf.update(yarn_to_hf(cfg))
        return hf

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", True))
        return dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=False, attention_sinks=True,
                    **layer_types_from_hf(hf, where))

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        windowed = set(cfg.windowed_layers)
        kinds = ["sliding_attention" if i in windowed else "full_attention" for i in range(cfg.num_layers)]
        return dict(attention_bias=cfg.qkv_bias, layer_types=kinds, sliding_window=cfg.sliding_window)

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        return dict(num_experts=int(hf["num_local_experts"]), moe_router_topk=int(hf["num_experts_per_tok"]),
                    moe_ffn_hidden_size=int(hf["intermediate_size"]), moe_router_score_function="softmax",
                    moe_router_pre_softmax=False, moe_layer_freq=1, moe_router_bias=True, moe_expert_bias=True,
                    moe_activation="clamped_swiglu", moe_swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                    moe_swiglu_limit=float(hf.get("swiglu_limit", 7.0)))

    def moe_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(num_local_experts=cfg.num_experts, intermediate_size=cfg.expert_ffn,
                    swiglu_alpha=cfg.moe_swiglu_alpha, swiglu_limit=cfg.moe_swiglu_limit)

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        for name in ("moe_router_bias", "moe_expert_bias", "attention_sinks"):
            if not getattr(cfg, name):
                raise MegapipeError(f"model.{name} = false cannot be expressed in a GptOssForCausalLM checkpoint")

        def experts(i: int) -> list[Conversion]:
            hf, mp = f"model.layers.{i}.{EXPERTS}", f"layers.{i}.moe.experts"
            return [
                Conversion((f"{hf}.gate_up_proj",), (f"{mp}.w1", f"{mp}.w3"), _deinterleave, _interleave),
                Conversion((f"{hf}.gate_up_proj_bias",), (f"{mp}.w1_bias", f"{mp}.w3_bias"), _deinterleave,
                           _interleave),
                Conversion((f"{hf}.down_proj",), (f"{mp}.w2",), _transposed, _transposed),
                Conversion((f"{hf}.down_proj_bias",), (f"{mp}.w2_bias",)),
            ]

        return block_conversions(cfg, self.family, fused=experts)
