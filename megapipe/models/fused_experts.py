"""MoE experts in the layout NVIDIA ModelOpt quantizes: ``FusedExperts``, and ``fuse_experts`` to put it in a model.

ModelOpt's quantizers wrap ``nn.Linear`` layers; its Hugging Face plugin also wraps transformers 5's fused experts
(``gate_up_proj`` [E, 2F, H] with each expert's gate rows before its up rows, ``down_proj`` [E, H, F]) as
``_QuantFusedExperts``: one weight quantizer per expert and projection (gate and up share one, as the runtime's
fused GEMM needs), one input quantizer per projection shared by all experts. ``FusedExperts`` is megapipe's
``GroupedExperts`` in that layout, computing the same SwiGLU, so ModelOpt quantizes megapipe's experts exactly as it
quantizes the Hugging Face twin's. Quantization replaces every MoE layer's experts with it before ModelOpt runs, and
loading a quantized checkpoint does again before the quantizers are put back (megapipe.checkpoint.quant_state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.models.moe import GroupedExperts, moe_layers


class FusedExperts(nn.Module):
    """E SwiGLU experts as ``gate_up_proj`` [E, 2F, H] (w1 rows, then w3 rows) and ``down_proj`` [E, H, F] (w2);
    ``forward(x, counts)`` as ``GroupedExperts``: x [N, H] sorted by expert, counts [E]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.num_experts = num_experts  # what ModelOpt reads to give each expert its weight quantizers
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    @classmethod
    @torch.no_grad()
    def of(cls, experts: GroupedExperts) -> "FusedExperts":
        e, f, h = experts.w1.shape
        fused = cls(e, h, f).to(device=experts.w1.device, dtype=experts.w1.dtype)
        fused.gate_up_proj.copy_(torch.cat([experts.w1, experts.w3], dim=1))
        fused.down_proj.copy_(experts.w2)
        return fused

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # ModelOpt intercepts the F.linear calls: exactly two per expert that has tokens, gate_up then down, on views
        # of the 3-D weights (their storage offset names the expert), as transformers' eager experts call them
        if x.dtype != self.gate_up_proj.dtype:
            x = x.to(self.gate_up_proj.dtype)
        outs = []
        for e, part in enumerate(torch.split(x, counts.tolist())):
            if part.shape[0] == 0:
                continue
            gate, up = F.linear(part, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, self.down_proj.shape[1])


def fuse_experts(model: nn.Module) -> int:
    """Replace the ``GroupedExperts`` of every MoE layer of ``model`` with ``FusedExperts`` holding the same weights
    (in place); returns how many were replaced."""
    done = 0
    for _, moe in moe_layers(model):
        if isinstance(moe.experts, GroupedExperts):
            moe.experts = FusedExperts.of(moe.experts)
            done += 1
    return done
