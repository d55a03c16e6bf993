"""Runs the model for one engine step: the flattened batch through the paged cache, logits for the rows asked for.

On CPU in bf16/fp16 the linear layers are swapped for oneDNN ones with the weight pre-packed once into the blocked
layout the kernel reads (what inductor's freezing and IPEX do): the same results bit for bit, ~1.5x faster
matmuls for the small batches of decoding. The model object is the engine's to modify; fp32 keeps plain
``nn.Linear`` (its BLAS path differs from oneDNN's in round-off, and fp32 is the exactness reference).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.inference.kv_cache import KVPool, PagedBatch


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_works(dtype: torch.dtype) -> bool:
    """oneDNN is built in and its packed linear equals F.linear here (checked on a probe)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        lin = nn.Linear(64, 48, dtype=dtype)
        x = torch.randn(5, 64, dtype=dtype)
        with torch.inference_mode():
            return bool(torch.allclose(PackedLinear(lin.weight, lin.bias)(x).float(), lin(x).float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, AttributeError):
        return False


class PackedSwiGLU(nn.Module):
    """A swiglu FeedForward with w1 and w3 in one packed matmul: w2(silu(x w1) * (x w3)), the same values."""

    def __init__(self, ff: nn.Module):
        super().__init__()
        self.hidden = ff.w1.out_features
        bias = None if ff.w1.bias is None else torch.cat([ff.w1.bias, ff.w3.bias]).detach()
        self.w13 = PackedLinear(torch.cat([ff.w1.weight, ff.w3.weight]).detach(), bias)
        self.w2 = PackedLinear(ff.w2.weight, ff.w2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)
        return self.w2(F.silu(gate) * up)


class PackedQKV(nn.Module):
    """wq, wk, wv of one attention layer as one packed matmul; returns the three projections (views)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        parts = (attn.wq, attn.wk, attn.wv)
        self.sizes = [p.out_features for p in parts]
        bias = None if attn.wq.bias is None else torch.cat([p.bias for p in parts]).detach()
        self.wqkv = PackedLinear(torch.cat([p.weight for p in parts]).detach(), bias)

    def forward(self, x: torch.Tensor):
        return self.wqkv(x).split(self.sizes, dim=-1)


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear (and swiglu FeedForward) under ``model`` by its packed form; returns matmuls packed."""
    count = 0
    if hasattr(model, "project_qkv") and all(isinstance(getattr(model, n, None), nn.Linear) for n in ("wq", "wk", "wv")):
        qkv = PackedQKV(model)
        model.add_module("fused_qkv", qkv)
        # an instance attribute wins over the class method: the model's forward now calls the fused matmul
        object.__setattr__(model, "project_qkv", qkv)
        for n in ("wq", "wk", "wv"):
            setattr(model, n, None)
        count += 3
    for name, child in list(model.named_children()):
        if child is None or name == "fused_qkv":
            continue
        if getattr(child, "swiglu", False) and isinstance(getattr(child, "w1", None), nn.Linear):
            setattr(model, name, PackedSwiGLU(child))
            count += 3
        elif isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count


class ModelRunner:
    def __init__(self, model, pool: KVPool, pack: Optional[bool] = None):
        self.model, self.pool = model, pool
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if pack is None:
            pack = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)
        self.packed = bool(pack) and self.device.type == "cpu" and packing_works(self.dtype)
        head = model.output_weight().detach()
        self.head = None
        if self.packed:
            pack_linears(model.layers)
            self.head = PackedLinear(head)
        self.head_weight = head
        self.window = model.cfg.sliding_window

    @torch.inference_mode()
    def load_weights(self, state: dict) -> None:
        """Take new weights (a full, unsharded state dict of the model: names as ``Transformer.state_dict()``),
        cast to the engine's dtype; packed layers are rebuilt from them."""
        from megapipe.models import build_model

        if self.packed:
            fresh = build_model(self.model.cfg, device="meta").to_empty(device=self.device).to(self.dtype)
            fresh.load_state_dict({k: v.to(self.device, self.dtype) for k, v in state.items()}, strict=True)
            fresh.eval()
            pack_linears(fresh.layers)
            self.model = fresh
            self.head_weight = fresh.output_weight().detach()
            self.head = PackedLinear(self.head_weight)
            return
        mine = self.model.state_dict()
        missing = sorted(set(mine) - set(state))
        if missing:
            raise KeyError(f"load_weights: the state dict lacks {missing[:3]}")
        for name, t in mine.items():
            t.copy_(state[name])
        self.head_weight = self.model.output_weight().detach()

    @torch.inference_mode()
    def run(self, decodes: Sequence[tuple[Sequence[int], int, int]],
            chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]], rows: Sequence[int]) -> torch.Tensor:
        """decodes: (block ids, position, token); chunks: (block ids, start, tokens). Returns fp32 logits of the
        batch rows ``rows`` (indices into the flattened batch: decodes first, then the chunks in order)."""
        batch = PagedBatch(self.pool, self.window)
        positions = batch.plan([(b, pos) for b, pos, _ in decodes], [(b, s, len(t)) for b, s, t in chunks])
        ids = [t for _, _, t in decodes]
        for _, _, toks in chunks:
            ids.extend(toks)
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        hidden = self.model(tokens, positions, batch, return_hidden=True)[0]
        if len(rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        return self.logits(hidden)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(h).float()
        return F.linear(h, self.head_weight).float()
