"""Manifold-constrained hyper-connections (DeepSeek-V4, model.hc_mult): the residual stream is ``hc_mult`` streams
[B, S, n, H]. Before each sub-layer (attention, MoE) a ``HyperConnection`` reads all streams (flattened, RMS-normed
without a weight, one linear map ``fn``, scaled per part by ``scale`` plus ``base``) into three mixes: ``pre``
(sigmoid + eps) collapses the streams into the sub-layer's input, ``post`` (2 sigmoid) spreads its output back over
them, ``comb`` (an n x n softmax, then ``hc_sinkhorn_iters`` Sinkhorn-Knopp steps to a doubly-stochastic matrix)
mixes the old streams: streams' = post * out + comb^T @ streams. The mixes are computed in fp32. ``HyperHead``
collapses the streams once more (its own ``pre``) before the final norm.

The DeepSeek-V4 block (``V4Block``) is attention (megapipe.models.compressed_attention) and an MoE layer (hash-routed
on the first ``moe_hash_layers`` layers), each behind its hyper-connection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.compressed_attention import CompressedAttention, V4Positions, unweighted_rms_norm
from megapipe.models.dense import norms_tp_plan
from megapipe.models.moe import MoE, moe_layer_tp_plan
from megapipe.models.norms import build_norm
from megapipe.models.spec import BlockSpec, register_block, replicated_style, sharded_style


def expand_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """[B, S, H] -> [B, S, n, H]: every stream starts as the embedding."""
    return h.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


class HyperConnection(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = self.n = cfg.hc_mult
        self.iters, self.eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, S, n, H] -> (post [B, S, n], comb [B, S, n, n] (fp32), the collapsed input [B, S, H])."""
        n = self.n
        mixes = F.linear(unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps), self.fn.float())
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post * post_s + post_b)
        comb = torch.softmax((comb * comb_s + comb_b).unflatten(-1, (n, n)), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.fn, 0.0, std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)


def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """streams' = post * out (spread over the streams) + comb^T @ streams."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The streams [B, S, n, H] -> [B, S, H] before the final norm: sigmoid(scale * fn(rms(streams)) + base) + eps
    weights per stream."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty(n))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.fn, 0.0, std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)


class V4Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_hc, self.ffn_hc = HyperConnection(cfg), HyperConnection(cfg)
        self.attention_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.attention = CompressedAttention(cfg, layer_id)
        self.ffn_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        # an MTP block (layer_id >= num_layers) routes by its scores, as DeepSeek's published MTP layers do
        hashed = layer_id < cfg.num_layers and cfg.moe_layers.index(layer_id) < cfg.moe_hash_layers
        self.moe = MoE(cfg, hash_routed=hashed)

    def forward(self, streams: torch.Tensor, pos: V4Positions, cache=None, mask=None) -> torch.Tensor:
        post, comb, x = self.attention_hc(streams)
        streams = merge(streams, self.attention(self.attention_norm(x), pos, cache, mask), post, comb)
        post, comb, x = self.ffn_hc(streams)
        return merge(streams, self.moe(self.ffn_norm(x), pos.tokens), post, comb)


def hyper_tp_style(sp: bool):
    """A hyper-connection (``HyperConnection``, ``HyperHead``) under tensor parallelism: computed per token, on this
    rank's tokens with sequence parallelism (its weights' gradients then summed over the TP ranks, as a norm's) or
    on all of them, replicated; its weights are replicated DTensors, its outputs local tensors."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    class PerToken(SequenceParallel):
        @staticmethod
        def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
            return tuple(o.to_local() for o in outputs) if isinstance(outputs, tuple) else outputs.to_local()

    style = PerToken(use_local_output=True)
    style.sequence_sharding = (Shard(1) if sp else Replicate(),)
    return style


def v4_tp_plan(block: V4Block, sp: bool) -> dict:
    """Megatron's split of the heads: ``wq_b`` by output features (heads), the sinks with their heads, ``wo_a`` by
    its groups (each rank holds the groups of its heads) and ``wo_b`` by input features (one reduction). Replicated:
    the query's down projection and norm, the one key/value head and the compressor (every head reads them: their
    outputs' gradients are summed over the TP ranks), the frozen indexer, the hyper-connections (per token: split
    along the sequence with sequence parallelism, as the norms) and the MoE layer (as in an MoE block)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
    )

    act = Shard(1) if sp else Replicate()
    attention = block.attention
    plan = {
        "attention_hc": hyper_tp_style(sp),
        "ffn_hc": hyper_tp_style(sp),
        **norms_tp_plan(sp),
        "attention": sharded_style(prepare=PrepareModuleInput(  # (x, positions, cache, mask)
            input_layouts=(act, None, None, None), desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True)),
        "attention.wq_a": replicated_style(),
        "attention.q_norm": replicated_style(),
        "attention.wq_b": ColwiseParallel(),
        "attention.wkv": replicated_style(),
        "attention.kv_norm": replicated_style(summed=True),
        "attention.wo_a": sharded_style(),
        "attention.wo_b": RowwiseParallel(output_layouts=act),
    }
    if attention.compressor is not None:
        plan["attention.compressor"] = replicated_style(summed=True)
    if attention.indexer is not None:
        plan.update({f"attention.indexer.{m}": replicated_style() for m in ("compressor", "wq_b", "weights_proj")})
    plan.update(moe_layer_tp_plan(block, sp))
    plan["moe"] = PrepareModuleInputOutput(  # (x, token ids)
        input_layouts=(act, None), desired_input_layouts=(Replicate(), None), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(act,), use_local_output=True)
    return plan


# DeepSeek-V4's names in the Hub's checkpoints (transformers writes them back when it saves), within layers.{i}: a
# module's, or a whole tensor's
_ATTENTION = {f"attention.{m}": f"attn.{m}" for m in ("wq_a", "q_norm", "wq_b", "wkv", "wo_a", "wo_b")}
_COMPRESSORS = {f"attention.{c}.{m}": f"attn.{c}.{m}" for c in ("compressor", "indexer.compressor")
                for m in ("wkv", "wgate", "norm")}
V4 = register_block(BlockSpec(name="deepseek_v4", module=V4Block, tp_plan=v4_tp_plan, hf_names={"deepseek_v4": {
    **{f"{mp}_hc.{p}": f"hc_{hf}_{p}" for mp, hf in (("attention", "attn"), ("ffn", "ffn"))
       for p in ("fn", "base", "scale")},
    "attention_norm": "attn_norm",
    **_ATTENTION,
    "attention.kv_norm": "attn.norm",
    "attention.sinks": "attn.attn_sink",
    **_COMPRESSORS,
    "attention.compressor.position_bias": "attn.compressor.ape",
    "attention.indexer.compressor.position_bias": "attn.indexer.compressor.ape",
    "attention.indexer.wq_b": "attn.indexer.wq_b",
    "attention.indexer.weights_proj": "attn.indexer.weights_proj",
    "ffn_norm": "ffn_norm",
    "moe.gate": "ffn.gate",
    "moe.expert_bias": "ffn.gate.bias",
    "moe.tid2eid": "ffn.gate.tid2eid",
    **{f"moe.experts.{w}": f"ffn.experts.{{e}}.{w}.weight" for w in ("w1", "w2", "w3")},
    **{f"moe.shared_experts.{w}": f"ffn.shared_experts.{w}" for w in ("w1", "w2", "w3")},
}}))
