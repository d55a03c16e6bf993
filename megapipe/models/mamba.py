"""The Mamba-2 mixer (Dao & Gu 2024; Megatron's MambaMixer, Nemotron-H's layer): in-projections to z, x, B, C and
dt, a causal depthwise conv over x|B|C with SiLU, dt through its bias, softplus and limits, A = -exp(A_log), the
SSD scan (megapipe.models.ssd; on CUDA the fused kernels where they import: megapipe.models.mamba_kernels) with
the D skip, a grouped RMSNorm gated by silu(z), the out-projection. Falcon-H1's variants are options of the
config: the norm before the gate or no norm (y * silu(z)), an out-projection bias of its own, muP multipliers on
the input and on each in-projection (constants, not parameters).

Every projection is its own nn.Linear (``in_z``, ``in_x``: d_inner = heads * head_dim; ``in_B``, ``in_C``:
groups * state_dim; ``in_dt``: heads), as are the convolutions of x, B and C (``conv_x``, ``conv_B``, ``conv_C``),
so tensor parallelism splits them by heads and groups with plain column-wise styles; head and group counts are read
from the tensors (local under TP), never from the config. Parameters used in functional ops are read through their
local tensors (DTensors under a TP plan).

What a recurrent-state cache (megapipe.inference) uses, besides ``forward``:
  ``project(x) -> (z, xbc, dt)``: the in-projections, xbc = cat(x, B, C) before the conv, dt before its bias;
  ``conv_params() -> (weight [C, K], bias [C] or None)``: the conv of the xbc channels;
  ``split_xbc(xbc) -> (x, B, C)``; ``dt_and_A(dt) -> (dt, A)``: dt after bias, softplus and limits, A, in fp32;
  ``ssm(xbc, dt, conv_state=None, ssm_state=None, document_ids=None) -> (y, conv_state, ssm_state)``: conv + SiLU
  + scan (+ D) from the given states (zeros when None; one token with an SSM state takes the single-step
  recurrence), y [B, S, heads, head_dim], the new conv state [B, C, K-1] and SSM state [B, heads, head_dim,
  state_dim] (fp32); the states passed in are not modified;
  ``finish(y, z) -> out``: gated norm and out-projection.
With a cache, ``forward`` calls ``cache.ssm(layer_id, mixer, xbc, dt) -> y`` (the SSM output incl. the D skip,
before the gated norm, shaped [B, S, heads, head_dim] or [B, S, d_inner]): the cache keeps each sequence's conv
window and SSM state and typically answers with ``mixer.ssm`` on them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.config import ModelConfig
from megapipe.models.attention import DocumentMask, local
from megapipe.models.mamba_kernels import path_for


def fused_linear(x: torch.Tensor, linears: tuple[nn.Linear, ...]) -> Optional[torch.Tensor]:
    """The outputs of ``linears`` side by side from one matmul (their weights concatenated per call, cheap next to
    the matmul, and one backward matmul instead of one per projection plus the sum of their input gradients), or
    None where a projection is not a plain local nn.Linear (a TP shard, a LoRA hook, a quantized module): the
    caller then runs them one by one."""
    for m in linears:
        if type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks or hasattr(m.weight, "to_local"):
            return None
    biases = [m.bias for m in linears]
    bias = None if biases[0] is None else torch.cat(biases)
    return F.linear(x, torch.cat([m.weight for m in linears]), bias)


class DepthwiseConv(nn.Module):
    """The weights of a causal depthwise conv1d over ``channels``: weight [C, K], bias [C] (computed in ssd)."""

    def __init__(self, channels: int, kernel: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    @torch.no_grad()
    def init_weights(self) -> None:
        bound = 1 / math.sqrt(self.weight.shape[-1])  # nn.Conv1d's default for a depthwise conv
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of ``group_size`` channels (Nemotron-H / Mamba-2's norm_before_gate=False),
    or with ``norm_before_gate`` (Falcon-H1's) the norm of y, times the weight, times silu(z); in fp32; weight [dim].
    The number of groups is read from the input (local under TP)."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5, norm_before_gate: bool = False):
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() if self.norm_before_gate else y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.norm_before_gate:
            return (local(self.weight).float() * g.view(h.shape) * F.silu(z.float())).to(y.dtype)
        return local(self.weight) * g.view(h.shape).to(y.dtype)


def scale_by(t: torch.Tensor, multiplier: float) -> torch.Tensor:
    """t * multiplier, or t itself for 1 (a muP constant that is off costs nothing)."""
    return t if multiplier == 1 else t * multiplier


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        h, inner, gn = cfg.hidden_size, cfg.mamba_inner, cfg.mamba_num_groups * cfg.mamba_state_dim
        heads, k = cfg.mamba_heads, cfg.mamba_conv_kernel
        self.head_dim, self.state_dim, self.chunk_size = cfg.mamba_head_dim, cfg.mamba_state_dim, cfg.mamba_chunk_size
        self.dt_limit = cfg.mamba_dt_limit
        self.dt_init = (cfg.mamba_dt_min, cfg.mamba_dt_max, cfg.mamba_dt_init_floor)
        bias = cfg.mamba_proj_bias
        # Falcon-H1's muP multipliers, constants: the input, then the z, x, B, C and dt projections
        self.in_multiplier, self.proj_multipliers = cfg.mamba_in_multiplier, tuple(cfg.mamba_proj_multipliers)
        self.in_z = nn.Linear(h, inner, bias=bias)
        self.in_x = nn.Linear(h, inner, bias=bias)
        self.in_B = nn.Linear(h, gn, bias=bias)
        self.in_C = nn.Linear(h, gn, bias=bias)
        self.in_dt = nn.Linear(h, heads, bias=bias)
        self.conv_x = DepthwiseConv(inner, k, cfg.mamba_conv_bias)
        self.conv_B = DepthwiseConv(gn, k, cfg.mamba_conv_bias)
        self.conv_C = DepthwiseConv(gn, k, cfg.mamba_conv_bias)
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))
        norm = GatedRMSNorm(inner, inner // cfg.mamba_num_groups, cfg.norm_eps, cfg.mamba_norm_before_gate)
        self.norm = norm if cfg.mamba_gated_norm else None  # None: y * silu(z)
        self.out_proj = nn.Linear(inner, h, bias=cfg.mamba_out_bias)

    # ------------------------------------------------------------------------------------------ the pieces

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, S, hidden] -> (z [B, S, d_inner], xbc [B, S, d_inner + 2 * groups * state], dt [B, S, heads]),
        with the multipliers applied."""
        x = scale_by(x, self.in_multiplier)
        projections = (self.in_z, self.in_x, self.in_B, self.in_C, self.in_dt)
        zxbcdt = fused_linear(x, projections)
        if zxbcdt is not None:
            scale = self.projection_scale([p.weight.shape[0] for p in projections], zxbcdt)
            if scale is not None:
                zxbcdt = zxbcdt * scale
            inner, heads = self.in_z.weight.shape[0], self.in_dt.weight.shape[0]
            return zxbcdt.split([inner, zxbcdt.shape[-1] - inner - heads, heads], dim=-1)
        z, xs, B, C, dt = (scale_by(proj(x), m) for proj, m in zip(projections, self.proj_multipliers, strict=True))
        return z, torch.cat([xs, B, C], dim=-1), dt

    def projection_scale(self, widths: list[int], like: torch.Tensor) -> Optional[torch.Tensor]:
        """The multipliers of the z, x, B, C, dt projections (``widths`` outputs each) as one vector over their
        outputs side by side, in ``like``'s dtype and device; None where they are all 1."""
        if all(m == 1 for m in self.proj_multipliers):
            return None
        return torch.cat([like.new_full((w,), m) for w, m in zip(widths, self.proj_multipliers, strict=True)])

    def conv_params(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight [C, K], bias [C] or None) of the conv over the x|B|C channels."""
        convs = (self.conv_x, self.conv_B, self.conv_C)
        weight = torch.cat([local(c.weight) for c in convs])
        bias = None if self.conv_x.bias is None else torch.cat([local(c.bias) for c in convs])
        return weight, bias

    def split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., x | B | C] -> (x [..., d_inner], B, C [..., groups * state]) (local widths under TP)."""
        inner = local(self.conv_x.weight).shape[0]
        gn = (xbc.shape[-1] - inner) // 2
        return xbc.split([inner, gn, gn], dim=-1)

    def dt_and_A(self, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw dt [..., heads] -> (softplus(dt + dt_bias) clamped to the limits, A = -exp(A_log)), both fp32."""
        dt = F.softplus(dt.float() + local(self.dt_bias).float())
        lo, hi = self.dt_limit
        if lo > 0 or hi != math.inf:
            dt = dt.clamp(min=lo, max=hi)
        return dt, -torch.exp(local(self.A_log).float())

    def step_params(self) -> tuple:
        """What a fused decode step (megapipe.inference's mamba_step kernel) takes besides the inputs and states:
        conv weight [C, K], conv bias [C] or None, dt_bias, A and D (fp32 [heads]), the dt limits, the groups."""
        weight, bias = self.conv_params()
        lo, hi = self.dt_limit
        groups = (weight.shape[0] - local(self.conv_x.weight).shape[0]) // 2 // self.state_dim  # B's width / state
        return (weight, bias, local(self.dt_bias).float(), -torch.exp(local(self.A_log).float()), local(self.D).float(),
                lo, hi, groups)

    def ssm(self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: Optional[torch.Tensor] = None,
            ssm_state: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
            inplace: bool = False):
        """xbc [B, S, C], raw dt [B, S, heads] -> (y [B, S, heads, head_dim] incl. the D skip, conv state
        [B, C, K-1], SSM state [B, heads, head_dim, state] fp32), starting from the given states (zeros if None).
        ``inplace``: a one-token step updates the given states where they lie (a state cache's own slices)."""
        b, s, _ = xbc.shape
        weight, bias = self.conv_params()
        step = s == 1 and conv_state is not None and ssm_state is not None and document_ids is None
        if inplace and not step:
            raise ValueError("inplace states take one token per sequence, from given conv and SSM states")
        path = path_for(xbc)  # the fused CUDA kernels where they apply, else PyTorch
        if step:
            out, conv_state = path.conv_step(xbc[:, 0], weight, bias, conv_state, inplace)
            out = out[:, None]
        else:
            out, conv_state = path.conv(xbc, weight, bias, conv_state, document_ids)
        x, B, C = self.split_xbc(out)
        dt, A = self.dt_and_A(dt)
        x = x.reshape(b, s, -1, self.head_dim)
        B, C = B.reshape(b, s, -1, self.state_dim), C.reshape(b, s, -1, self.state_dim)
        D = local(self.D)
        if step:
            y, ssm_state = path.step(ssm_state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, inplace)
            return y[:, None], conv_state, ssm_state
        y, ssm_state = path.scan(x, dt, A, B, C, self.chunk_size, D, ssm_state, document_ids)
        return y, conv_state, ssm_state

    def finish(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """SSM output y ([B, S, heads, head_dim] or [B, S, d_inner]) and gate z -> the mixer's output [B, S, hidden]."""
        y = y.reshape(z.shape).to(z.dtype)
        return self.out_proj(y * F.silu(z) if self.norm is None else self.norm(y, z))

    # ------------------------------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, cache=None, mask: Optional[DocumentMask] = None) -> torch.Tensor:
        z, xbc, dt = self.project(x)
        if cache is not None:
            y = cache.ssm(self.layer_id, self, xbc, dt)
        elif mask is not None and mask.prefix_ids is not None:
            y = self.ssm_forked(xbc, dt, mask.document_ids, mask.prefix_ids)
        else:
            y, _, _ = self.ssm(xbc, dt, document_ids=None if mask is None else mask.document_ids)
        return self.finish(y, z)

    def ssm_forked(self, xbc: torch.Tensor, dt: torch.Tensor, document_ids: torch.Tensor,
                   prefix_ids: torch.Tensor) -> torch.Tensor:
        """``ssm`` over packed documents that continue a shared prompt (RL's shared prompts): a document whose
        ``prefix_ids`` names an earlier document of its row starts from the conv window and SSM state that document
        ended with, as if it followed it alone; the others start from zeros. One scan per document run."""
        rows = []
        for r in range(xbc.shape[0]):
            ids, prefixes = document_ids[r].tolist(), prefix_ids[r].tolist()
            ends, pieces, start = {}, [], 0
            for t in range(1, len(ids) + 1):
                if t < len(ids) and ids[t] == ids[start]:
                    continue
                doc, prefix = ids[start], prefixes[start]
                states = ends.get(prefix, (None, None)) if prefix != doc else (None, None)
                y, conv_state, ssm_state = self.ssm(xbc[r:r + 1, start:t], dt[r:r + 1, start:t], *states)
                ends[doc] = (conv_state, ssm_state)
                pieces.append(y)
                start = t
            rows.append(torch.cat(pieces, dim=1))
        return torch.cat(rows)

    @torch.no_grad()
    def init_weights(self) -> None:
        """What the model's generic init does not cover (it draws the projections): the convs as nn.Conv1d does,
        A = -[1, 16] uniform (Megatron), D = 1, dt_bias = softplus^-1 of a log-uniform dt in [dt_min, dt_max]
        floored at dt_init_floor, the norm's weight 1 (where there is a norm)."""
        for conv in (self.conv_x, self.conv_B, self.conv_C):
            conv.init_weights()
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        nn.init.ones_(self.D)
        lo, hi, floor = self.dt_init
        dt = torch.exp(torch.rand_like(self.dt_bias) * (math.log(hi) - math.log(lo)) + math.log(lo)).clamp(min=floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        if self.norm is not None:
            nn.init.ones_(self.norm.weight)
