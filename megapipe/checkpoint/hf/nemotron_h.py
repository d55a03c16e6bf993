"""NemotronHForCausalLM (Nemotron-H): a hybrid of Mamba-2, attention (no positions) and squared-ReLU MLP layers,
one mixer per layer (megapipe.models.hybrid), by ``layers_block_type`` (or the legacy ``hybrid_override_pattern``).

transformers fuses what megapipe keeps apart: a Mamba layer's ``in_proj`` is [z | x | B | C | dt] (megapipe's
``in_z``, ``in_x``, ``in_B``, ``in_C``, ``in_dt``) and its ``conv1d`` runs over the channels [x | B | C] with a
weight [C, 1, K] (megapipe's ``conv_x``, ``conv_B``, ``conv_C``, weights [C, K]); the conversions split and join them.
Tensors are named as on the Hub and as transformers saves them, under ``backbone.``; transformers' in-memory ``model.``
names import too.

dt is clamped to ``time_step_limit`` (megapipe's dt limit), as in mamba-ssm and transformers from 5.25 (earlier
releases clamped at ``time_step_min`` instead); ``time_step_min``/``time_step_max`` are dt_bias's init range.
"""

from __future__ import annotations

from typing import Any

from megapipe.checkpoint.hf.base import Conversion, refuse, register
from megapipe.checkpoint.hf.llama import LlamaAdapter
from megapipe.checkpoint.hf.mamba import dt_limit_from_hf, dt_limit_to_hf, fused_mamba_conversions
from megapipe.checkpoint.hf.moe import block_conversions
from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError

TOP = {"tok_embeddings": "backbone.embeddings", "norm": "backbone.norm_f", "output": "lm_head"}
# transformers' layer kinds (and their legacy names) -> megapipe's pattern symbols
SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MIXER_TENSORS = ("A_log", "D", "dt_bias")  # the Mamba mixer's own parameters, named alike in both


def mamba_conversions(cfg: ModelConfig, i: int) -> list[Conversion]:
    """Layer ``i``'s tensors its kind's names do not give, if it is a Mamba layer: A_log, D, dt_bias and the fused
    in_proj and conv1d."""
    if cfg.layer_kinds[i] != "M":
        return []
    mp, hf = f"layers.{i}.mixer", f"backbone.layers.{i}.mixer"
    own = [Conversion(hf=(f"{hf}.{t}",), mp=(f"{mp}.{t}",)) for t in MIXER_TENSORS]
    return own + fused_mamba_conversions(cfg, mp, hf)


def _pattern(hf: dict[str, Any], where: str) -> str:
    """The layer kinds as megapipe's pattern: from layers_block_type, else the legacy hybrid_override_pattern."""
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None and hf.get("hybrid_override_pattern") is not None:
        return str(hf["hybrid_override_pattern"])
    if kinds is None:
        raise KeyError("layers_block_type")
    unknown = [k for k in kinds if k not in SYMBOLS]
    if unknown:
        raise refuse(where, "layers_block_type", unknown[0], "layer kinds: " + ", ".join(KINDS.values()))
    return "".join(SYMBOLS[k] for k in kinds)


def _refuse_unrepresentable(hf: dict[str, Any], pattern: str, where: str) -> None:
    if "E" in pattern:
        raise refuse(where, "layers_block_type", f"{pattern.count('E')} 'moe' layers",
                     "Nemotron-H's experts are squared-ReLU MLPs and megapipe's are SwiGLU")
    if int(hf.get("num_nextn_predict_layers") or 0) > 0:
        raise refuse(where, "num_nextn_predict_layers", hf["num_nextn_predict_layers"],
                     "multi-token prediction is not defined for hybrid Transformer-Mamba models")
    if "-" in pattern and hf.get("mlp_hidden_act", "relu2") != "relu2":
        raise refuse(where, "mlp_hidden_act", hf["mlp_hidden_act"], "Nemotron-H's MLP is squared ReLU ('relu2')")
    if "M" in pattern and hf.get("mamba_hidden_act", "silu") != "silu":
        raise refuse(where, "mamba_hidden_act", hf["mamba_hidden_act"], "the Mamba-2 conv is followed by silu")


@register
class NemotronHAdapter(LlamaAdapter):
    architecture = "NemotronHForCausalLM"
    model_type = "nemotron_h"
    arch = "nemotron_h"

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        # transformers builds q/k/v/o without biases whatever attention_bias says
        return dict(qkv_bias=False, attn_out_bias=False, mlp_bias=bool(hf.get("mlp_bias", False)))

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        try:
            pattern = _pattern(hf, where)
            _refuse_unrepresentable(hf, pattern, where)
            # Llama's fields under Nemotron-H's names (the layer count is the pattern's), then its own
            llama = {**hf, "num_hidden_layers": len(pattern), "rms_norm_eps": hf["layer_norm_epsilon"],
                     "hidden_act": "silu", "rope_parameters": None, "rope_scaling": None}
            fields = super().config_from_hf(llama, where)
            dt_min, dt_max = float(hf.get("time_step_min", 0.001)), float(hf.get("time_step_max", 0.1))
            fields.update(
                activation="relu2",
                position_embedding="none",
                tie_embeddings=False,  # transformers never ties Nemotron-H's lm_head
                hybrid_override_pattern=pattern,
                mamba_num_heads=int(hf["mamba_num_heads"]),
                mamba_head_dim=int(hf["mamba_head_dim"]),
                mamba_state_dim=int(hf["ssm_state_size"]),
                mamba_num_groups=int(hf["n_groups"]),
                mamba_conv_kernel=int(hf["conv_kernel"]),
                mamba_chunk_size=int(hf["chunk_size"]),
                mamba_conv_bias=bool(hf.get("use_conv_bias", True)),
                mamba_proj_bias=bool(hf.get("use_bias", False)),  # in_proj and out_proj (mamba_proj_bias is unused)
                **dt_limit_from_hf(hf),
                mamba_dt_max=dt_max,
                mamba_dt_init_floor=float(hf.get("time_step_floor", 1e-4)),
            )
        except KeyError as e:
            raise MegapipeError(f"{where}: the field {e.args[0]!r} is missing") from None
        if 0 < dt_min <= dt_max:  # the dt_bias init's range
            fields["mamba_dt_min"] = dt_min
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        pattern = cfg.layer_kinds or ""
        return dict(
            model_type=self.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            layers_block_type=[KINDS[s] for s in pattern],
            hybrid_override_pattern=pattern,  # the legacy key, for readers that know only it
            num_hidden_layers=cfg.num_layers,
            intermediate_size=cfg.intermediate_size,
            mlp_hidden_act="relu2",
            mlp_bias=cfg.mlp_bias,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.dim_per_head,
            attention_bias=False,
            attention_dropout=0.0,
            max_position_embeddings=cfg.max_position_embeddings,
            layer_norm_epsilon=cfg.norm_eps,
            mamba_num_heads=cfg.mamba_heads,
            mamba_head_dim=cfg.mamba_head_dim,
            ssm_state_size=cfg.mamba_state_dim,
            n_groups=cfg.mamba_num_groups,
            conv_kernel=cfg.mamba_conv_kernel,
            chunk_size=cfg.mamba_chunk_size,
            use_conv_bias=cfg.mamba_conv_bias,
            use_bias=cfg.mamba_proj_bias,
            mamba_proj_bias=cfg.mamba_proj_bias,
            mamba_hidden_act="silu",
            time_step_limit=dt_limit_to_hf(cfg),
            time_step_min=cfg.mamba_dt_min,
            time_step_max=cfg.mamba_dt_max,
            time_step_floor=cfg.mamba_dt_init_floor,
            num_nextn_predict_layers=0,
            tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.init_std,
            use_cache=True,
        )

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        return block_conversions(cfg, self.arch, TOP, "backbone", lambda i: mamba_conversions(cfg, i))

    def module_name(self, tensor: str) -> str:
        """transformers renames the files' ``backbone.`` to ``model.`` in memory."""
        module = super().module_name(tensor)
        return "model." + module[len("backbone."):] if module.startswith("backbone.") else module

    def aliases(self, names: set[str]) -> dict[str, str]:
        """transformers' ``model.`` prefix (its model in memory) is the files' ``backbone.``."""
        return {n: "backbone." + n[len("model."):] if n.startswith("model.") else n for n in names}
