"""Falcon-H1's layer (symbol "P" in ``cfg.layer_kinds``): a Mamba-2 mixer and attention side by side on one normed
input, their outputs summed into the residual, then a SwiGLU MLP:

    n = norm(x)
    h = x + mamba_out * mixer(n) + attention_out * attention(attention_in * n)   (the keys times key_multiplier)
    out = h + mlp_out * w2(silu(mlp_gate * w1(ffn_norm(h))) * w3(ffn_norm(h)))

The multipliers are Falcon-H1's muP constants (ModelConfig; 1: none). The submodules are named as in the other
kinds (``mixer`` as a Mamba layer's, ``attention`` and ``feed_forward`` as a dense block's), so the tensor-parallel
plan is theirs put together and a recurrent-state / KV cache sees one Mamba and one attention layer per layer id.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.attention import Attention, DocumentMask
from megapipe.models.dense import FeedForward, attention_layer_tp_plan, feed_forward_tp_plan, norms_tp_plan
from megapipe.models.hybrid import mamba_tp_plan
from megapipe.models.mamba import Mamba2Mixer, scale_by
from megapipe.models.norms import build_norm
from megapipe.models.spec import BlockSpec, register_block


class ScaledFeedForward(FeedForward):
    """SwiGLU with Falcon-H1's MLP multipliers: w2(silu(gate * w1 x) * w3 x) * out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.gate_multiplier, self.out_multiplier = cfg.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale_by(self.w2(F.silu(scale_by(self.w1(x), self.gate_multiplier)) * self.w3(x)), self.out_multiplier)


class ParallelHybridBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.mixer = Mamba2Mixer(cfg, layer_id)
        self.attention = Attention(cfg, layer_id)
        self.ffn_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = ScaledFeedForward(cfg)
        self.mamba_out = cfg.mamba_out_multiplier
        self.attention_in, self.attention_out = cfg.attention_in_multiplier, cfg.attention_out_multiplier

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None, cache=None,
                mask: Optional[DocumentMask] = None) -> torch.Tensor:
        n = self.norm(x)
        mamba = scale_by(self.mixer(n, cache, mask), self.mamba_out)
        attention = scale_by(self.attention(scale_by(n, self.attention_in), rope, cache, mask), self.attention_out)
        h = x + (mamba + attention)
        return h + self.feed_forward(self.ffn_norm(h))


def parallel_hybrid_tp_plan(block: ParallelHybridBlock, sp: bool) -> dict:
    """The Mamba layer's plan (its norm ``norm`` is the shared input norm), the attention's and the MLP's."""
    return {**mamba_tp_plan(block, sp), **attention_layer_tp_plan(block, sp), **feed_forward_tp_plan(block, sp),
            **norms_tp_plan(sp, ("ffn_norm",))}


PARALLEL_HYBRID = register_block(BlockSpec(
    name="parallel_hybrid", module=ParallelHybridBlock, tp_plan=parallel_hybrid_tp_plan,
    hf_names={"falcon_h1": {  # FalconH1ForCausalLM
        "norm": "input_layernorm",
        "mixer.A_log": "mamba.A_log", "mixer.D": "mamba.D", "mixer.dt_bias": "mamba.dt_bias",
        "mixer.norm": "mamba.norm", "mixer.out_proj": "mamba.out_proj",
        "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "ffn_norm": "pre_ff_layernorm",
        "feed_forward.w1": "feed_forward.gate_proj", "feed_forward.w3": "feed_forward.up_proj",
        "feed_forward.w2": "feed_forward.down_proj",
    }},
))
