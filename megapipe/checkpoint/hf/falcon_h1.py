"""FalconH1ForCausalLM (Falcon-H1): every layer a Mamba-2 mixer beside attention, then a SwiGLU MLP
(megapipe.models.parallel_hybrid, layer kind "P"), with muP multipliers that are config values, not tensors
(transformers' per-layer ``mup_vector`` is a buffer it does not save: megapipe's ``mamba_proj_multipliers``).

Names: Falcon's ``mamba_d_ssm`` (or ``mamba_expand * hidden_size``) is megapipe's d_inner = mamba_num_heads *
mamba_head_dim; ``mamba_proj_bias`` is the in-projection's bias and ``projectors_bias`` the out-projection's
(megapipe's ``mamba_out_proj_bias``); ``mamba_rms_norm`` is ``mamba_gated_norm``; ``time_step_limit`` is the dt limit
as given; ``ssm_multipliers`` (z, x, B, C, dt) are ``mamba_proj_multipliers``, ``ssm_in/out_multiplier``
``mamba_in/out_multiplier``. transformers' fused CUDA training kernel ignores ``mamba_norm_before_gate``; its
forward in eval (and every forward without mamba-ssm) honours it, as megapipe does.
"""

from __future__ import annotations

import math
from typing import Any

from megapipe.checkpoint.hf.base import (
    Adapter,
    Conversion,
    meta_state_keys,
    refuse,
    register,
    rope_from_hf,
    rope_to_hf,
)
from megapipe.checkpoint.hf.mamba import fused_mamba_conversions
from megapipe.checkpoint.hf.moe import renamed
from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError
from megapipe.models.parallel_hybrid import PARALLEL_HYBRID

TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.final_layernorm", "output": "lm_head"}
# megapipe field -> Falcon-H1's, the same number
MULTIPLIERS = {"embedding_multiplier": "embedding_multiplier", "lm_head_multiplier": "lm_head_multiplier",
               "attention_in_multiplier": "attention_in_multiplier",
               "attention_out_multiplier": "attention_out_multiplier", "key_multiplier": "key_multiplier",
               "mamba_in_multiplier": "ssm_in_multiplier", "mamba_out_multiplier": "ssm_out_multiplier"}


@register
class FalconH1Adapter(Adapter):
    architecture = "FalconH1ForCausalLM"
    model_type = "falcon_h1"
    arch = "falcon_h1"

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        try:
            return self._config_from_hf(hf, where)
        except KeyError as e:
            raise MegapipeError(f"{where}: the field {e.args[0]!r} is missing") from None

    def _config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if hf.get("hidden_act", "silu") != "silu":
            raise refuse(where, "hidden_act", hf["hidden_act"], "the MLP's gate and the Mamba conv use silu")
        theta, scaling = rope_from_hf(hf, where)
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        d_ssm = hf.get("mamba_d_ssm")
        inner = int(d_ssm) if d_ssm is not None else int(hf["mamba_expand"] * hidden)
        mamba_heads = int(hf["mamba_n_heads"])
        head_dim = hf.get("mamba_d_head")
        head_dim = inner // mamba_heads if head_dim in (None, "auto") else int(head_dim)
        if head_dim * mamba_heads != inner:
            raise refuse(where, "mamba_d_head", head_dim, f"mamba_n_heads {mamba_heads} x mamba_d_head must be the "
                         f"Mamba width {inner}")
        lo, hi = hf.get("time_step_limit") or (0.0, math.inf)
        attention_bias = bool(hf.get("attention_bias", False))
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
            qkv_bias=attention_bias,
            attn_out_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            mamba_num_heads=mamba_heads,
            mamba_head_dim=head_dim,
            mamba_state_dim=int(hf["mamba_d_state"]),
            mamba_num_groups=int(hf["mamba_n_groups"]),
            mamba_conv_kernel=int(hf["mamba_d_conv"]),
            mamba_chunk_size=int(hf["mamba_chunk_size"]),
            mamba_conv_bias=bool(hf.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(hf.get("mamba_proj_bias", False)),
            mamba_out_proj_bias=bool(hf.get("projectors_bias", False)),
            mamba_gated_norm=bool(hf.get("mamba_rms_norm", False)),
            mamba_norm_before_gate=bool(hf.get("mamba_norm_before_gate", True)),
            mamba_dt_limit_min=float(lo),
            mamba_dt_limit_max=None if math.isinf(float(hi)) else float(hi),
            mamba_proj_multipliers=[float(m) for m in hf.get("ssm_multipliers") or [1.0] * 5],
            mlp_multipliers=[float(m) for m in hf.get("mlp_multipliers") or [1.0] * 2],
            **{ours: float(1.0 if hf.get(theirs) is None else hf[theirs]) for ours, theirs in MULTIPLIERS.items()},
        )
        if hf.get("initializer_range") is not None:
            fields["init_std"] = float(hf["initializer_range"])
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        lo, hi = cfg.mamba_dt_limit
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
            attention_bias=cfg.qkv_bias,
            mlp_bias=cfg.mlp_bias,
            use_cache=True,
            **rope_to_hf(cfg),
            mamba_d_ssm=cfg.mamba_inner,
            mamba_n_heads=cfg.mamba_heads,
            mamba_d_head=cfg.mamba_head_dim,
            mamba_n_groups=cfg.mamba_num_groups,
            mamba_d_state=cfg.mamba_state_dim,
            mamba_d_conv=cfg.mamba_conv_kernel,
            mamba_chunk_size=cfg.mamba_chunk_size,
            mamba_conv_bias=cfg.mamba_conv_bias,
            mamba_proj_bias=cfg.mamba_proj_bias,
            projectors_bias=cfg.mamba_out_bias,
            mamba_rms_norm=cfg.mamba_gated_norm,
            mamba_norm_before_gate=cfg.mamba_norm_before_gate,
            time_step_limit=[lo, hi],
            ssm_multipliers=list(cfg.mamba_proj_multipliers),
            mlp_multipliers=list(cfg.mlp_multipliers),
            **{theirs: getattr(cfg, ours) for ours, theirs in MULTIPLIERS.items()},
        )

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        if set(cfg.layer_kinds or "") != {"P"}:
            raise MegapipeError(f"model.hybrid_override_pattern = {cfg.layer_kinds!r}: a Falcon-H1 checkpoint has "
                                "parallel hybrid layers (P) only")
        out, names, fused = [], {}, set()
        layer = PARALLEL_HYBRID.hf_names[self.arch]
        for key in meta_state_keys(cfg):
            if not key.startswith("layers."):
                module, param = key.rsplit(".", 1)
                out.append(Conversion(hf=(f"{TOP[module]}.{param}",), mp=(key,)))
                continue
            i = int(key.split(".", 2)[1])
            if i not in names:
                names[i] = {f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in layer.items()}
                convs = fused_mamba_conversions(cfg, f"layers.{i}.mixer", f"model.layers.{i}.mamba")
                out += convs
                fused |= {m for c in convs for m in c.mp}
            if key not in fused:
                out.append(renamed(key, names[i], cfg))
        return out
