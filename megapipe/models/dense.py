"""The dense decoder block (attention + MLP), Llama / Qwen / Mistral / GPT-2 shaped by ModelConfig, with its spec:
the Megatron-style tensor-parallel plan and its Hugging Face names (megapipe.models.spec)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.attention import Attention, DocumentMask
from megapipe.models.norms import build_norm
from megapipe.models.spec import BlockSpec, register_block, replicated_style, sharded_style


class FeedForward(nn.Module):
    """swiglu: w2(silu(w1 x) * w3 x); gelu_tanh: w2(gelu(w1 x)); relu2: w2(relu(w1 x)^2) (w3 is None for both)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = cfg.activation
        self.swiglu = cfg.activation == "swiglu"
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias) if self.swiglu else None
        # DeepSeek-V4's shared experts clamp like its routed ones (moe_activation clamped_silu)
        self.limit = cfg.moe_swiglu_limit if cfg.moe_activation == "clamped_silu" and cfg.is_moe else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:
            gate, up = self.w1(x).clamp(max=self.limit), self.w3(x).clamp(-self.limit, self.limit)
            return self.w2(F.silu(gate) * up)
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.activation == "relu2":
            return self.w2(torch.square(F.relu(self.w1(x))))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    attention_class: type = Attention  # a block kind with other attention (megapipe.models.mla) sets its own

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.attention = self.attention_class(cfg, layer_id)
        self.ffn_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None, cache=None,
                mask: Optional[DocumentMask] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache, mask)
        return h + self.feed_forward(self.ffn_norm(h))


def norms_tp_plan(sp: bool, norms: tuple = ("attention_norm", "ffn_norm")) -> dict:
    """A block's norms: split along the sequence with sequence parallelism, else replicated like the stream."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return {norm: SequenceParallel() if sp else replicated_style() for norm in norms}


def attention_tp_plan(block: nn.Module, sp: bool) -> dict:
    """wq/wk/wv split by output features (heads), wo by input features: one reduction. With sequence parallelism the
    norms (and the residual stream between them) are split along the sequence: all-gather before attention and the
    FFN, reduce-scatter after. Shared by every block kind with this attention."""
    return {**attention_layer_tp_plan(block, sp), **norms_tp_plan(sp)}


def attention_layer_tp_plan(block: nn.Module, sp: bool) -> dict:
    """``attention_tp_plan`` without the norms: the attention layer's own entries."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    act = Shard(1) if sp else Replicate()
    plan = {
        "attention": PrepareModuleInput(  # (x, rope, cache, mask)
            input_layouts=(act, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),
    }
    if getattr(block.attention, "sinks", None) is not None:  # one per head: split with the heads
        plan["attention"] = sharded_style(prepare=plan["attention"])
    if block.attention.q_norm is not None:
        # q/k are [B, S, local heads, head_dim] here: treat the head dim as the sharded one so the (replicated)
        # norm weights get their gradients summed over TP ranks
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def dense_tp_plan(block: TransformerBlock, sp: bool) -> dict:
    """Attention as ``attention_tp_plan``, the MLP as ``feed_forward_tp_plan``."""
    return {**attention_tp_plan(block, sp), **feed_forward_tp_plan(block, sp)}


def feed_forward_tp_plan(block: nn.Module, sp: bool) -> dict:
    """w1/w3 split by output features (FFN columns), w2 by input features (no norms)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    act = Shard(1) if sp else Replicate()
    plan = {
        "feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=act),
    }
    if block.feed_forward.w3 is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    return plan


DENSE = register_block(BlockSpec(
    name="dense",
    module=TransformerBlock,
    tp_plan=dense_tp_plan,
    hf_names={
        "llama": {  # LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
            "attention_norm": "input_layernorm",
            "attention.wq": "self_attn.q_proj",
            "attention.wk": "self_attn.k_proj",
            "attention.wv": "self_attn.v_proj",
            "attention.wo": "self_attn.o_proj",
            "attention.q_norm": "self_attn.q_norm",
            "attention.k_norm": "self_attn.k_norm",
            "ffn_norm": "post_attention_layernorm",
            "feed_forward.w1": "mlp.gate_proj",
            "feed_forward.w3": "mlp.up_proj",
            "feed_forward.w2": "mlp.down_proj",
        },
        "gpt2": {  # GPT2LMHeadModel: Conv1D layers (transposed) and one fused attn.c_attn for wq/wk/wv
            "attention_norm": "ln_1",
            "ffn_norm": "ln_2",
            "attention.wo": "attn.c_proj",
            "feed_forward.w1": "mlp.c_fc",
            "feed_forward.w2": "mlp.c_proj",
        },
    },
))
