"""Mamba-2's sequence mixing in plain PyTorch (runs on CPU): the causal depthwise convolution, the chunked
state-space-duality (SSD) scan for training and prefill, and the one-step recurrence for decoding.

The recurrence, per head h (P values, N state dims; heads share B/C within a group of H / G heads):
    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t B_t^T        [P, N]
    y_t     = state_t C_t + D_h * x_t
``ssd_chunked`` computes it in chunks of Q tokens (Dao & Gu 2024): within a chunk as a masked attention-like
product, across chunks by carrying one state per chunk boundary. The D skip is applied here (``D``), so every
caller gets the same y.

Packed documents (``document_ids`` [B, S]; a document is a run of equal ids, a change starts the next one): a
token never sees an earlier document's inputs, in the convolution or the scan. The decays across a document start
are masked to exactly zero (exp(-inf)), never made small by adding large negative numbers to the log-decays, and
every log-decay sum is a cumulative sum over the positions it spans, never a difference of two cumulative sums, so
no precision is lost. An incoming state (conv window or SSM state) continues the row's first document.

Numerics: the scan runs in float32 whatever the input dtype and returns y in the input's dtype, states in float32.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def document_runs(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] document ids -> [B, S] run index (0, 1, ...): equal exactly for the tokens of one document."""
    change = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.cat([torch.zeros_like(document_ids[:, :1]), change.long().cumsum(-1)], dim=-1)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  state: Optional[torch.Tensor] = None,
                  document_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution: x [B, S, C], weight [C, K], bias [C] -> (y [B, S, C], new state [B, C, K-1]).

    y_t[c] = bias[c] + sum_k weight[c, k] * x_{t-K+1+k}[c]; inputs before the sequence come from ``state`` (the
    previous K-1 inputs, oldest first; zeros without it). The new state holds the last K-1 inputs (of the last
    document: earlier documents' entries zeroed), what the next call continues from. No activation here."""
    b, s, c = x.shape
    k = weight.shape[-1]
    if document_ids is None:
        prefix = state.to(x.dtype).transpose(1, 2) if state is not None else x.new_zeros(b, k - 1, c)
        full = torch.cat([prefix, x], dim=1)  # [B, K-1+S, C]
        y = _DepthwiseCausalConv.apply(full, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return y, full[:, s:].transpose(1, 2).contiguous()
    prefix = state.to(x.dtype) if state is not None else x.new_zeros(b, c, k - 1)
    full = torch.cat([prefix, x.transpose(1, 2)], dim=-1)  # [B, C, K-1+S]
    runs = document_runs(document_ids)
    runs_full = torch.cat([runs[:, :1].expand(b, k - 1), runs], dim=-1)  # the state continues the first document
    keep = (runs_full.unfold(-1, k, 1) == runs[..., None]).to(x.dtype)  # [B, S, K]: tap in the token's document
    windows = full.unfold(-1, k, 1)  # [B, C, S, K]
    y = torch.einsum("bcsk,ck,bsk->bsc", windows, weight.to(x.dtype), keep)
    if bias is not None:
        y = y + bias.to(x.dtype)
    new_state = full[..., s:] * (runs_full[:, s:] == runs[:, -1:]).to(x.dtype)[:, None, :]
    return y, new_state


class _DepthwiseCausalConv(torch.autograd.Function):
    """y[:, t] = bias + sum_k weight[:, k] * full[:, t + k] over full [B, K-1+S, C] (channels last, as the
    projections give them): K multiply-adds on whole tensors each way, cheaper on CPU than a grouped conv1d
    (channels-first copies, a slow depthwise backward) and with contiguous results for what follows."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        k = weight.shape[-1]
        s = full.shape[1] - k + 1
        last = full[:, k - 1:]
        y = last * weight[:, k - 1] if bias is None else torch.addcmul(bias, last, weight[:, k - 1])
        for j in range(k - 1):
            y.addcmul_(full[:, j:j + s], weight[:, j])
        ctx.save_for_backward(full, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full, weight = ctx.saved_tensors
        k, s = weight.shape[-1], grad.shape[1]
        grad_full = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_full = torch.empty_like(full)
            torch.mul(grad, weight[:, k - 1], out=grad_full[:, k - 1:])
            grad_full[:, :k - 1].zero_()
            for j in range(k - 1):
                grad_full[:, j:j + s].addcmul_(grad, weight[:, j])
        if ctx.needs_input_grad[1]:
            grad_weight = torch.stack([(grad * full[:, j:j + s]).sum((0, 1)) for j in range(k)], dim=-1)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum((0, 1))
        return grad_full, grad_weight, grad_bias


def conv_step(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: x [B, C], state [B, C, K-1] -> (y [B, C], new state)."""
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    y = (window * weight.to(x.dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y, window[..., 1:]


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., Q] -> [..., Q, Q]: out[i, j] = a[j+1] + ... + a[i] for j <= i (0 on the diagonal), -inf above it.
    Each entry is its own cumulative sum over the masked row, not a difference of two prefix sums."""
    q = a.shape[-1]
    strictly_lower = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    terms = a[..., :, None].expand(*a.shape, q).masked_fill(~strictly_lower, 0.0)  # [i, j] = a[i] for i > j
    out = terms.cumsum(dim=-2)  # [i, j] = sum_{j < m <= i} a[m]
    lower = torch.ones(q, q, dtype=torch.bool, device=a.device).tril()
    return out.masked_fill(~lower, float("-inf"))


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int, D: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan over a sequence: x [B, S, H, P], dt [B, S, H] (after bias, softplus and limits), A [H]
    (negative), B/C [B, S, G, N], D [H] (optional skip), initial_state [B, H, P, N] (optional),
    document_ids [B, S] (optional) -> (y [B, S, H, P] in x's dtype, final state [B, H, P, N] float32)."""
    b, s, h, p = x.shape
    g, n = B.shape[-2], B.shape[-1]
    r, q = h // g, chunk_size  # heads per group share B and C: products with them are taken once per group
    pad = (-s) % q
    nc = (s + pad) // q
    dt = dt.float()
    a = dt * A.float()  # [B, S, H]: log-decay of each step (<= 0)
    xdt = x.float() * dt[..., None]
    Bg, Cg = B.float(), C.float()
    runs = document_runs(document_ids) if document_ids is not None else None
    if pad:  # padded steps decay by exp(0) = 1 and add nothing: the final state is the last real token's
        a = F.pad(a, (0, 0, 0, pad))
        xdt, Bg, Cg = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xdt, Bg, Cg))
        if runs is not None:
            runs = torch.cat([runs, runs[:, -1:].expand(b, pad)], dim=-1)
    a = a.view(b, nc, q, h).permute(0, 3, 1, 2)  # [B, H, c, Q]
    xdt = xdt.view(b, nc, q, g, r, p)
    Bg, Cg = Bg.view(b, nc, q, g, n), Cg.view(b, nc, q, g, n)
    seg = segment_sums(a)  # [B, H, c, Q, Q]: log-decay from just after token j to token i of one chunk
    into = a.cumsum(-1)  # [B, H, c, Q]: log-decay from the chunk's incoming state to token l
    if runs is not None:
        rr = runs.view(b, nc, q)
        seg = seg.masked_fill((rr[..., :, None] != rr[..., None, :])[:, None], float("-inf"))
        before = torch.cat([rr[:, :1, :1], rr[:, :-1, -1:]], dim=1)  # run of the token before each chunk
        into = into.masked_fill((rr != before)[:, None], float("-inf"))
    decay = seg.exp().view(b, g, r, nc, q, q)
    scores = torch.einsum("bclgn,bcsgn->bgcls", Cg, Bg)[:, :, None] * decay  # [B, G, R, c, Q, Q]
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", scores, xdt)  # within each chunk
    to_end = decay[..., -1, :]  # [B, G, R, c, Q]: decay from each token to the chunk's last
    weighted = xdt * to_end.permute(0, 3, 4, 1, 2)[..., None]
    chunk_states = torch.einsum("bcsgn,bcsgrp->bcgrpn", Bg, weighted).reshape(b, nc, h, p, n)
    into = into.exp()
    state = initial_state.float() if initial_state is not None else x.new_zeros(b, h, p, n, dtype=torch.float32)
    starts = []
    # unbind, not chunk_states[:, c]: the backward of one indexing per chunk would allocate a zero tensor each
    for chunk_state, chunk_decay in zip(chunk_states.unbind(1), into[..., -1].unbind(2), strict=True):
        starts.append(state)
        state = state * chunk_decay[..., None, None] + chunk_state
    starts = torch.stack(starts, dim=1).view(b, nc, g, r, p, n)  # the state entering each chunk
    from_start = torch.einsum("bclgn,bcgrpn->bclgrp", Cg, starts)
    y = y + from_start * into.view(b, g, r, nc, q).permute(0, 3, 4, 1, 2)[..., None]
    y = y.reshape(b, nc * q, h, p)[:, :s]
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), state


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: state [B, H, P, N] (float32), x [B, H, P], dt [B, H], A [H], B/C [B, G, N]
    -> (y [B, H, P] in x's dtype, new state [B, H, P, N] float32). The state passed in is not modified."""
    h, g = x.shape[1], B.shape[1]
    dt = dt.float()
    Bh = B.float().repeat_interleave(h // g, dim=1)  # [B, H, N]
    Ch = C.float().repeat_interleave(h // g, dim=1)
    decay = torch.exp(dt * A.float())[..., None, None]
    new = state.float() * decay + (x.float() * dt[..., None])[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), new
