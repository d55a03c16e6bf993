"""Qwen3ForCausalLM: Llama's layout with RMSNorm on each head's queries and keys (q_norm, k_norm)."""

from __future__ import annotations

from typing import Any

from megapipe.checkpoint.hf.base import register
from megapipe.checkpoint.hf.llama import LlamaAdapter, sliding_from_layer_types, sliding_to_layer_types
from megapipe.config import ModelConfig


@register
class Qwen3Adapter(LlamaAdapter):
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    arch = "qwen3"

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", False))
        return dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=False, qk_norm=True,
                    sliding_window=sliding_from_layer_types(hf, where))

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=cfg.qkv_bias, **sliding_to_layer_types(cfg))
