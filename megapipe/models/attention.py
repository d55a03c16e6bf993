"""Multi-head / grouped-query self-attention on F.scaled_dot_product_attention.

Head counts are read from the projected tensors (``view(..., -1, head_dim)``), never from the config, so a
tensor-parallel plan that shards wq/wk/wv by heads works unchanged with the local number of heads.
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


class CausalSDPA:
    """The default ``attention.sdpa``: q [B, heads, S, D], k/v [B, kv_heads, S, D] -> out [B, heads, S, D].

    k/v keep their own (GQA) head count: query head h uses kv head h // (heads // kv_heads). Context parallelism
    replaces this by its own callable with the same signature. A sliding window becomes an explicit mask once the
    sequence is longer than the window.
    """

    def __init__(self, sliding_window: Optional[int] = None):
        self.sliding_window = sliding_window

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
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

    def forward(self, x: torch.Tensor, rope: Optional[tuple], cache=None) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        bsz, seqlen = q.shape[0], q.shape[1]
        q = q.view(bsz, seqlen, -1, self.head_dim)
        k = k.view(bsz, seqlen, -1, self.head_dim)
        v = v.view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v)
        if cache is None:
            out = self.sdpa(q, k, v)
        else:
            gqa = k.shape[1] != q.shape[1]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.attn_mask, is_causal=cache.is_causal,
                                                 enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
