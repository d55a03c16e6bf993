"""LlamaForCausalLM (Llama 2 / 3, incl. Llama-3 RoPE scaling); the base of the Mistral and Qwen adapters."""

from __future__ import annotations

from typing import Any, Optional

from megapipe.checkpoint.hf.base import (
    Adapter,
    Conversion,
    meta_state_keys,
    refuse,
    register,
    renames,
    rope_from_hf,
    rope_to_hf,
)
from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError
from megapipe.models.dense import DENSE

TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
LAYER = DENSE.hf_names["llama"]


@register
class LlamaAdapter(Adapter):
    architecture = "LlamaForCausalLM"
    model_type = "llama"
    arch = "llama"

    # ---- the parts the Llama-shaped architectures differ in

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", False))
        return dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)

    # ---- shared

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if hf.get("hidden_act", "silu") != "silu":
            raise refuse(where, "hidden_act", hf.get("hidden_act"), "the gated MLP uses silu")
        theta, scaling = rope_from_hf(hf, where)
        try:
            heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
            fields = dict(
                arch=self.arch,
                vocab_size=int(hf["vocab_size"]),
                make_vocab_size_divisible_by=1,
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                max_position_embeddings=int(hf["max_position_embeddings"]),
                norm_type="rmsnorm",
                norm_eps=float(hf["rms_norm_eps"]),
                activation="swiglu",
                position_embedding="rope",
                rope_theta=theta,
                rope_scaling=scaling,
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise MegapipeError(f"{where}: the field {e.args[0]!r} is missing") from None
        if hf.get("initializer_range") is not None:
            fields["init_std"] = float(hf["initializer_range"])
        fields.update(self.attention_from_hf(hf, where))
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(
            model_type=self.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.dim_per_head,
            hidden_act="silu",
            max_position_embeddings=cfg.max_position_embeddings,
            rms_norm_eps=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.init_std,
            attention_dropout=0.0,
            use_cache=True,
            **rope_to_hf(cfg),
            **self.attention_to_hf(cfg),
        )

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        return renames(meta_state_keys(cfg), TOP, LAYER, "model.layers.")


def sliding_from_layer_types(hf: dict[str, Any], where: str) -> Optional[int]:
    """Qwen's per-layer attention kinds: all full -> None, all sliding -> the window, a mix is refused."""
    kinds = hf.get("layer_types")
    if kinds is None:
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        first = int(hf.get("max_window_layers", 0))
        kinds = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(int(hf["num_hidden_layers"]))]
    found = set(kinds)
    if found <= {"full_attention"}:
        return None
    if found == {"sliding_attention"}:
        return int(hf["sliding_window"])
    sliding = sum(k == "sliding_attention" for k in kinds)
    raise refuse(where, "layer_types", f"{sliding} sliding_attention + {len(kinds) - sliding} other layers",
                 "one attention kind for every layer is supported")


def sliding_to_layer_types(cfg: ModelConfig) -> dict[str, Any]:
    sliding = cfg.sliding_window is not None
    return dict(
        use_sliding_window=sliding,
        sliding_window=cfg.sliding_window,
        max_window_layers=0 if sliding else cfg.num_layers,
        layer_types=["sliding_attention" if sliding else "full_attention"] * cfg.num_layers,
    )
