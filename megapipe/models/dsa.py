"""DeepSeek Sparse Attention (DeepSeek-V3.2; Megatron's ``--experimental-attention-variant dsa``): multi-latent
attention where each query attends only to the ``dsa_indexer_topk`` earlier tokens a *lightning indexer* scores
highest.

The indexer has its own small heads: queries ``wq`` from MLA's normed query latent, one key per token ``wk`` (then a
LayerNorm), both roped on their first ``qk_pos_emb_head_dim`` dims in the rotate-half layout (whatever MLA's own
layout), and a weight per head and token ``head_weights``. A token's score for key t is
``sum_h w_h * relu(q_h . k_t) / sqrt(index_head_dim) / sqrt(heads)``. The selected keys (within what the causal or
document mask allows) become a mask on MLA's attention; a row never loses its own allowed keys below ``topk``.

Training: as in transformers' DeepseekV32 the indexer's selection runs without autograd, so no gradient reaches it
through the top-k (a non-differentiable choice). With ``dsa_indexer_loss_coeff`` 0 (the default) its weights keep
what the checkpoint holds: frozen parameters (``requires_grad`` false), which optimizers and data parallelism leave
alone. Above 0 the indexer learns from its own loss (DeepSeek-V3.2's, Megatron's ``--dsa-indexer-loss-coeff``, the
dense form): ``coeff`` times the mean over queries of KL(p || softmax(index scores)) over the keys the causal or
document mask allows, p the main attention's probabilities summed over heads and L1-normalised. The main attention
and the indexer's inputs are detached, so the loss trains the indexer only and the LM loss never reaches it; the
loss enters backward as the MoE balancing losses do (``AuxLossBackward``, weighed by ``aux_loss_scale``) and is
never part of the reported loss. It holds [B, heads, S, S] probabilities (no fused kernel), and tensor parallelism
(which splits the heads the target sums) is refused with it.

A KV cache stores each token's indexer key beside its latent (``kv_layout``); the cache's ``attend_latent`` takes
the indexer's queries (``IndexerQueries``) and applies the top-k itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.attention import DocumentMask, additive
from megapipe.models.dense import TransformerBlock, dense_tp_plan
from megapipe.models.mla import LATENT_NORM_EPS, MLA, MLA_MOE, MLAttention, mla_attention_tp_plan
from megapipe.models.moe import AuxLossBackward, MoEBlock, moe_tp_plan
from megapipe.models.rope import apply_rope
from megapipe.models.spec import BlockSpec, register_block, replicated_style

SCORE_ELEMENTS = 1 << 26  # per-head index scores held at once (256 MiB in fp32)


@dataclass
class IndexerQueries:
    """What the indexer scores keys with: q [B, S, heads, D] (roped), weights [B, S, heads] (fp32, 1 / sqrt(heads)
    in), the dot products' scale and the top-k size."""

    q: torch.Tensor
    weights: torch.Tensor
    scale: float
    topk: int

    def scores(self, keys: torch.Tensor) -> torch.Tensor:
        """keys [B, T, D] -> index scores [B, S, T] (fp32): per head relu(scale * q . k), weighted and summed over
        heads (in transformers' order of operations, so near-ties break alike)."""
        per_head = torch.matmul(self.q.float(), keys.float().transpose(-1, -2)[:, None])  # [B, S, H, T]
        per_head = per_head.mul_(self.scale).relu_()
        return torch.matmul(self.weights[:, :, None], per_head).squeeze(-2)

    def select(self, keys: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """keep [B, S, T] bool (the causal / document mask) -> keep & the top-k keys of each query; the per-head
        scores of at most SCORE_ELEMENTS at a time (query rows in blocks), so a long prefill needs no S x T x heads
        tensor."""
        b, s, heads = self.weights.shape
        t = keys.shape[1]
        k = min(self.topk, t)
        if k == t:
            return keep
        rows = max(1, SCORE_ELEMENTS // (b * heads * t))
        chosen = torch.zeros(keep.shape, dtype=torch.bool, device=keep.device)
        for i in range(0, s, rows):
            block = IndexerQueries(self.q[:, i:i + rows], self.weights[:, i:i + rows], self.scale, self.topk)
            scores = block.scores(keys).masked_fill_(~keep[:, i:i + rows], float("-inf"))
            chosen[:, i:i + rows].scatter_(-1, scores.topk(k, dim=-1).indices, True)
        return keep & chosen


class LightningIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.head_dim, self.rope_dim = cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.rope_dim
        self.topk = cfg.dsa_indexer_topk
        self.wq = nn.Linear(cfg.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=LATENT_NORM_EPS)
        self.head_weights = nn.Linear(cfg.hidden_size, self.heads, bias=False)

    def _rotate(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        """x [B, heads, S, D]: the first rope dims rotated (rotate-half), the rest kept."""
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope(rot, *rope), rest), dim=-1)

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple) -> IndexerQueries:
        b, s = x.shape[0], x.shape[1]
        q = self._rotate(self.wq(q_latent).view(b, s, self.heads, self.head_dim).transpose(1, 2), rope)
        weights = self.head_weights(x).float() * self.heads ** -0.5
        return IndexerQueries(q.transpose(1, 2), weights, self.head_dim ** -0.5, self.topk)

    def keys(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        """x [B, S, hidden] -> one key per token [B, S, D] (roped), what a KV cache keeps beside the latent."""
        return self._rotate(self.k_norm(self.wk(x))[:, None], rope)[:, 0]


class SparseMLAttention(MLAttention):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        self.indexer = LightningIndexer(cfg)
        self.loss_coeff = cfg.dsa_indexer_loss_coeff
        self.aux_loss_scale = 1.0  # set each step by megapipe.parallel.step, as the MoE layers'
        # without its loss nothing trains it (module docstring): frozen, so no layout waits on it
        self.indexer.requires_grad_(self.loss_coeff > 0)

    def forward(self, x: torch.Tensor, rope: tuple, cache=None, mask: Optional[DocumentMask] = None) -> torch.Tensor:
        bsz, seqlen = x.shape[0], x.shape[1]
        q_latent = self.q_norm(self.wq_a(x))
        q = self.queries(x, rope, q_latent)
        with torch.no_grad():  # the top-k is not differentiable: transformers' indexer runs without autograd too
            index = self.indexer.queries(x, q_latent, rope)
            index_keys = self.indexer.keys(x, rope)
        c_kv, k_rope = self.latent(x, rope)
        if cache is not None:
            out = cache.attend_latent(self, q, c_kv, k_rope, index=index, index_keys=index_keys)
        else:
            keep = mask.bool_mask[:, 0] if mask is not None else torch.ones(
                seqlen, seqlen, dtype=torch.bool, device=x.device).tril().expand(bsz, -1, -1)
            with torch.no_grad():
                allowed = index.select(index_keys, keep)
            k, v = self.expand(c_kv, k_rope)
            if allowed is keep and mask is None:
                out = self.sdpa(q, k, v)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive(allowed[:, None], q.dtype))
            if self.loss_coeff > 0 and torch.is_grad_enabled():
                loss = self.indexer_loss(x, q_latent, rope, q, k, keep)
                out = AuxLossBackward.apply(out, loss, self.aux_loss_scale)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def indexer_loss(self, x: torch.Tensor, q_latent: torch.Tensor, rope: tuple, q: torch.Tensor, k: torch.Tensor,
                     keep: torch.Tensor) -> torch.Tensor:
        """The indexer's loss (module docstring) for the attention's q [B, heads, S, D] (softmax scale folded in), k
        [B, heads, T, D] and keep [B, S, T] bool; differentiable in the indexer's weights only."""
        x, q_latent = x.detach(), q_latent.detach()
        index = self.indexer.queries(x, q_latent, rope).scores(self.indexer.keys(x, rope))
        index = index.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        logits = torch.matmul(q.detach().float(), k.detach().float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        target = logits.masked_fill(~keep[:, None], float("-inf")).softmax(dim=-1).sum(dim=1)
        target = target / target.sum(dim=-1, keepdim=True)
        kl = target * (torch.log(target + 1e-10) - torch.log(index + 1e-10))  # Megatron's guard against log(0)
        return self.loss_coeff * kl.sum(dim=-1).mean()


class DSABlock(TransformerBlock):
    """The dense block with DeepSeek Sparse Attention."""

    attention_class = SparseMLAttention


class DSAMoEBlock(MoEBlock):
    """The MoE block with DeepSeek Sparse Attention."""

    attention_class = SparseMLAttention


def indexer_tp_plan() -> dict:
    """The indexer is replicated on every TP rank: it reads the whole (replicated) input and query latent, and as
    it is frozen nothing is reduced."""
    return {f"attention.indexer.{name}": replicated_style() for name in ("wq", "wk", "k_norm", "head_weights")}


def dsa_dense_tp_plan(block: DSABlock, sp: bool) -> dict:
    ffn = {k: v for k, v in dense_tp_plan(block, sp).items() if not k.startswith("attention")}
    return {**ffn, **mla_attention_tp_plan(block, sp), **indexer_tp_plan()}


def dsa_moe_tp_plan(block: DSAMoEBlock, sp: bool) -> dict:
    moe = {k: v for k, v in moe_tp_plan(block, sp).items() if not k.startswith("attention")}
    return {**moe, **mla_attention_tp_plan(block, sp), **indexer_tp_plan()}


_INDEXER = {  # DeepseekV32ForCausalLM
    "attention.indexer.wq": "self_attn.indexer.wq_b",
    "attention.indexer.wk": "self_attn.indexer.wk",
    "attention.indexer.k_norm": "self_attn.indexer.k_norm",
    "attention.indexer.head_weights": "self_attn.indexer.weights_proj",
}

DSA = register_block(BlockSpec(
    name="dsa", module=DSABlock, tp_plan=dsa_dense_tp_plan,
    hf_names={"deepseek_v32": {**MLA.hf_names["deepseek_v3"], **_INDEXER}},
))

DSA_MOE = register_block(BlockSpec(
    name="dsa_moe", module=DSAMoEBlock, tp_plan=dsa_moe_tp_plan,
    hf_names={"deepseek_v32": {**MLA_MOE.hf_names["deepseek_v3"], **_INDEXER}},
))
