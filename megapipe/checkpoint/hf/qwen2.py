"""Qwen2ForCausalLM: Llama's layout with q/k/v biases (always on) and Qwen's per-layer sliding-window fields."""

from __future__ import annotations

from typing import Any

from megapipe.checkpoint.hf.base import register
from megapipe.checkpoint.hf.llama import LlamaAdapter, sliding_from_layer_types, sliding_to_layer_types
from megapipe.config import ModelConfig


@register
class Qwen2Adapter(LlamaAdapter):
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    arch = "qwen2"

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        return dict(qkv_bias=True, attn_out_bias=False, mlp_bias=False,
                    sliding_window=sliding_from_layer_types(hf, where))

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return sliding_to_layer_types(cfg)
