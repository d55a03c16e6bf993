"""Multi-head / grouped-query self-attention on F.scaled_dot_product_attention.

Head counts are read from the projected tensors (``view(..., -1, head_dim)``), never from the config, so a
tensor-parallel plan that shards wq/wk/wv by heads works unchanged with the local number of heads.

Packed sequences: a ``DocumentMask`` (built once per forward from per-token document ids) keeps the documents of
one row apart, block-diagonal and causal. A KV cache is only ever used through its methods: the model calls
``cache.advance(positions)`` once per forward and each layer ``cache.attend(layer_id, q, k, v)``, which stores the
new keys/values and returns the attention output, so a paged cache (megapipe.inference) replaces the contiguous one
without touching the model.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.norms import RMSNorm
from megapipe.models.rope import apply_rope


def sliding_window_mask(q_len: int, k_len: int, window: int, device) -> torch.Tensor:
    """Bool mask [q_len, k_len], True = attend: causal, and at most ``window - 1`` positions back."""
    q = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k = torch.arange(k_len, device=device)[None]
    return (k <= q) & (q - k < window)


class DocumentMask:
    """Block-diagonal causal attention over packed documents: token i attends to j iff j <= i, both lie in the same
    document (equal document id) and, with a sliding window, position(i) - position(j) < window.

    ``document_ids`` [B, S] (any integers; a new id starts a new document). ``prefix_ids`` [B, S] (optional): token
    i also attends to the earlier tokens of document ``prefix_ids[i]``, a shared prefix that several documents
    continue (one prompt before its sampled completions, each completion seeing the prompt and itself only); a
    token with no such prefix names its own document. The bool mask is built once per forward and turned into the
    additive form SDPA's CPU kernels are fastest with, once per dtype.
    """

    def __init__(self, document_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
                 sliding_window: Optional[int] = None, prefix_ids: Optional[torch.Tensor] = None):
        self.document_ids, self.prefix_ids = document_ids, prefix_ids  # what a recurrent layer (Mamba) resets on
        s = document_ids.shape[-1]
        causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
        same = document_ids[:, :, None] == document_ids[:, None, :]
        if prefix_ids is not None:
            same |= prefix_ids[:, :, None] == document_ids[:, None, :]
        mask = same & causal
        if sliding_window is not None:
            pos = positions if positions is not None else torch.arange(s, device=document_ids.device)
            pos = pos.expand_as(document_ids)
            mask &= (pos[:, :, None] - pos[:, None, :]) < sliding_window
        self.bool_mask = mask[:, None]  # [B, 1, S, S]
        self._additive: dict = {}

    def for_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._additive:
            zeros = torch.zeros(self.bool_mask.shape, dtype=dtype, device=self.bool_mask.device)
            self._additive[dtype] = zeros.masked_fill_(~self.bool_mask, float("-inf"))
        return self._additive[dtype]


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids -> positions that restart at 0 where each document starts."""
    s = document_ids.shape[-1]
    idx = torch.arange(s, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - first


class CausalSDPA:
    """The default ``attention.sdpa``: q [B, heads, S, D], k/v [B, kv_heads, S, D] -> out [B, heads, S, D].

    k/v keep their own (GQA) head count: query head h uses kv head h // (heads // kv_heads). Context parallelism
    replaces this by its own callable with the same signature. A sliding window becomes an explicit mask once the
    sequence is longer than the window. ``mask`` (a DocumentMask) replaces the causal rule for packed sequences.
    """

    def __init__(self, sliding_window: Optional[int] = None):
        self.sliding_window = sliding_window

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: Optional[DocumentMask] = None) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.for_dtype(q.dtype), enable_gqa=gqa)
        if self.sliding_window is not None and k.shape[2] > self.sliding_window:
            mask = sliding_window_mask(q.shape[2], k.shape[2], self.sliding_window, q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = hd = cfg.dim_per_head
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden_size, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden_size, cfg.kv_heads * hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.attn_out_bias)
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.sdpa = CausalSDPA(cfg.sliding_window)
        self.key_multiplier = cfg.key_multiplier  # Falcon-H1's, on the keys before RoPE (1: none)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k, v projections (one method, so an inference engine can swap in a fused matmul)."""
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x: torch.Tensor, rope: Optional[tuple], cache=None,
                mask: Optional[DocumentMask] = None) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        bsz, seqlen = q.shape[0], q.shape[1]
        q = q.view(bsz, seqlen, -1, self.head_dim)
        k = k.view(bsz, seqlen, -1, self.head_dim)
        if self.key_multiplier != 1:
            k = k * self.key_multiplier
        v = v.view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            out = cache.attend(self.layer_id, q, k, v)
        elif mask is not None:
            out = self.sdpa(q, k, v, mask=mask)
        else:
            out = self.sdpa(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
