"""DeepseekV3ForCausalLM (DeepSeek-V3, and Kimi-K2, whose config.json names this architecture with model_type
"kimi_k2", read as a DeepSeek-V3 config; exported as DeepSeek-V3): multi-latent attention with
YaRN rope on interleaved pairs, and the sigmoid, group-limited MoE with its score-correction bias (megapipe's
expert bias), the first layers dense. Tensors are named by the MLA block kinds' spec (megapipe.models.mla).

The Hub's checkpoints also hold the multi-token-prediction layers (``num_nextn_predict_layers``, transformers'
``num_mtp_layers``) as extra layer indices (``model.layers.{L}.*`` for L >= num_hidden_layers: a decoder layer plus
the MTP module's own tensors, named by ``megapipe.models.mtp.hf_mtp_names``); they import into megapipe's MTP modules (``model.mtp``, megapipe.models.mtp) and export back where
they were. DeepSeek's copies of the embedding table and the output head in each of them must equal the main model's
(megapipe shares those) and are written back from them. transformers leaves these tensors out when it loads.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import torch

from megapipe.checkpoint.hf.base import Conversion, meta_state_keys, refuse, register, rope_from_hf
from megapipe.checkpoint.hf.moe import _MoEAdapter, renamed
from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError
from megapipe.models.blocks import block_spec
from megapipe.models.mtp import hf_mtp_names
from megapipe.models.rope import yarn_attention_factor

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def mtp_layer_of(name: str, cfg: ModelConfig) -> int | None:
    """The MTP depth (0-based) a Hub tensor name belongs to, None for the main model's tensors."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    if found and int(found.group(1)) >= cfg.num_layers:
        return int(found.group(1)) - cfg.num_layers
    return None


def yarn_from_hf(hf: dict[str, Any], where: str, family: str = "DeepSeek-V3") -> dict[str, Any]:
    """rope_parameters -> rope_theta and the YaRN fields (rope_type 'default' or 'yarn')."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rope_theta=rope_from_hf(hf, where)[0])
    if kind != "yarn":
        raise refuse(where, "rope_parameters.rope_type", kind, f"supported for {family}: 'default', 'yarn'")
    truncate = params.get("truncate", True)
    if truncate not in (True, False):
        raise refuse(where, "rope_parameters.truncate", truncate, "true or false")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    original = int(params.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    factor = params.get("factor")
    fields = dict(rope_theta=theta, original_max_position_embeddings=original,
                  rotary_scaling_factor=float(factor if factor is not None else hf["max_position_embeddings"] / original),
                  beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                  mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
                  yarn_truncate=truncate)
    given = params.get("attention_factor")
    if given is not None and abs(float(given) - yarn_attention_factor(ModelConfig(**fields))) > 1e-12:
        raise refuse(where, "rope_parameters.attention_factor", given, "it is derived from factor and the mscales")
    return fields


def yarn_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """rope_parameters (and the older rope_theta / rope_scaling) of a default or YaRN rope."""
    theta = float(cfg.rope_theta)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if cfg.rotary_scaling_factor != 1:
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": cfg.rotary_scaling_factor,
                  "original_max_position_embeddings": cfg.original_max_position_embeddings
                  or cfg.max_position_embeddings, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                  "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim}
        if not cfg.yarn_truncate:
            params["truncate"] = False
    return dict(rope_parameters=params, rope_theta=theta,
                rope_scaling=None if params["rope_type"] == "default" else params)


@register
class DeepseekV3Adapter(_MoEAdapter):
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    arch = "deepseek_v3"
    family = "deepseek_v3"
    fp32_tensors = ("moe.gate.weight", "moe.expert_bias")  # the router (transformers' _keep_in_fp32_modules_strict)

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        # Llama's fields, then MLA's: the heads' widths and the rope are MLA's own
        rope_free = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters", "head_dim")}
        fields = super().config_from_hf({**rope_free, "rope_theta": 10000.0}, where)
        for name in ("num_kv_heads", "head_dim", "rope_scaling"):
            fields.pop(name, None)
        try:
            q_rank = hf.get("q_lora_rank")
            fields.update(
                multi_latent_attention=True, q_lora_rank=int(q_rank) if q_rank else None,
                kv_lora_rank=int(hf["kv_lora_rank"]), qk_head_dim=int(hf["qk_nope_head_dim"]),
                qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                rope_interleave=bool(hf.get("rope_interleave", True)),
                mtp_num_layers=int(hf.get("num_nextn_predict_layers") or 0) or None, **yarn_from_hf(hf, where))
        except KeyError as e:
            raise MegapipeError(f"{where}: the field {e.args[0]!r} is missing") from None
        return fields

    def attention_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", False))
        return dict(qkv_bias=bias, attn_out_bias=bias, mlp_bias=False)

    def attention_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=cfg.qkv_bias)

    def moe_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise refuse(where, "topk_method / scoring_func", (hf.get("topk_method"), hf.get("scoring_func")),
                         "DeepSeek-V3's sigmoid noaux_tc routing is supported")
        groups, group_topk, k = int(hf["n_group"] or 1), int(hf["topk_group"] or 1), int(hf["num_experts_per_tok"])
        if group_topk < groups and k // group_topk != 2:
            raise refuse(where, "num_experts_per_tok / topk_group", k / group_topk,
                         "transformers scores a group by its best 2 experts, megapipe by its best k / topk_group")
        return dict(
            num_experts=int(hf["n_routed_experts"]), moe_router_topk=k,
            moe_ffn_hidden_size=int(hf["moe_intermediate_size"]), moe_router_score_function="sigmoid",
            moe_router_pre_softmax=False, moe_router_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0) if hf.get(
                "routed_scaling_factor", 1.0) != 1.0 else None,
            moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_topk if groups > 1 else None,
            moe_router_enable_expert_bias=True,
            moe_shared_expert_intermediate_size=int(hf.get("n_shared_experts") or 0) * int(hf["moe_intermediate_size"])
            or None,
            moe_layer_freq=1, moe_first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0))

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        hf.update(num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank or None,
                  kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
                  qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
                  rope_interleave=cfg.rope_interleave, num_nextn_predict_layers=cfg.mtp_depth)
        hf.pop("head_dim")
        hf.update(yarn_to_hf(cfg))
        return hf

    def moe_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        shared, ffn = cfg.moe_shared_expert_intermediate_size or 0, cfg.expert_ffn
        if shared % ffn:
            raise MegapipeError(f"model.moe_shared_expert_intermediate_size = {shared} cannot be expressed in a "
                                f"DeepseekV3 config: it must be a multiple of the expert width {ffn}")
        return dict(n_routed_experts=cfg.num_experts, moe_intermediate_size=ffn, n_shared_experts=shared // ffn,
                    routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0,
                    n_group=cfg.moe_router_num_groups or 1, topk_group=cfg.moe_router_group_topk or 1,
                    norm_topk_prob=cfg.moe_router_norm_topk_prob, first_k_dense_replace=cfg.moe_first_k_dense_replace,
                    topk_method="noaux_tc", scoring_func="sigmoid")

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        """The main model's, then each MTP module's by hf_mtp_names; the main embedding table's and output head's
        conversions also carry DeepSeek's copies of them in the MTP layers."""
        out = super().conversions(dataclasses.replace(cfg, mtp_num_layers=None))
        mtp, copies = mtp_conversions(cfg, block_spec(cfg, cfg.num_layers - 1).hf_names[self.family])
        return [_with_copies(c, copies[c.mp[0]]) if c.mp[0] in copies else c for c in out + mtp]

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        depth = mtp_layer_of(name, cfg)
        return super().ignored(name, cfg) or (depth is not None and depth >= cfg.mtp_depth)

    def fit(self, cfg: ModelConfig, names: set[str], mtp_num_layers: Optional[int], where: str
            ) -> tuple[ModelConfig, list[str]]:
        have = len({mtp_layer_of(n, cfg) for n in names} - {None})
        return fit_mtp(cfg, have, mtp_num_layers, where, lambda span: f"model.layers.{span}.*", cfg.num_layers)


def mtp_conversions(cfg: ModelConfig, block_names: dict[str, str]) -> tuple[list[Conversion], dict[str, list[str]]]:
    """Each MTP module's conversions (megapipe.models.mtp.hf_mtp_names; ``block_names``: its block kind's HF names),
    and DeepSeek-V3's copies of the shared tables in them (main table's megapipe name -> the copies' HF names; none
    in DeepSeek-V4's)."""
    keys, out = meta_state_keys(cfg), []
    copies: dict[str, list[str]] = {}
    for depth in range(1, cfg.mtp_depth + 1):
        names = hf_mtp_names(cfg.num_layers, depth, block_names, hyper_connections=bool(cfg.hc_mult))
        for shared in ("tok_embeddings", "output"):
            if shared in names:
                table = "tok_embeddings" if shared == "output" and cfg.tie_embeddings else shared
                copies.setdefault(f"{table}.weight", []).append(names.pop(shared) + ".weight")
        out += [renamed(k, names, cfg) for k in keys if k.startswith(f"mtp.{depth - 1}.")]
    return out, copies


def fit_mtp(cfg: ModelConfig, have: int, mtp_num_layers: Optional[int], where: str, spelled, first: int = 0
            ) -> tuple[ModelConfig, list[str]]:
    """The config with the MTP depth to import (``have``: the checkpoint's MTP layers; ``mtp_num_layers``: what
    --mtp-num-layers asks, None: what config.json declares) and the notes on what is left out (``spelled(span)``:
    the left-out layers' tensor names, ``first`` the number of the first one)."""
    if mtp_num_layers is not None and mtp_num_layers > have:
        raise MegapipeError(f"{where}: --mtp-num-layers {mtp_num_layers} asks for more multi-token-prediction "
                            f"layers than the checkpoint holds ({have})")
    notes = []
    if mtp_num_layers is not None:
        keep, why = mtp_num_layers, f"--mtp-num-layers {mtp_num_layers}"
    elif have:
        keep, why = cfg.mtp_depth, f"config.json's num_nextn_predict_layers is {cfg.mtp_depth}"
    else:
        keep = 0
        if cfg.mtp_depth:
            notes.append(f"config.json's num_nextn_predict_layers is {cfg.mtp_depth} but the safetensors hold no "
                         "multi-token-prediction layer: the model was imported without MTP modules")
    if keep < have:
        start, last = first + keep, first + have - 1
        span = str(start) if start == last else f"{start}-{last}"
        notes.append(f"the checkpoint's {have - keep} multi-token-prediction layer(s) ({spelled(span)}) "
                     f"were not imported ({why})")
    return dataclasses.replace(cfg, mtp_num_layers=keep or None), notes


def _with_copies(conv: Conversion, copies: list[str]) -> Conversion:
    """``conv`` (a main table: one HF tensor, one megapipe tensor) with DeepSeek's copies of it: on import each must
    equal the main tensor, on export each is written as a copy of it."""

    def to_mp(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        for name, copy in zip(copies, tensors[1:], strict=True):
            if not torch.equal(copy, tensors[0]):
                raise MegapipeError(
                    f"{name} differs from {conv.hf[0]}: megapipe's MTP modules share the main model's embedding "
                    "table and output head, of which DeepSeek-V3's MTP layers hold copies (import with "
                    "--mtp-num-layers 0 to leave the MTP layers out)")
        return conv.to_mp(tensors[:1])

    def to_hf(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        main = conv.to_hf(tensors)
        return main + [main[0].clone() for _ in copies]

    return Conversion(hf=conv.hf + tuple(copies), mp=conv.mp, to_mp=to_mp, to_hf=to_hf)


@register
class DeepseekV32Adapter(DeepseekV3Adapter):
    """DeepseekV32ForCausalLM (DeepSeek-V3.2): DeepSeek-V3 with DeepSeek Sparse Attention (megapipe.models.dsa), its
    indexer's tensors under ``self_attn.indexer``; the rope pairs always interleaved (the config has no
    rope_interleave). transformers leaves the MTP layers out of DeepseekV32 (it ignores ``model.layers.61.*``), so
    they are not imported (megapipe's MTP modules take no sparse attention yet)."""

    architecture = "DeepseekV32ForCausalLM"
    model_type = "deepseek_v32"
    arch = "deepseek_v32"
    family = "deepseek_v32"
    fp32_tensors = DeepseekV3Adapter.fp32_tensors + ("attention.indexer.head_weights.weight",)

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if not hf.get("q_lora_rank"):
            raise refuse(where, "q_lora_rank", hf.get("q_lora_rank"), "DeepSeek-V3.2's indexer reads the query latent")
        fields = super().config_from_hf({**hf, "rope_interleave": True, "num_nextn_predict_layers": 0}, where)
        fields.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=int(hf.get("index_n_heads", 64)),
                      dsa_indexer_head_dim=int(hf.get("index_head_dim", 128)),
                      dsa_indexer_topk=int(hf.get("index_topk", 2048)))
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        hf.pop("rope_interleave")
        hf.update(index_n_heads=cfg.dsa_indexer_n_heads, index_head_dim=cfg.dsa_indexer_head_dim,
                  index_topk=cfg.dsa_indexer_topk)
        return hf

    def fit(self, cfg: ModelConfig, names: set[str], mtp_num_layers: Optional[int], where: str
            ) -> tuple[ModelConfig, list[str]]:
        if mtp_num_layers:
            raise MegapipeError(f"{where}: --mtp-num-layers {mtp_num_layers}: DeepSeek-V3.2's multi-token-prediction "
                                "layers are not supported (megapipe's MTP modules take no sparse attention yet)")
        have = sorted({mtp_layer_of(n, cfg) for n in names} - {None})
        notes = [f"the checkpoint's {len(have)} multi-token-prediction layer(s) (model.layers.{cfg.num_layers}.* on) "
                 "were not imported (DeepSeek-V3.2's MTP is not supported)"] if have else []
        return cfg, notes

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        return super().ignored(name, cfg) or mtp_layer_of(name, cfg) is not None
