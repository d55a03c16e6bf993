"""The paged KV cache: one pool of fixed-size blocks allocated at start, and the per-step attention over it.

Storage: per layer one key and one value tensor [kv_heads, num_blocks * block_size, head_dim]; a token's *slot* is
``block_id * block_size + offset``. A sequence owns a list of block ids (its block table), so its keys need not be
contiguous and blocks can be shared (prefix caching) or returned at any time.

An engine step runs the model once on a flattened batch: every scheduled token of every sequence in one row
[1, T] with its own position. :class:`PagedBatch` is what the model sees as its ``cache``: ``advance(positions)``
(nothing to do: the step was planned by the engine) and ``attend(layer_id, q, k, v)``, which writes the new keys and
values into their slots and computes attention per sequence:

- one-token queries (decodes) together, as a padded batch over their gathered keys, in two matmuls;
- longer chunks (prefill, chunked prefill, recompute after preemption) one sequence at a time with SDPA, causal from
  the chunk's first position, over the sequence's earlier keys when it does not start at 0.

Tokens are ordered decodes first, then the chunks, so each group is a contiguous slice of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

KEY_BUCKET = 64


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, torch.device(device)
        shape = (kv_heads, num_blocks * block_size, head_dim)
        # zeros, not empty: a padded (masked) key must still be finite, or 0 * inf poisons the softmax
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


@dataclass
class Chunk:
    """Tokens [offset, offset + n) of the flattened batch are positions [start, start + n) of one sequence."""

    offset: int
    start: int
    n: int
    key_slots: Optional[torch.Tensor]  # slots of positions [0, start + n), or None when start == 0 (keys are local)
    mask: Optional[torch.Tensor]  # additive [n, start + n] when plain causal does not describe it


def _slots(block_ids: Sequence[int], block_size: int, length: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(length)]


class PagedBatch:
    """The ``cache`` object of one engine step (see the module docstring)."""

    def __init__(self, pool: KVPool, sliding_window: Optional[int] = None):
        self.pool, self.window = pool, sliding_window
        self.slots: Optional[torch.Tensor] = None  # [T] where each token's k/v go
        self.num_decodes = 0
        self.decode_slots: Optional[torch.Tensor] = None  # [Bd * L] keys of each decode, padded to L
        self.decode_mask: Optional[torch.Tensor] = None  # additive [1, Bd, 1, L] fp32
        self.decode_len = 0
        self.chunks: list[Chunk] = []

    def plan(self, decodes: Sequence[tuple[Sequence[int], int]], chunks: Sequence[tuple[Sequence[int], int, int]]):
        """decodes: (block ids, position) of each one-token query; chunks: (block ids, start, n). Returns the
        positions [1, T] of the flattened batch in that order."""
        bs, dev = self.pool.block_size, self.pool.device
        slots, positions = [], []
        for blocks, pos in decodes:
            slots.append(blocks[pos // bs] * bs + pos % bs)
            positions.append(pos)
        self.num_decodes = len(decodes)
        if decodes:
            # keys padded to a multiple of 64 (masked): oneDNN builds a kernel per matmul shape, so a length that
            # grows by one every step would make it build two new ones every step
            length = -(-(max(pos for _, pos in decodes) + 1) // KEY_BUCKET) * KEY_BUCKET
            nb = (length + bs - 1) // bs
            table = torch.tensor([list(b[:nb]) + [0] * (nb - len(b[:nb])) for b, _ in decodes], dtype=torch.long)
            key_slots = (table[:, :, None] * bs + torch.arange(bs)).view(len(decodes), -1)[:, :length]
            ctx = torch.tensor([pos for _, pos in decodes])
            keys = torch.arange(length)
            allowed = keys[None] <= ctx[:, None]
            if self.window is not None:
                allowed &= ctx[:, None] - keys[None] < self.window
            mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
            self.decode_slots = key_slots.reshape(-1).to(dev)
            self.decode_mask = mask[None, :, None].to(dev)
            self.decode_len = length
        self.chunks = []
        offset = len(decodes)
        for blocks, start, n in chunks:
            slots.extend(_slots(blocks, bs, start + n)[start:])
            positions.extend(range(start, start + n))
            key_slots = None if start == 0 else torch.tensor(_slots(blocks, bs, start + n), device=dev)
            mask = None
            if start > 0 or (self.window is not None and n > self.window):
                q_pos = torch.arange(start, start + n)[:, None]
                k_pos = torch.arange(start + n)[None] if start > 0 else torch.arange(n)[None]
                allowed = k_pos <= q_pos
                if self.window is not None:
                    allowed &= q_pos - k_pos < self.window
                mask = torch.zeros(allowed.shape, dtype=self.pool.dtype).masked_fill_(~allowed, float("-inf")).to(dev)
            self.chunks.append(Chunk(offset, start, n, key_slots, mask))
            offset += n
        self.slots = torch.tensor(slots, dtype=torch.long, device=dev)
        return torch.tensor([positions], dtype=torch.long, device=dev)

    def advance(self, positions: torch.Tensor) -> None:
        """Called by the model once per forward; the step was planned already."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, heads, T, D], k/v [1, kv_heads, T, D] -> attention output [1, heads, T, D]."""
        pk, pv = self.pool.k[layer_id], self.pool.v[layer_id]
        pk.index_copy_(1, self.slots, k[0].to(pk.dtype))
        pv.index_copy_(1, self.slots, v[0].to(pv.dtype))
        heads, total, dim = q.shape[1], q.shape[2], q.shape[3]
        out = torch.empty(total, heads, dim, dtype=q.dtype, device=q.device)
        if self.num_decodes:
            dec = self._decode(q[0, :, : self.num_decodes], pk, pv)
            if not self.chunks:
                return dec.transpose(0, 1)[None]
            out[: self.num_decodes] = dec
        for c in self.chunks:
            qc = q[:, :, c.offset:c.offset + c.n]
            if c.key_slots is None:
                kc, vc = k[:, :, c.offset:c.offset + c.n], v[:, :, c.offset:c.offset + c.n]
            else:
                kc, vc = pk.index_select(1, c.key_slots)[None], pv.index_select(1, c.key_slots)[None]
            gqa = kc.shape[1] != heads
            if c.mask is None:
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask.to(qc.dtype), enable_gqa=gqa)
            out[c.offset:c.offset + c.n] = o[0].transpose(0, 1)
        return out.transpose(0, 1)[None]

    def _decode(self, q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
        """q [heads, Bd, D] one token per sequence -> [Bd, heads, D]; the matmuls in the model's dtype, the softmax
        in fp32 (as HF's eager attention does)."""
        heads, bd, dim = q.shape
        kvh, length = pk.shape[0], self.decode_len
        group = heads // kvh
        keys = pk.index_select(1, self.decode_slots).view(kvh, bd, length, dim)
        values = pv.index_select(1, self.decode_slots).view(kvh, bd, length, dim)
        qg = q.reshape(kvh, group, bd, dim).transpose(1, 2)  # head h reads kv head h // group, as SDPA's GQA
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(dim ** -0.5).add_(self.decode_mask)
        probs = scores.softmax(dim=-1).to(values.dtype)
        o = torch.matmul(probs, values)  # [kvh, Bd, group, D]
        return o.permute(1, 0, 2, 3).reshape(bd, heads, dim).to(q.dtype)
