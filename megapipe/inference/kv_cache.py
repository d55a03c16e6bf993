"""A preallocated key/value cache for generation: per layer [B, kv_heads, max_len, head_dim].

The model's forward calls ``advance(positions)`` once (it records the positions and builds the attention mask
for the new tokens), then every attention layer calls ``attend(layer_id, q, k, v)``: the cache stores the new
keys/values and computes the attention itself, so the model never reads the cache's internals. Rows of a batch share slots:
prompts are left-padded, and ``set_padding`` marks the pad slots so no query ever attends to them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megapipe.errors import MegapipeError


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype=torch.float32, device="cpu", sliding_window: Optional[int] = None):
        shape = (batch_size, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.valid = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.max_len = max_len
        self.sliding_window = sliding_window
        self.length = 0  # slots filled so far (the same for every row)
        self.start = 0  # first slot of the tokens of the current forward
        self.padded = False  # set_padding marked some slot as padding
        self.attn_mask: Optional[torch.Tensor] = None  # [B, 1, new tokens, length], 0 = attend, -inf = not
        self.is_causal = False  # no mask needed: plain causal attention (or, for one new token, attend to all)

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int) -> "KVCache":
        cfg = model.cfg
        p = next(model.parameters())
        return cls(cfg.num_layers, batch_size, cfg.kv_heads, max_len, cfg.dim_per_head, p.dtype, p.device,
                   cfg.sliding_window)

    def set_padding(self, mask: torch.Tensor) -> None:
        """mask [B, n] (True/1 = real token) for the next n slots; call before the forward that fills them."""
        n = mask.shape[1]
        self.valid[:, self.length:self.length + n] = mask.to(torch.bool)
        self.padded = self.padded or not bool(mask.all())

    def advance(self, positions: torch.Tensor) -> None:
        n = positions.shape[-1]
        start, end = self.length, self.length + n
        if end > self.max_len:
            raise MegapipeError(f"the KV cache holds {self.max_len} tokens; {end} were asked for")
        self.positions[:, start:end] = positions
        self.start, self.length = start, end
        if not self.padded and self.sliding_window is None and (n == 1 or start == 0):
            self.attn_mask, self.is_causal = None, n > 1  # the fast kernels: no mask to read
            return
        self.is_causal = False
        slots = torch.arange(end, device=self.valid.device)
        q_slots = slots[start:, None]
        mask = self.valid[:, None, :end] & (slots[None, None, :] <= q_slots[None])
        if self.sliding_window is not None:
            q_pos = self.positions[:, start:end, None]
            mask &= q_pos - self.positions[:, None, :end] < self.sliding_window
        mask |= slots[None, None, :] == q_slots[None]  # a pad query attends to itself only: no all-masked row
        # additive float mask: SDPA's CPU kernels are several times slower with a bool mask
        additive = torch.zeros(mask.shape, dtype=self.k[0].dtype, device=mask.device)
        self.attn_mask = additive.masked_fill_(~mask, float("-inf"))[:, None]

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, heads, n, D], k/v [B, kv_heads, n, D] of the current tokens -> attention output [B, heads, n, D]."""
        k, v = self.update(layer_id, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.attn_mask, is_causal=self.is_causal,
                                              enable_gqa=k.shape[1] != q.shape[1])

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, kv_heads, n, head_dim] of the current tokens; return all keys/values so far."""
        self.k[layer_id][:, :, self.start:self.length] = k
        self.v[layer_id][:, :, self.start:self.length] = v
        return self.k[layer_id][:, :, :self.length], self.v[layer_id][:, :, :self.length]
