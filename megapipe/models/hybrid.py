"""The layers of a hybrid Transformer-Mamba model (Nemotron-H, Megatron's MambaModel): one mixer per layer, chosen
by the layer's symbol in ``cfg.layer_kinds`` (M Mamba-2, * attention, - MLP, E MoE), each ``x + mixer(norm(x))``.
Their specs: tensor-parallel plans (a Mamba layer split by heads and groups as Megatron does) and Hugging Face names (NemotronHForCausalLM: ``norm`` and ``mixer.*``; the
fused in_proj / conv1d of a Mamba layer are split by the bridge).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.attention import Attention, DocumentMask
from megapipe.models.dense import FeedForward, attention_layer_tp_plan, feed_forward_tp_plan, norms_tp_plan
from megapipe.models.mamba import Mamba2Mixer
from megapipe.models.moe import MoE, moe_layer_tp_plan
from megapipe.models.norms import build_norm
from megapipe.models.spec import BlockSpec, register_block, sharded_style


class MambaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.mixer = Mamba2Mixer(cfg, layer_id)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None, cache=None,
                mask: Optional[DocumentMask] = None) -> torch.Tensor:
        return x + self.mixer(self.norm(x), cache, mask)


class AttentionBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg, layer_id)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None, cache=None,
                mask: Optional[DocumentMask] = None) -> torch.Tensor:
        return x + self.attention(self.attention_norm(x), rope, cache, mask)


class MLPBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.ffn_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None, cache=None,
                mask: Optional[DocumentMask] = None) -> torch.Tensor:
        return x + self.feed_forward(self.ffn_norm(x))


class MoEMLPBlock(nn.Module):
    """An MoE layer alone (the submodule named ``moe`` as in MoEBlock, so MoE statistics and EP find it)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.ffn_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None, cache=None,
                mask: Optional[DocumentMask] = None) -> torch.Tensor:
        return x + self.moe(self.ffn_norm(x))


def mamba_tp_plan(block: MambaBlock, sp: bool) -> dict:
    """Megatron's MambaMixer split: heads and groups over TP ranks (each rank's groups are those of its heads, so the
    gated norm, per group, stays local). in_z / in_x / in_B / in_C / in_dt by output features, the convs' channels,
    A_log, D, dt_bias and the norm's weight along dim 0 (``sharded_style``), out_proj by input features: one
    reduction. The mixer's input is the whole sequence; with sequence parallelism the block's norm is split along
    the sequence as the dense blocks' norms are."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    act = Shard(1) if sp else Replicate()
    prepare = PrepareModuleInput(input_layouts=(act, None, None), desired_input_layouts=(Replicate(), None, None))
    return {
        **norms_tp_plan(sp, ("norm",)),
        "mixer": sharded_style(prepare),
        **{f"mixer.in_{p}": ColwiseParallel() for p in ("z", "x", "B", "C", "dt")},
        **{f"mixer.{m}": sharded_style() for m in ("conv_x", "conv_B", "conv_C", "norm")
           if getattr(block.mixer, m) is not None},  # Falcon-H1's mixer may have no gated norm
        "mixer.out_proj": RowwiseParallel(output_layouts=act),
    }


def attention_only_tp_plan(block: AttentionBlock, sp: bool) -> dict:
    return {**attention_layer_tp_plan(block, sp), **norms_tp_plan(sp, ("attention_norm",))}


def mlp_only_tp_plan(block: MLPBlock, sp: bool) -> dict:
    return {**feed_forward_tp_plan(block, sp), **norms_tp_plan(sp, ("ffn_norm",))}


def moe_only_tp_plan(block: MoEMLPBlock, sp: bool) -> dict:
    """The MoE layer whole on every TP rank, as in an MoE block (megapipe.models.moe.moe_tp_plan)."""
    return {**moe_layer_tp_plan(block, sp), **norms_tp_plan(sp, ("ffn_norm",))}


MAMBA = register_block(BlockSpec(
    name="mamba", module=MambaBlock, tp_plan=mamba_tp_plan,
    hf_names={"nemotron_h": {"norm": "norm", "mixer.norm": "mixer.norm", "mixer.out_proj": "mixer.out_proj"}},
))
ATTENTION = register_block(BlockSpec(
    name="attention", module=AttentionBlock, tp_plan=attention_only_tp_plan,
    hf_names={"nemotron_h": {"attention_norm": "norm", "attention.wq": "mixer.q_proj", "attention.wk": "mixer.k_proj",
                             "attention.wv": "mixer.v_proj", "attention.wo": "mixer.o_proj"}},
))
MLP = register_block(BlockSpec(
    name="mlp", module=MLPBlock, tp_plan=mlp_only_tp_plan,
    hf_names={"nemotron_h": {"ffn_norm": "norm", "feed_forward.w1": "mixer.up_proj",
                             "feed_forward.w2": "mixer.down_proj"}},
))
MOE_MLP = register_block(BlockSpec(name="moe_mlp", module=MoEMLPBlock, tp_plan=moe_only_tp_plan))

HYBRID_BLOCKS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE_MLP}
