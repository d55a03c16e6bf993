"""DeepSeek-V4's hybrid attention (model.attention_layer_types): one shared key/value head over a sliding window, plus,
on compressed layers, entries pooled from blocks of past tokens that every query may also attend to.

Per layer: queries through a low-rank bottleneck (``wq_a`` -> ``q_norm`` -> ``wq_b``), each head RMS-normed without
a weight; one key = value head (``wkv`` -> ``kv_norm``); rope on the last ``qk_pos_emb_head_dim`` dims of each head
(interleaved pairs, ``rotate_trailing_pairs``), undone on the output (the value was rotated with the key); learned
sinks per head (megapipe.models.attention.sink_attention); the output projected per group of heads (``wo_a``, one
o_lora_rank block per group) then mixed (``wo_b``).

- sliding_attention: the last ``sliding_window`` tokens only (rope base ``rope_theta``).
- heavily_compressed_attention (HCA): every ``hca_compress_rate`` tokens pooled into one entry (a softmax over the
  block of a learned gate plus a per-slot bias, weighting the projected tokens), all of them visible once their
  block is complete.
- compressed_sparse_attention (CSA): every ``csa_compress_rate`` tokens one entry pooled over the block and the one
  before it (two projections per token, one for each), and each query sees only the ``index_topk`` complete entries
  the lightning indexer scores highest (its own compressor at ``index_head_dim``, ``index_n_heads`` query heads:
  sum_h w_h relu(q_h . k)). The choice is not differentiable: the LM loss does not reach the indexer, whose weights
  are frozen (its own training loss is not implemented).
Compressed layers use rope base ``compress_rope_theta`` with YaRN (its cos / sin not rescaled) for queries, keys and
entries, an entry at the position of its block's first token.

The model reaches the layer through ``forward(x, positions, cache, mask)``: ``positions`` a ``V4Positions`` (both
ropes, the positions, the token ids the hash-routed MoE layers read). No packed documents (the blocks would
straddle them). Decoding: the engine's cache (``PagedBatch.attend_compressed``, megapipe.inference.compressed_cache)
keeps the window's keys and the entries, and calls ``project`` / ``Compressor.pool`` / the indexer's ``queries``,
``scores`` and ``choose`` / ``output`` itself.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.attention import additive, local, sink_attention, sliding_window_mask, with_sink_column
from megapipe.models.norms import RMSNorm
from megapipe.models.rope import inv_frequencies, pair_cos_sin, rotate_trailing_pairs, yarn_inv_frequencies

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


class V4Positions(NamedTuple):
    """What every DeepSeek-V4 layer takes in place of one rope: (cos, sin) of the sliding layers' rope and of the
    compressed layers' one, the positions [1 or B, S] and the token ids [B, S] (None on hidden-state input)."""

    main: tuple
    compress: tuple
    positions: torch.Tensor
    tokens: Optional[torch.Tensor]


def compress_inv_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """The compressed layers' rope frequencies: base compress_rope_theta, YaRN when rotary_scaling_factor != 1."""
    dims = cfg.qk_pos_emb_head_dim
    if cfg.rotary_scaling_factor == 1:
        return inv_frequencies(dims, cfg.compress_rope_theta, None, device)
    original = cfg.original_max_position_embeddings or cfg.max_position_embeddings
    return yarn_inv_frequencies(dims, cfg.compress_rope_theta, cfg.rotary_scaling_factor, original, cfg.beta_fast,
                                cfg.beta_slow, device, cfg.yarn_truncate)


def v4_positions(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype, device,
                 tokens: Optional[torch.Tensor]) -> V4Positions:
    main = inv_frequencies(cfg.qk_pos_emb_head_dim, cfg.rope_theta, None, device)
    if positions.dim() == 1:
        positions = positions[None]
    return V4Positions(pair_cos_sin(positions, main, dtype),
                       pair_cos_sin(positions, compress_inv_frequencies(cfg, device), dtype), positions, tokens)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Compressor(nn.Module):
    """Pools every ``rate`` tokens into one entry of ``dim``: softmax over the block's slots (per dim) of ``wgate``'s
    output plus ``position_bias``, weighting ``wkv``'s, then ``norm``. ``overlap`` (CSA): each token projects twice
    (2 * dim), the first half pooled into the next block's entry, the second into its own."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, hidden] -> entries [B, S // rate, dim] (a last incomplete block makes none)."""
        x = x[:, :x.shape[1] // self.rate * self.rate]
        return self.pool(self.wkv(x), self.wgate(x))

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, before: Optional[tuple] = None) -> torch.Tensor:
        """The projections ``wkv`` / ``wgate`` (no bias) of whole blocks [B, blocks * rate, width] -> their entries
        [B, blocks, dim]. ``before`` (overlap): the projections [B, rate, width] of the block before the first, a gate
        of -inf where there is none (the engine's cache, megapipe.inference.compressed_cache); None: block 0."""
        b, m, d, width = kv.shape[0], self.rate, self.dim, self.position_bias.shape[-1]
        blocks = kv.shape[1] // m
        if blocks == 0:
            return kv.new_zeros(b, 0, d)
        kv = kv.view(b, blocks, m, width)
        gate = gate.view(b, blocks, m, width) + self.position_bias
        if self.overlap:  # slots: the previous block's first halves (none before block 0), then its own second halves
            if before is None:
                first_kv, first_gate = kv.new_zeros(b, 1, m, d), gate.new_full((b, 1, m, d), -math.inf)
            else:
                first_kv, first_gate = before[0][:, None, :, :d], (before[1][..., :d] + self.position_bias[:, :d])[:, None]
            kv = torch.cat([torch.cat([first_kv.to(kv.dtype), kv[:, :-1, :, :d]], 1), kv[..., d:]], dim=2)
            gate = torch.cat([torch.cat([first_gate.to(gate.dtype), gate[:, :-1, :, :d]], 1), gate[..., d:]], dim=2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        return self.norm((kv * weights).sum(dim=2))


def entry_rope(entries: torch.Tensor, rate: int, inv_cos_sin_fn, first: int = 0) -> torch.Tensor:
    """Entries [B, T, dim] of blocks first, first + 1, ... rotated at their blocks' first positions."""
    cos, sin = inv_cos_sin_fn((torch.arange(entries.shape[1], device=entries.device) + first) * rate)
    return rotate_trailing_pairs(entries, cos[:, 0], sin[:, 0])


def complete_blocks(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """[1 or B, S]: how many blocks of ``rate`` tokens are complete at each position (the entries it may see)."""
    return (positions + 1) // rate


class Indexer(nn.Module):
    """The lightning indexer: its own overlapping compressor at ``index_head_dim``, queries from the attention's
    query latent; picks per query the ``index_topk`` complete entries with the highest sum_h w_h relu(q_h . k) /
    sqrt(index_head_dim) (w = ``weights_proj(x)`` / sqrt(index_n_heads))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.dim, self.topk, self.rate = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, \
            cfg.csa_compress_rate
        self.compressor = Compressor(cfg.hidden_size, self.dim, self.rate, True, cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        # frozen: the LM loss does not reach a top-k choice, and DeepSeek's own loss for it (the indexer's scores
        # against the attention's, V3.2's warm-up) is not implemented; so every layout updates the same weights
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, pos: V4Positions, entry_cos_sin) -> torch.Tensor:
        """-> [B, S, k] indices of the chosen entries, -1 where a query has fewer than k complete ones."""
        keys = entry_rope(self.compressor(x), self.rate, entry_cos_sin)  # [B, T, dim]
        scores = self.scores(*self.queries(x, q_latent, pos), keys)
        return self.choose(scores, complete_blocks(pos.positions, self.rate))

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, pos: V4Positions):
        """(queries [B, S, heads, dim] (roped), their head weights [B, S, heads] (fp32))."""
        b, s = x.shape[0], x.shape[1]
        q = rotate_trailing_pairs(self.wq_b(q_latent).view(b, s, self.heads, self.dim).transpose(1, 2),
                                  *pos.compress).transpose(1, 2)
        return q, self.weights_proj(x).float() * self.heads ** -0.5

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """queries [B, S, heads, dim], weights [B, S, heads], keys [B, T, dim] -> [B, S, T] fp32."""
        scores = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2)[:, None])) * self.dim ** -0.5
        return (scores * weights[..., None]).sum(dim=2)

    def choose(self, scores: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """scores [B, S, T], seen [1 or B, S] (complete entries per query) -> [B, S, min(k, T)], -1: none."""
        seen = seen[..., None]
        entries = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(entries >= seen, -math.inf)
        chosen = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return torch.where(chosen >= seen, torch.full_like(chosen, -1), chosen)


class CompressedAttention(nn.Module):
    plain_linears = ("wo_a",)  # read as one weight per group: an engine that repacks linears keeps this one

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        # an MTP block (layer_id >= num_layers) attends over the window only: the published configs' trailing
        # compress ratio (of the MTP layer) is 0
        self.layer_id = layer_id
        self.kind = cfg.attention_layer_types[layer_id] if layer_id < cfg.num_layers else "sliding_attention"
        h, n, hd = cfg.hidden_size, cfg.num_heads, cfg.dim_per_head
        self.head_dim, self.window, self.eps, self.o_rank = hd, cfg.sliding_window, cfg.norm_eps, cfg.o_lora_rank
        self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, n * hd, bias=False)
        self.wkv = nn.Linear(h, hd, bias=False)
        self.kv_norm = RMSNorm(hd, cfg.norm_eps)
        self.wo_a = nn.Linear(n * hd // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)  # per group
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.empty(n))
        self.compressor = self.indexer = None
        if self.kind != "sliding_attention":
            self.rate = cfg.csa_compress_rate if self.kind == CSA else cfg.hca_compress_rate
            self.compressor = Compressor(h, hd, self.rate, self.kind == CSA, cfg.norm_eps)
            self.indexer = Indexer(cfg) if self.kind == CSA else None
        self.cfg = cfg

    def forward(self, x: torch.Tensor, pos: V4Positions, cache=None, mask=None) -> torch.Tensor:
        if mask is not None:
            raise NotImplementedError("DeepSeek-V4 attention takes no packed documents (its compressed blocks would "
                                      "straddle them)")
        if cache is not None:
            if not hasattr(cache, "attend_compressed"):
                raise NotImplementedError(f"{type(cache).__name__} cannot hold DeepSeek-V4 attention: decode through "
                                          "the engine's paged cache")
            return cache.attend_compressed(self, x, pos)
        return self._attend(x, pos)

    def project(self, x: torch.Tensor, pos: V4Positions):
        """x [B, S, H] -> (the query latent [B, S, q_lora_rank], queries [B, heads, S, hd], the key = value
        [B, 1, S, hd], both roped, and this layer's (cos, sin))."""
        b, s = x.shape[0], x.shape[1]
        cos, sin = pos.main if self.compressor is None else pos.compress
        q_latent = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_latent).view(b, s, -1, self.head_dim), self.eps).transpose(1, 2)
        kv = rotate_trailing_pairs(self.kv_norm(self.wkv(x))[:, None], cos, sin)
        return q_latent, rotate_trailing_pairs(q, cos, sin), kv, (cos, sin)

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention's output [B, heads, S, hd] -> [B, S, H]: its rope undone, projected per group then mixed."""
        b, s = out.shape[0], out.shape[2]
        out = rotate_trailing_pairs(out, cos, -sin).transpose(1, 2)  # [B, S, heads, hd]
        w = local(self.wo_a.weight)  # tensor parallelism: this rank's groups (its heads' outputs)
        w = w.view(-1, self.o_rank, w.shape[-1])  # [groups, o_lora_rank, heads x hd / groups]
        grouped = out.reshape(b, s, w.shape[0], -1)
        return self.wo_b(torch.einsum("bsgi,gri->bsgr", grouped, w).flatten(2))

    def _attend(self, x: torch.Tensor, pos: V4Positions) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q_latent, q, kv, (cos, sin) = self.project(x, pos)
        keep = sliding_window_mask(s, s, self.window, x.device).expand(b, 1, s, s)
        if self.compressor is not None:
            entries, seen = self._entries(x, q_latent, pos)
            kv = torch.cat([kv, entries[:, None]], dim=2)
            keep = torch.cat([keep, seen[:, None]], dim=-1)
        out = sink_attention(q, kv, kv, local(self.sinks), additive(with_sink_column(keep), q.dtype))
        return self.output(out, cos, sin)

    def _entries(self, x: torch.Tensor, q_latent: torch.Tensor, pos: V4Positions):
        """(compressed entries [B, T, hd], which of them each query sees [B, S, T] bool)."""
        inv_freq = compress_inv_frequencies(self.cfg, x.device)

        def cos_sin(p):
            return pair_cos_sin(p, inv_freq, x.dtype)

        entries = entry_rope(self.compressor(x), self.rate, cos_sin)
        t = entries.shape[1]
        seen = torch.arange(t, device=x.device) < complete_blocks(pos.positions, self.rate)[..., None]
        seen = seen.expand(x.shape[0], -1, -1)
        if self.indexer is None:
            return entries, seen
        chosen = self.indexer(x, q_latent, pos, cos_sin)  # [B, S, k], -1: none
        picked = torch.zeros(*chosen.shape[:2], t + 1, dtype=torch.bool, device=x.device)
        picked.scatter_(-1, torch.where(chosen >= 0, chosen, t), True)
        return entries, picked[..., :t]
