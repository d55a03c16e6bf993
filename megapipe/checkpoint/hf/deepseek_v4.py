"""DeepseekV4ForCausalLM (DeepSeek-V4-Flash, -Pro): hybrid sliding / compressed sparse / heavily compressed attention
(megapipe.models.compressed_attention), hyper-connections (megapipe.models.hyper_connections) and its MoE (sqrt-softplus
scores with a correction bias, hash routing on the first layers, clamped SwiGLU experts and one shared expert).

Tensors keep DeepSeek's own names, as the Hub's checkpoints hold them and transformers writes them back when it
saves (``model.layers.{i}.attn.wq_a``, ``...ffn.experts.{e}.w1``, ``head.weight``); the Hub's files drop the
``model.`` prefix and name the top tensors ``embed`` / ``norm`` / ``hc_head_fn``, which read as the same tensors
(``aliases``). Their multi-token-prediction layers (``num_nextn_predict_layers``, ``mtp.{k}.*``: the block's tensors
under their layer names, ``e_proj`` / ``h_proj`` / ``enorm`` / ``hnorm`` / ``norm`` / ``hc_head_*``; transformers
leaves them out) import into megapipe's MTP modules (megapipe.models.mtp) and export back under the same names. The
published FP8 block-scaled weights import dequantized; their FP4 experts are refused with a sentence.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from megapipe.checkpoint.hf.base import Conversion, meta_state_keys, refuse, register
from megapipe.checkpoint.hf.deepseek import fit_mtp, mtp_conversions, yarn_from_hf
from megapipe.checkpoint.hf.moe import _MoEAdapter, renamed
from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError
from megapipe.models.hyper_connections import V4

TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "head.weight", "hc_head.fn": "model.hc_head.hc_fn", "hc_head.base": "model.hc_head.hc_base",
       "hc_head.scale": "model.hc_head.hc_scale"}
# the Hub's own top-level names -> the names transformers saves
HUB_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
           "hc_head_scale": "model.hc_head.hc_scale"}
RATES = ("compressed_sparse_attention", "heavily_compressed_attention")


@register
class DeepseekV4Adapter(_MoEAdapter):
    architecture = "DeepseekV4ForCausalLM"
    model_type = "deepseek_v4"
    arch = "deepseek_v4"
    family = "deepseek_v4"
    fp32_tensors = ("moe.gate.weight", "moe.expert_bias")

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or {}
        main, compress = rope.get("main") or {}, dict(rope.get("compress") or {})
        if main.get("rope_type", "default") != "default":
            raise refuse(where, "rope_parameters.main.rope_type", main.get("rope_type"), "the sliding layers' rope "
                         "is plain")
        if float(compress.pop("attention_factor", 1.0)) != 1.0:
            raise refuse(where, "rope_parameters.compress.attention_factor", rope["compress"]["attention_factor"],
                         "DeepSeek-V4 does not rescale its YaRN cos / sin")
        if main.get("partial_rotary_factor") != compress.get("partial_rotary_factor"):
            raise refuse(where, "rope_parameters.*.partial_rotary_factor",
                         (main.get("partial_rotary_factor"), compress.get("partial_rotary_factor")),
                         "both ropes rotate the same dims")
        plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "partial_rotary_factor")}
        fields = super().config_from_hf(
            {**plain, "rope_theta": float(main.get("rope_theta", 10000.0)),
             "intermediate_size": hf["moe_intermediate_size"]}, where)
        fields.pop("rope_scaling", None)
        yarn = yarn_from_hf({"rope_parameters": compress, "max_position_embeddings": hf["max_position_embeddings"]},
                            where, "DeepSeek-V4")
        yarn["compress_rope_theta"] = yarn.pop("rope_theta")
        rates = hf.get("compress_rates") or {}
        try:
            fields.update(
                yarn, num_kv_heads=1, q_lora_rank=int(hf["q_lora_rank"]),
                qk_pos_emb_head_dim=int(int(hf["head_dim"]) * float(main["partial_rotary_factor"])),
                attention_layer_types=list(hf["layer_types"]), csa_compress_rate=int(rates[RATES[0]]),
                hca_compress_rate=int(rates[RATES[1]]), o_groups=int(hf["o_groups"]),
                o_lora_rank=int(hf["o_lora_rank"]), index_n_heads=int(hf["index_n_heads"]),
                index_head_dim=int(hf["index_head_dim"]), index_topk=int(hf["index_topk"]),
                sliding_window=int(hf["sliding_window"]), hc_mult=int(hf["hc_mult"]),
                hc_sinkhorn_iters=int(hf["hc_sinkhorn_iters"]), hc_eps=float(hf["hc_eps"]), attention_sinks=True,
                mtp_num_layers=int(hf.get("num_nextn_predict_layers") or 0) or None)
        except KeyError as e:
            raise MegapipeError(f"{where}: the field {e.args[0]!r} is missing") from None
        return fields

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise refuse(where, "attention_bias / mlp_bias", True, "DeepSeek-V4's projections have no biases")
        return dict(qkv_bias=False, attn_out_bias=False, mlp_bias=False)

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        score = hf.get("scoring_func", "sqrtsoftplus")
        if score not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise refuse(where, "scoring_func", score, "sqrtsoftplus, sigmoid or softmax")
        if int(hf.get("n_shared_experts") or 1) != 1:
            raise refuse(where, "n_shared_experts", hf["n_shared_experts"], "DeepSeek-V4 has one shared expert")
        kinds = list(hf.get("mlp_layer_types") or [])
        hashed = kinds.count("hash_moe")
        if kinds[:hashed] != ["hash_moe"] * hashed:
            raise refuse(where, "mlp_layer_types", kinds, "the hash-routed layers must come first")
        ffn = int(hf["moe_intermediate_size"])
        scale = float(hf.get("routed_scaling_factor") or 1.0)
        return dict(num_experts=int(hf["n_routed_experts"]), moe_router_topk=int(hf["num_experts_per_tok"]),
                    moe_ffn_hidden_size=ffn, moe_router_score_function=score,
                    moe_router_pre_softmax=score == "softmax", moe_router_norm_topk_prob=True,
                    moe_router_topk_scaling_factor=scale if scale != 1.0 else None,
                    moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=ffn, moe_layer_freq=1,
                    moe_activation="clamped_silu", moe_swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
                    moe_hash_layers=hashed)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        for name in ("intermediate_size", "rope_scaling", "rope_theta"):
            hf.pop(name, None)
        partial = cfg.qk_pos_emb_head_dim / cfg.dim_per_head
        compress: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.compress_rope_theta)}
        if cfg.rotary_scaling_factor != 1:
            compress = {"rope_type": "yarn", "rope_theta": float(cfg.compress_rope_theta),
                        "factor": cfg.rotary_scaling_factor, "attention_factor": 1.0,
                        "original_max_position_embeddings": cfg.original_max_position_embeddings
                        or cfg.max_position_embeddings, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                        "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim}
            if not cfg.yarn_truncate:
                compress["truncate"] = False
        hf.update(
            rope_theta=float(cfg.rope_theta), compress_rope_theta=float(cfg.compress_rope_theta),
            partial_rotary_factor=partial,
            rope_parameters={"main": {"rope_type": "default", "rope_theta": float(cfg.rope_theta),
                                      "partial_rotary_factor": partial},
                             "compress": {**compress, "partial_rotary_factor": partial}},
            q_lora_rank=cfg.q_lora_rank, layer_types=list(cfg.attention_layer_types),
            compress_rates={RATES[0]: cfg.csa_compress_rate, RATES[1]: cfg.hca_compress_rate},
            o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads,
            index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, sliding_window=cfg.sliding_window,
            hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
            num_nextn_predict_layers=cfg.mtp_depth)
        return hf

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=False, mlp_bias=False)

    def moe_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hashed = cfg.moe_hash_layers
        return dict(n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_ffn, n_shared_experts=1,
                    scoring_func=cfg.moe_router_score_function, norm_topk_prob=True,
                    routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0, swiglu_limit=cfg.moe_swiglu_limit,
                    mlp_layer_types=["hash_moe"] * hashed + ["moe"] * (cfg.num_layers - hashed))

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        out = mtp_conversions(cfg, V4.hf_names[self.family])[0]
        for key in meta_state_keys(dataclasses.replace(cfg, mtp_num_layers=None)):
            if key in TOP:
                out.append(Conversion(hf=(TOP[key],), mp=(key,)))
                continue
            i = key.split(".", 2)[1]
            names = {f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in V4.hf_names[self.family].items()}
            out.append(renamed(key, names, cfg))
        return out

    def aliases(self, names: set[str]) -> dict[str, str]:
        """The Hub's spelling (no ``model.`` prefix, ``embed`` / ``hc_head_fn`` ...) -> the names transformers saves;
        the MTP layers' ``mtp.{k}.*`` with or without the prefix -> without."""
        def name(n: str) -> str:
            return "model." + n if n.startswith("layers.") else n.removeprefix("model.") if n.startswith(
                "model.mtp.") else n

        return {n: HUB_TOP.get(n, name(n)) for n in names}

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        depth = _mtp_depth_of(name)
        return super().ignored(name, cfg) or (depth is not None and depth >= cfg.mtp_depth)

    def fit(self, cfg: ModelConfig, names: set[str], mtp_num_layers: Optional[int], where: str
            ) -> tuple[ModelConfig, list[str]]:
        have = len({_mtp_depth_of(n) for n in names} - {None})
        return fit_mtp(cfg, have, mtp_num_layers, where, lambda span: f"mtp.{span}.*")


def _mtp_depth_of(name: str) -> Optional[int]:
    """The MTP layer (0-based) a checkpoint tensor belongs to (``mtp.{k}.*``), None for the main model's."""
    found = re.match(r"(?:model\.)?mtp\.(\d+)\.", name)
    return int(found.group(1)) if found else None

