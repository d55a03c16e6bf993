"""MistralForCausalLM: Llama's layout without biases, with one sliding window for every layer."""

from __future__ import annotations

from typing import Any

from megapipe.checkpoint.hf.base import refuse, register
from megapipe.checkpoint.hf.llama import LlamaAdapter
from megapipe.config import ModelConfig


@register
class MistralAdapter(LlamaAdapter):
    architecture = "MistralForCausalLM"
    model_type = "mistral"
    arch = "mistral"

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        kinds = set(hf.get("layer_types") or ())
        if len(kinds) > 1:
            raise refuse(where, "layer_types", sorted(kinds), "one attention kind for every layer is supported")
        window = hf.get("sliding_window")
        return dict(qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                    sliding_window=int(window) if window is not None else None)

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(sliding_window=cfg.sliding_window)
