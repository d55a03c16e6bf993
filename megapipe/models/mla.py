"""Multi-latent attention (DeepSeek-V2/V3, Megatron's MLA), with the block kinds that use it and their spec.

Queries: ``wq`` (one projection) or ``wq_a`` -> ``q_norm`` -> ``wq_b`` (a q_lora_rank bottleneck). Keys and values:
``wkv_a`` projects to a kv_lora_rank latent ``c_kv`` (normed by ``kv_norm``) plus one rope key shared by all heads;
``wkv_b`` expands ``c_kv`` to each head's non-rotary key and value. Per head the key is [k_nope, k_rope], the query
[q_nope, q_rope]; only the rope parts are rotated. The softmax scale is DeepSeek's (``softmax_scale``); it is folded
into the query, so SDPA (and any ``sdpa`` or cache that replaces it) keeps its default scale.

Head counts are read from the projected tensors, so a tensor-parallel plan that splits ``wq``/``wq_b``, ``wkv_b`` and
``wo`` by heads works unchanged. A KV cache is used through ``cache.attend_latent(attention, q, c_kv, k_rope)``: the
engine's latent cache (megapipe.inference.kv_cache) stores ``latent(x, rope)`` (kv_lora_rank + rope dims per token),
absorbs the up-projections (``kv_up_weights``) into the query and the output where it decodes, and ``expand``s the
latents where it prefills.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.attention import CausalSDPA, DocumentMask
from megapipe.models.dense import DENSE, TransformerBlock, dense_tp_plan, norms_tp_plan
from megapipe.models.moe import MoEBlock, moe_tp_plan
from megapipe.models.norms import RMSNorm
from megapipe.models.rope import apply_rope, apply_rope_interleaved, yarn_mscale
from megapipe.models.spec import BlockSpec, register_block, replicated_style, sum_gradient_style

LATENT_NORM_EPS = 1e-6  # DeepSeek's and transformers' q/kv latent norms keep this default, whatever rms_norm_eps is


def softmax_scale(cfg: ModelConfig) -> float:
    """DeepSeek's: (qk_head_dim + qk_pos_emb_head_dim) ** -0.5 * mscale(factor, mscale_all_dim) ** 2."""
    m = yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) if cfg.mscale_all_dim else 1.0
    return (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) ** -0.5 * m * m


class MLAttention(nn.Module):
    plain_linears = ("wkv_b",)  # an engine that repacks linears keeps this one: a latent cache reads its weight

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        h, n = cfg.hidden_size, cfg.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope_dim + self.rope_dim
        self.wq = self.wq_a = self.q_norm = self.wq_b = None
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, n * qk, bias=False)
        else:
            self.wq = nn.Linear(h, n * qk, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, n * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(n * self.v_dim, h, bias=cfg.attn_out_bias)
        # the rope key passes here on its way to every head: a TP plan reduces its gradient over the head shards
        self.shared_rope_key = nn.Identity()
        self.rotate = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        self.query_scale = softmax_scale(cfg) * math.sqrt(qk)  # times SDPA's default 1 / sqrt(qk)
        self.sdpa = CausalSDPA()

    def queries(self, x: torch.Tensor, rope: tuple, q_latent: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, S, hidden] -> q [B, heads, S, qk] ([q_nope, rotated q_rope]), the softmax scale folded in;
        ``q_latent``: the normed query latent when the caller computed it already."""
        if self.wq is not None:
            q = self.wq(x)
        else:
            q = self.wq_b(q_latent if q_latent is not None else self.q_norm(self.wq_a(x)))
        q = q.view(x.shape[0], x.shape[1], -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat((q_nope, self.rotate(q_rope, *rope)), dim=-1)
        return q if self.query_scale == 1.0 else q * self.query_scale

    def latent(self, x: torch.Tensor, rope: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """What a latent KV cache stores per token: x [B, S, hidden] -> (c_kv [B, S, kv_lora_rank], normed;
        k_rope [B, 1, S, rope dims], rotated)."""
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        k_rope = self.rotate(self.shared_rope_key(k_rope)[:, None], *rope)
        return self.kv_norm(c_kv), k_rope

    def expand(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decompressed keys and values: k [B, heads, S, qk] ([k_nope, k_rope]), v [B, heads, S, v]."""
        b, s = c_kv.shape[0], c_kv.shape[1]
        kv = self.wkv_b(c_kv).view(b, s, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1), v

    def kv_up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``wkv_b``'s halves per head, for absorbing them: w_uk [heads, qk_head_dim, kv_lora_rank] (q_nope @ w_uk
        scores against c_kv directly) and w_uv [heads, v_head_dim, kv_lora_rank] (the output per head is
        w_uv @ (attention-weighted c_kv)). Local heads under tensor parallelism."""
        w = self.wkv_b.weight
        w = (w.to_local() if hasattr(w, "to_local") else w).view(-1, self.nope_dim + self.v_dim, self.kv_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def forward(self, x: torch.Tensor, rope: tuple, cache=None, mask: Optional[DocumentMask] = None) -> torch.Tensor:
        bsz, seqlen = x.shape[0], x.shape[1]
        q = self.queries(x, rope)
        if cache is not None:
            out = cache.attend_latent(self, q, *self.latent(x, rope))
        else:
            out = self.sdpa(q, *self.expand(*self.latent(x, rope)), mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class MLABlock(TransformerBlock):
    """The dense block with multi-latent attention."""

    attention_class = MLAttention


class MLAMoEBlock(MoEBlock):
    """The MoE block with multi-latent attention."""

    attention_class = MLAttention


# --------------------------------------------------------------------------------------------------- TP


def mla_attention_tp_plan(block: nn.Module, sp: bool) -> dict:
    """Megatron's MLA split: heads over TP ranks (``wq`` / ``wq_b`` and ``wkv_b`` by output features, ``wo`` by
    input features: one reduction), the down projections, their norms and the shared rope key replicated. The
    attention's input is the whole sequence as a plain tensor, so the replicated layers compute the same on every
    rank; the gradients reaching the latents from the head shards are summed over TP ranks (by ``wq_b``'s and
    ``wkv_b``'s column-parallel input, and for the rope key by ``shared_rope_key``), so those layers' gradients are
    whole on every rank (``replicated_style``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    act = Shard(1) if sp else Replicate()
    attn = block.attention
    plan = {
        "attention": PrepareModuleInput(  # (x, rope, cache, mask)
            input_layouts=(act, None, None, None), desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True),
        "attention.wq_b" if attn.wq is None else "attention.wq": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.shared_rope_key": sum_gradient_style(),
        "attention.wo": RowwiseParallel(output_layouts=act),
    }
    replicated = ["attention.wkv_a", "attention.kv_norm"] + (["attention.wq_a", "attention.q_norm"] if attn.wq is None
                                                             else [])
    plan.update({name: replicated_style() for name in replicated})
    plan.update(norms_tp_plan(sp))
    return plan


def mla_dense_tp_plan(block: MLABlock, sp: bool) -> dict:
    ffn = {k: v for k, v in dense_tp_plan(block, sp).items() if not k.startswith("attention")}
    return {**ffn, **mla_attention_tp_plan(block, sp)}


def mla_moe_tp_plan(block: MLAMoEBlock, sp: bool) -> dict:
    moe = {k: v for k, v in moe_tp_plan(block, sp).items() if not k.startswith("attention")}
    return {**moe, **mla_attention_tp_plan(block, sp)}


# --------------------------------------------------------------------------------------------------- HF names

_ATTENTION = {  # DeepseekV3ForCausalLM
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
}
_MLP = {k: v for k, v in DENSE.hf_names["llama"].items() if k.startswith("feed_forward")}
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

MLA = register_block(BlockSpec(
    name="mla", module=MLABlock, tp_plan=mla_dense_tp_plan, hf_names={"deepseek_v3": {**_ATTENTION, **_MLP}},
))

MLA_MOE = register_block(BlockSpec(
    name="mla_moe",
    module=MLAMoEBlock,
    tp_plan=mla_moe_tp_plan,
    hf_names={"deepseek_v3": {
        **_ATTENTION,
        "moe.gate": "mlp.gate",
        "moe.expert_bias": "mlp.gate.e_score_correction_bias",  # a whole tensor's name (a buffer)
        **{f"moe.experts.{w}": f"mlp.experts.{{e}}.{hf}.weight" for w, hf in _EXPERTS.items()},
        **{f"moe.shared_experts.{w}": f"mlp.shared_experts.{hf}" for w, hf in _EXPERTS.items()},
    }},
))
