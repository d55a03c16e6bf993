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

from typing import Any

from megapipe.checkpoint.hf.base import Conversion, refuse, register
from megapipe.checkpoint.hf.llama import LlamaAdapter
from megapipe.checkpoint.hf.mamba import dt_limit_from_hf, dt_limit_to_hf, fused_mamba_conversions
from megapipe.checkpoint.hf.moe import block_conversions
from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError

TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.final_layernorm", "output": "lm_head"}
# megapipe field -> Falcon-H1's, the same number
MULTIPLIERS = {"embedding_multiplier": "embedding_multiplier", "lm_head_multiplier": "lm_head_multiplier",
               "attention_in_multiplier": "attention_in_multiplier",
               "attention_out_multiplier": "attention_out_multiplier", "key_multiplier": "key_multiplier",
               "mamba_in_multiplier": "ssm_in_multiplier", "mamba_out_multiplier": "ssm_out_multiplier"}


@register
class FalconH1Adapter(LlamaAdapter):
    """Llama's attention, MLP and config fields (attention_bias on q/k/v/o), plus the Mamba mixer's and the
    multipliers."""

    architecture = "FalconH1ForCausalLM"
    model_type = "falcon_h1"
    arch = "falcon_h1"

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        fields = super().config_from_hf(hf, where)  # refuses a hidden_act other than silu (also the Mamba conv's)
        try:
            return {**fields, **self._mamba_from_hf(hf, where)}
        except KeyError as e:
            raise MegapipeError(f"{where}: the field {e.args[0]!r} is missing") from None

    def _mamba_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        d_ssm = hf.get("mamba_d_ssm")
        inner = int(d_ssm) if d_ssm is not None else int(hf["mamba_expand"] * int(hf["hidden_size"]))
        heads = int(hf["mamba_n_heads"])
        head_dim = hf.get("mamba_d_head")
        head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
        if head_dim * heads != inner:
            raise refuse(where, "mamba_d_head", head_dim, f"mamba_n_heads {heads} x mamba_d_head must be the "
                         f"Mamba width {inner}")
        return dict(
            mamba_num_heads=heads,
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
            **dt_limit_from_hf(hf),
            mamba_proj_multipliers=[float(m) for m in hf.get("ssm_multipliers") or [1.0] * 5],
            mlp_multipliers=[float(m) for m in hf.get("mlp_multipliers") or [1.0] * 2],
            **{ours: float(1.0 if hf.get(theirs) is None else hf[theirs]) for ours, theirs in MULTIPLIERS.items()},
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(
            super().config_to_hf(cfg),
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
            time_step_limit=dt_limit_to_hf(cfg),
            ssm_multipliers=list(cfg.mamba_proj_multipliers),
            mlp_multipliers=list(cfg.mlp_multipliers),
            **{theirs: getattr(cfg, ours) for ours, theirs in MULTIPLIERS.items()},
        )

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        if set(cfg.layer_kinds or "") != {"P"}:
            raise MegapipeError(f"model.hybrid_override_pattern = {cfg.layer_kinds!r}: a Falcon-H1 checkpoint has "
                                "parallel hybrid layers (P) only")
        return block_conversions(cfg, self.arch, TOP, fused=lambda i: fused_mamba_conversions(
            cfg, f"layers.{i}.mixer", f"model.layers.{i}.mamba"))
