"""Multi-head / grouped-query self-attention on F.scaled_dot_product_attention.

Head counts are read from the projected tensors (``view(..., -1, head_dim)``), never from the config, so a
tensor-parallel plan that shards wq/wk/wv by heads works unchanged with the local number of heads.

Packed sequences: a ``DocumentMask`` (built once per forward from per-token document ids) keeps the documents of
one row apart, block-diagonal and causal. A KV cache is only ever used through its methods: the model calls
``cache.advance(positions)`` once per forward and each layer ``cache.attend(layer_id, q, k, v)``, which stores the
new keys/values and returns the attention output, so a paged cache (megapipe.inference) replaces the contiguous one
without touching the model.

Per-layer windows: each layer's ``CausalSDPA`` holds its own window (``cfg.layer_window``), and applies it to the
model's one DocumentMask (``windowed``). Attention sinks (GPT-OSS): a learned logit per head joins every softmax
row's denominator; ``sink_attention`` computes it exactly with SDPA by one extra key that every query sees.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.norms import RMSNorm
from megapipe.models.rope import apply_rope


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local part (a DTensor's under tensor / expert parallelism; the module computes with what this
    rank holds)."""
    return t.to_local() if hasattr(t, "to_local") else t


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
        self.positions, self.sliding_window = positions, sliding_window
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
        self._windowed: dict = {}

    def for_dtype(self, dtype: torch.dtype, sink: bool = False) -> torch.Tensor:
        """The additive mask; ``sink``: with one more key column every token attends (``sink_attention``)."""
        if (dtype, sink) not in self._additive:
            keep = with_sink_column(self.bool_mask) if sink else self.bool_mask
            self._additive[dtype, sink] = additive(keep, dtype)
        return self._additive[dtype, sink]

    def windowed(self, window: Optional[int]) -> "DocumentMask":
        """This mask with at most ``window - 1`` positions back as well (one per window, made once per forward)."""
        if window is None or window == self.sliding_window:
            return self
        if window not in self._windowed:
            self._windowed[window] = DocumentMask(self.document_ids, self.positions, window, self.prefix_ids)
        return self._windowed[window]


def additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> 0 / -inf in ``dtype``."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def with_sink_column(keep: torch.Tensor) -> torch.Tensor:
    """[..., Sq, Sk] bool -> [..., Sq, Sk + 1]: the sink key last, seen by every query."""
    return torch.cat([keep, keep.new_ones(*keep.shape[:-1], 1)], dim=-1)


SINK_PAD = 8  # extra q/k dims of sink_attention (one carries the sink; 8 keeps the head dim a multiple of 8)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink_h] per row, the sink column dropped, times v: exact, through SDPA (its fused CPU /
    CUDA kernels, autograd to ``sinks`` included). q [B, H, S, D], k/v [B, KV, S, D], sinks [H], ``mask``: the
    additive mask [.., S, S + 1] of the keys plus the sink key (``with_sink_column``).

    Each query gets one more dim holding sink_h / scale, every key a 0 there, and one extra key (a 1 there, zeros
    elsewhere, a zero value): its score is sink_h for query head h (the GQA-shared keys need not know h), the real
    scores are unchanged, and its zero value adds nothing to the output."""
    b, h, s, d = q.shape
    kv, sk = k.shape[1], k.shape[2]
    scale = d ** -0.5
    sink_dims = torch.zeros(b, h, s, SINK_PAD, dtype=q.dtype, device=q.device)
    sink_q = torch.cat([(sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, s, 1), sink_dims[..., 1:]], -1)
    q = torch.cat([q, sink_q], dim=-1)
    sink_key = torch.zeros(b, kv, 1, d + SINK_PAD, dtype=k.dtype, device=k.device)
    sink_key[..., d] = 1
    k = torch.cat([torch.cat([k, k.new_zeros(b, kv, sk, SINK_PAD)], dim=-1), sink_key], dim=2)
    v = torch.cat([v, v.new_zeros(b, kv, 1, v.shape[-1])], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=kv != h)


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
                 mask: Optional[DocumentMask] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        if mask is not None:
            mask = mask.windowed(self.sliding_window)
        if sinks is not None:
            if mask is not None:
                return sink_attention(q, k, v, sinks, mask.for_dtype(q.dtype, sink=True))
            window = self.sliding_window or k.shape[2]
            keep = sliding_window_mask(q.shape[2], k.shape[2], window, q.device)
            return sink_attention(q, k, v, sinks, additive(with_sink_column(keep), q.dtype))
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
        self.sdpa = CausalSDPA(cfg.layer_window(layer_id))
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None
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
        sinks = {} if self.sinks is None else {"sinks": local(self.sinks)}
        if cache is not None:
            if sinks and not getattr(cache, "takes_sinks", False):
                raise NotImplementedError(f"{type(cache).__name__} applies no attention sinks (GPT-OSS: decode through "
                                          "the engine's paged cache)")
            out = cache.attend(self.layer_id, q, k, v, **sinks)
        elif mask is not None:
            out = self.sdpa(q, k, v, mask=mask, **sinks)
        else:
            out = self.sdpa(q, k, v, **sinks)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
