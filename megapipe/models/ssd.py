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
        prefix = state.to(x.dtype).transpose(1, 2) if state is not None else None  # [B, K-1, C]
        y = _DepthwiseCausalConv.apply(x, prefix, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return y, conv_state_after(x, k, state)
    prefix = state.to(x.dtype) if state is not None else x.new_zeros(b, c, k - 1)
    full = torch.cat([prefix, x.transpose(1, 2)], dim=-1)  # [B, C, K-1+S]
    runs = document_runs(document_ids)
    runs_full = torch.cat([runs[:, :1].expand(b, k - 1), runs], dim=-1)  # the state continues the first document
    keep = (runs_full.unfold(-1, k, 1) == runs[..., None]).to(x.dtype)  # [B, S, K]: tap in the token's document
    windows = full.unfold(-1, k, 1)  # [B, C, S, K]
    y = torch.einsum("bcsk,ck,bsk->bsc", windows, weight.to(x.dtype), keep)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y, conv_state_after(x, k, state, document_ids)


def conv_state_after(x: torch.Tensor, k: int, state: Optional[torch.Tensor] = None,
                     document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The conv window [B, C, K-1] after x [B, S, C] from ``state`` (zeros if None): the last K-1 inputs, oldest
    first, those before the last document zeroed."""
    b, s, c = x.shape
    tail = x[:, max(s - k + 1, 0):].transpose(1, 2)
    if s >= k - 1:
        window = tail.contiguous()
    else:
        prefix = state.to(x.dtype) if state is not None else x.new_zeros(b, c, k - 1)
        window = torch.cat([prefix[..., s:], tail], dim=-1)
    if document_ids is None:
        return window
    runs = document_runs(document_ids)
    runs_full = torch.cat([runs[:, :1].expand(b, k - 1), runs], dim=-1)  # the state continues the first document
    return window * (runs_full[:, s:] == runs[:, -1:]).to(x.dtype)[:, None, :]


class _DepthwiseCausalConv(torch.autograd.Function):
    """y[:, t] = bias + sum_k weight[:, k] * full[:, t + k] where full = [prefix; x] ([B, K-1+S, C], channels last
    as the projections give them; prefix None: zeros): K shifted multiply-adds on whole tensors each way, in place,
    cheaper on CPU than a grouped conv1d (channels-first copies, a slow depthwise backward), and contiguous."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, prefix: Optional[torch.Tensor], weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
        k, s = weight.shape[-1], x.shape[1]
        y = x * weight[:, k - 1] if bias is None else torch.addcmul(bias, x, weight[:, k - 1])
        for j in range(k - 1):
            shift = k - 1 - j  # tap j reads the input ``shift`` steps back
            if shift < s:
                y[:, shift:].addcmul_(x[:, :s - shift], weight[:, j])
            if prefix is not None:
                y[:, :shift].addcmul_(prefix[:, j:j + min(shift, s)], weight[:, j])
        ctx.save_for_backward(x, prefix, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, prefix, weight = ctx.saved_tensors
        k, s = weight.shape[-1], x.shape[1]
        grad_x = grad_prefix = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad * weight[:, k - 1]
            for j in range(k - 1):
                shift = k - 1 - j
                if shift < s:
                    grad_x[:, :s - shift].addcmul_(grad[:, shift:], weight[:, j])
        if prefix is not None and ctx.needs_input_grad[1]:
            grad_prefix = torch.zeros_like(prefix)
            for j in range(k - 1):
                shift = min(k - 1 - j, s)
                grad_prefix[:, j:j + shift].addcmul_(grad[:, :shift], weight[:, j])
        if ctx.needs_input_grad[2]:
            grad_weight = torch.empty_like(weight)
            product = torch.empty_like(grad)  # one buffer for every tap's grad * input
            for j in range(k):
                shift = k - 1 - j
                if shift < s:
                    torch.mul(grad[:, shift:], x[:, :s - shift], out=product[:, shift:])
                    grad_weight[:, j] = product[:, shift:].sum((0, 1))
                else:
                    grad_weight[:, j] = 0
                if prefix is not None:
                    grad_weight[:, j] += (grad[:, :shift] * prefix[:, j:j + min(shift, s)]).sum((0, 1))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad.sum((0, 1))
        return grad_x, grad_prefix, grad_weight, grad_bias


def conv_step(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
              state: torch.Tensor, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: x [B, C], state [B, C, K-1] -> (y [B, C], new state); ``inplace``: the new state written into
    ``state``, which is returned."""
    window = torch.cat([state.to(x.dtype), x[..., None]], dim=-1)  # [B, C, K]
    y = (window * weight.to(x.dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(x.dtype)
    if inplace:
        return y, state.copy_(window[..., 1:])
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
    # head-major layouts [B, G, R, c, Q, .] (R heads of a group share its B and C): each product below is one
    # batched matmul over contiguous blocks, with no layout copies inside and none between them
    a = a.view(b, nc, q, g, r).permute(0, 3, 4, 1, 2)  # [B, G, R, c, Q]
    xdt = xdt.view(b, nc, q, g, r, p).permute(0, 3, 4, 1, 2, 5).contiguous()  # [B, G, R, c, Q, P]
    Bg = Bg.view(b, nc, q, g, n).permute(0, 3, 1, 2, 4)[:, :, None]  # [B, G, 1, c, Q, N]
    Cg = Cg.view(b, nc, q, g, n).permute(0, 3, 1, 2, 4)[:, :, None]
    seg = segment_sums(a)  # [B, G, R, c, Q, Q]: log-decay from just after token j to token i of one chunk
    into = a.cumsum(-1)  # [B, G, R, c, Q]: log-decay from the chunk's incoming state to token l
    if runs is not None:
        rr = runs.view(b, 1, 1, nc, q)
        seg = seg.masked_fill(rr[..., :, None] != rr[..., None, :], float("-inf"))
        before = torch.cat([rr[..., :1, :1], rr[..., :-1, -1:]], dim=-2)  # run of the token before each chunk
        into = into.masked_fill(rr != before, float("-inf"))
    decay = seg.exp()
    y = ((Cg @ Bg.transpose(-1, -2)) * decay) @ xdt  # within each chunk: [B, G, R, c, Q, P]
    weighted = xdt * decay[..., -1, :, None]  # decayed to the chunk's last token
    chunk_states = weighted.transpose(-1, -2) @ Bg  # [B, G, R, c, P, N]
    into = into.exp()
    initial = None if initial_state is None else initial_state.float().view(b, g, r, p, n)
    # [B, G, R, c, P, N]: the state entering each chunk (fp32 even where autocast made the chunk states bf16)
    starts, state = _ChunkStates.apply(chunk_states.float(), into[..., -1], initial)
    y = y + (Cg @ starts.transpose(-1, -2)) * into[..., None]
    y = y.permute(0, 3, 4, 1, 2, 5).reshape(b, nc * q, h, p)[:, :s]
    state = state.view(b, h, p, n)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), state


class _ChunkStates(torch.autograd.Function):
    """The state entering each chunk and the final one, from the chunks' own states [B, G, R, c, P, N], their
    decays [B, G, R, c] and an initial state (None: zeros): state_{c+1} = state_c * decay_c + chunk_state_c, written
    into one tensor as it goes; backward runs the recurrence in reverse. Only the entering states (and the decays)
    are saved: autograd through a loop would keep every state twice (the loop's and a stacked copy) and stack the
    chunks' gradients back together."""

    @staticmethod
    def forward(ctx, chunk_states: torch.Tensor, decay: torch.Tensor, initial: Optional[torch.Tensor]):
        starts = torch.empty_like(chunk_states)
        state = initial if initial is not None else chunk_states.new_zeros(starts[:, :, :, 0].shape)
        for c in range(chunk_states.shape[3]):
            starts[:, :, :, c] = state
            state = torch.addcmul(chunk_states[:, :, :, c], state, decay[..., c, None, None])
        ctx.save_for_backward(starts, decay)
        ctx.has_initial = initial is not None
        return starts, state

    @staticmethod
    def backward(ctx, grad_starts: torch.Tensor, grad_final: torch.Tensor):
        starts, decay = ctx.saved_tensors
        grad_chunks, grad_decay = torch.empty_like(starts), torch.empty_like(decay)
        grad = grad_final  # of the state leaving chunk c, from c = last down
        for c in reversed(range(starts.shape[3])):
            grad_chunks[:, :, :, c] = grad
            grad_decay[..., c] = (grad * starts[:, :, :, c]).sum((-1, -2))
            grad = torch.addcmul(grad_starts[:, :, :, c], grad, decay[..., c, None, None])
        return grad_chunks, grad_decay, grad if ctx.has_initial else None


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: Optional[torch.Tensor] = None, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: state [B, H, P, N] (float32), x [B, H, P], dt [B, H], A [H], B/C [B, G, N]
    -> (y [B, H, P] in x's dtype, new state [B, H, P, N] float32). The state passed in is not modified, unless
    ``inplace`` (a contiguous float32 state, updated where it lies: a decode step's one pass over it)."""
    b, h, p, n = state.shape
    g = B.shape[1]
    dt = dt.float()
    decay = torch.exp(dt * A.float())[..., None, None]
    new = state.mul_(decay) if inplace else state.float() * decay
    grouped = new.view(b, g, h // g * p, n)  # the heads of a group share its B and C
    grouped.view(b, g, h // g, p, n).addcmul_((x.float() * dt[..., None]).view(b, g, h // g, p, 1),
                                              B.float().view(b, g, 1, 1, n))
    y = (grouped * C.float().view(b, g, 1, n)).sum(-1).view(b, h, p)  # a matvec per group: faster than matmul
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), new
