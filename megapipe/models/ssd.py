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
are set to exactly zero, never made small by adding large negative numbers to the log-decays, and every log-decay
sum is a sum over the positions it spans, never a difference of two cumulative sums, so no precision is lost. An
incoming state (conv window or SSM state) continues the row's first document.

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
            # one contiguous buffer for every tap's grad * input, the rows before the sequence included (zeros or
            # the prefix's products), summed as one [B*S, C] matrix: a sum over a slice of the rows is 6x slower
            product = grad.new_empty(grad.shape)
            for j in range(k):
                shift = min(k - 1 - j, s)  # tap j reads the input k-1-j steps back
                torch.mul(grad[:, shift:], x[:, :s - shift], out=product[:, shift:])
                if prefix is None:
                    product[:, :shift].zero_()
                else:
                    torch.mul(grad[:, :shift], prefix[:, j:j + shift], out=product[:, :shift])
                grad_weight[:, j] = product.view(-1, product.shape[-1]).sum(0)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
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
    """a [..., Q] -> [..., Q, Q]: out[i, j] = a[j+1] + ... + a[i] for j < i, 0 on and above the diagonal. Each entry
    is its own sum of the terms it spans (one matmul with 0/1 weights), not a difference of two prefix sums."""
    q = a.shape[-1]
    return (a.reshape(-1, q) @ _spans(q, a)).view(*a.shape, q)


def _spans(q: int, like: torch.Tensor) -> torch.Tensor:
    """[Q, Q*Q] 0/1: entry (m, (i, j)) is 1 where j < m <= i, the terms segment i, j spans."""
    i, j, m = (torch.arange(q, device=like.device).view(shape) for shape in ((1, q, 1), (1, 1, q), (q, 1, 1)))
    return ((j < m) & (m <= i)).to(like.dtype).view(q, q * q)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int, D: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan over a sequence: x [B, S, H, P], dt [B, S, H] (after bias, softplus and limits), A [H]
    (negative), B/C [B, S, G, N], D [H] (optional skip), initial_state [B, H, P, N] (optional),
    document_ids [B, S] (optional) -> (y [B, S, H, P] in x's dtype, final state [B, H, P, N] float32)."""
    b, s, h, p = x.shape
    g, n = B.shape[-2], B.shape[-1]
    # the fewest chunks of at most chunk_size, evened out: the least padding (a 64-token prompt is one chunk of 64,
    # not 128 with half of it padding; the scan costs Q^2 to Q^3 per chunk); the result does not depend on Q
    chunk_size = -(-s // -(-s // chunk_size))
    pad = (-s) % chunk_size
    dt = dt.float()
    a = dt * A.float()  # [B, S, H]: log-decay of each step (<= 0)
    xf, Bf, Cf = x.float(), B.float(), C.float()
    runs = document_runs(document_ids) if document_ids is not None else None
    if pad:  # padded steps decay by exp(0) = 1 and add nothing: the final state is the last real token's
        a, dt = F.pad(a, (0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
        xf, Bf, Cf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, Bf, Cf))
        if runs is not None:
            runs = torch.cat([runs, runs[:, -1:].expand(b, pad)], dim=-1)
    r = h // g
    initial = None if initial_state is None else initial_state.float().view(b, g, r * p, n).transpose(-1, -2)
    y, state = _ChunkScan.apply(xf, dt, a, Bf, Cf, None if D is None else D.float(), initial, runs, chunk_size)
    return y[:, :s].to(x.dtype), state.transpose(-1, -2).reshape(b, h, p, n)


def _decays(a: torch.Tensor, runs: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decays a [B, G, c, R, Q] (document runs [B, 1, c, 1, Q] or None) -> (L [B, G, c, R, Q, Q]: the decay
    from just after token j to token i of a chunk, 0 above the diagonal and across a document start; E [B, G, c, R,
    Q]: the decay from the chunk's incoming state to token l, 0 where a document started since). The masked
    entries are zeroed after exp, never exp(-inf): exp is several times slower on -inf than on finite inputs."""
    q = a.shape[-1]
    # exp out of place: selective recompute replays the matmul's saved output, which must stay as it was
    L = segment_sums(a).exp().masked_fill_(~torch.ones(q, q, dtype=torch.bool, device=a.device).tril(), 0.0)
    E = a.cumsum(-1).exp_()
    if runs is not None:
        L.masked_fill_(runs[..., :, None] != runs[..., None, :], 0.0)
        before = torch.cat([runs[:, :, :1, :, :1], runs[:, :, :-1, :, -1:]], dim=2)  # run of the token before a chunk
        E.masked_fill_(runs != before, 0.0)
    return L, E


class _ChunkScan(torch.autograd.Function):
    """The chunked scan: x [B, S, H, P] (S a multiple of the chunk Q), dt and the log-decays a [B, S, H], B/C
    [B, S, G, N], D [H] or None, an initial state [B, G, N, R*P] or None (R = H / G heads share a group's B and C;
    the states kept transposed), document runs [B, S] or None -> (y [B, S, H, P] incl. the D skip, final state
    [B, G, N, R*P]), in fp32.

    Within a chunk the heads' products run head-major ([B, G, c, R, Q, .] blocks, one small matmul per head); the
    products with B and C token-major ([B, G, c, Q, R*P]: the R heads of a group side by side, one matmul per chunk
    and group). Every operand is written in the layout its matmul reads (no copies inside the matmuls). Backward is
    written out and keeps the inputs, x*dt (head-major) and the states entering the chunks; the decays and the
    products with them are recomputed. (Autograd through the same ops kept every intermediate and took a pass per
    mask, expand, broadcast and layout copy.)"""

    @staticmethod
    def forward(ctx, x, dt, a, Bf, Cf, D, initial, runs, q):
        with torch.autocast(x.device.type, enabled=False):
            b, s, h, p = x.shape
            g, c = Bf.shape[-2], s // q
            r = h // g
            x_t, dt_t = _token_major(x, q, g), _token_major(dt, q, g)[..., None]  # [B, G, c, Q, R, .] views
            xh = torch.mul(x_t.transpose(3, 4), dt_t.transpose(3, 4), out=x.new_empty(b, g, c, r, q, p))
            ah, Bg, Cg = _head_major(a, q, g), _token_major(Bf, q, g)[..., 0, :], _token_major(Cf, q, g)[..., 0, :]
            Bg, Cg = Bg.contiguous(), Cg.contiguous()  # [B, G, c, Q, N]
            rh = None if runs is None else runs.view(b, 1, c, 1, q)
            L, E = _decays(ah, rh)  # [B, G, c, R, Q, Q], [B, G, c, R, Q]
            y_in = (L * (Cg @ Bg.transpose(-1, -2))[:, :, :, None]) @ xh  # within each chunk, per head
            # each chunk's own state (transposed): B^T times its inputs decayed to its last token
            w = _decayed_inputs(x_t, dt_t, L)
            starts, final = _chunk_states_forward(Bg.transpose(-1, -2) @ w, E[..., -1], initial)  # [B, G, c, N, R*P]
            y = x.new_empty(b, s, h, p)
            if initial is None and c == 1:  # no state enters: y is the within-chunk part (a prompt's prefill)
                _token_major(y, q, g).copy_(y_in.transpose(3, 4))
            else:
                torch.addcmul(y_in.transpose(3, 4), (Cg @ starts).view(b, g, c, q, r, p),
                              E.transpose(-1, -2)[..., None], out=_token_major(y, q, g))
            if D is not None:
                y.addcmul_(x, D[:, None])
        ctx.save_for_backward(x, dt, xh, ah, Bg, Cg, D, starts, rh)
        ctx.has_initial = initial is not None
        return y, final

    @staticmethod
    def backward(ctx, gy, g_final):
        x, dt, xh, ah, Bg, Cg, D, starts, rh = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            b, s, h, p = x.shape
            g, c, q = Bg.shape[1], Bg.shape[2], Bg.shape[3]
            r = h // g
            L, E = _decays(ah, rh)
            Et = E.transpose(-1, -2)[..., None]  # [B, G, c, Q, R, 1]
            x_t, dt_t, gy_t = _token_major(x, q, g), _token_major(dt, q, g)[..., None], _token_major(gy, q, g)
            gD = None if D is None else (gy * x).sum((0, 1, 3))
            # y += (C @ starts) * E
            g_from = torch.mul(gy_t, Et, out=x.new_empty(b, g, c, q, r, p)).view(b, g, c, q, r * p)
            gE = (gy_t * (Cg @ starts).view(b, g, c, q, r, p)).sum(-1).transpose(-1, -2)  # [B, G, c, R, Q]
            gC = g_from @ starts.transpose(-1, -2)
            g_chunks, g_chunk_decay, g_initial = _chunk_states_backward(
                Cg.transpose(-1, -2) @ g_from, g_final, starts, E[..., -1])
            gE[..., -1] += g_chunk_decay
            # chunk states = B^T @ w, w = x * dt * dl, dl = L[..., -1, :]
            gB = _decayed_inputs(x_t, dt_t, L) @ g_chunks.transpose(-1, -2)
            g_w = (Bg @ g_chunks).view(b, g, c, q, r, p)
            dl = L[..., -1, :].transpose(-1, -2)[..., None]  # [B, G, c, Q, R, 1]
            g_dl = ((g_w * x_t).sum(-1) * dt_t[..., 0]).transpose(-1, -2)  # [B, G, c, R, Q]
            g_xdt = x.new_empty(b, s, h, p)
            g_xdt_t = torch.mul(g_w, dl, out=_token_major(g_xdt, q, g))
            # y_in = (L * CB) @ xh, per head
            CB = (Cg @ Bg.transpose(-1, -2))[:, :, :, None]
            gy_h = gy_t.transpose(3, 4).contiguous()  # [B, G, c, R, Q, P]
            g_xdt_t += ((L * CB).transpose(-1, -2) @ gy_h).transpose(3, 4)
            gM = gy_h @ xh.transpose(-1, -2)
            gCB = (gM * L).sum(3)
            gL = gM.mul_(CB)
            gL[..., -1, :] += g_dl
            gC += gCB @ Bg
            gB += gCB.transpose(-1, -2) @ Cg
            # L = exp(segment sums of a), E = exp(cumulative sums of a); their masked entries are 0: no gradient
            g_a = (gL.mul_(L).view(-1, q * q) @ _spans(q, x).T).view(ah.shape)
            g_a += gE.mul_(E).flip(-1).cumsum(-1).flip(-1)  # E's exponent is a cumulative sum
            # xdt = x * dt, y += x * D
            g_dt = (g_xdt * x).sum(-1)
            g_x = g_xdt.mul_(dt[..., None])
            if D is not None:
                g_x.addcmul_(gy, D[:, None])
            g_a = g_a.permute(0, 2, 4, 1, 3).reshape(b, s, h)
            gB, gC = (t.permute(0, 2, 3, 1, 4).reshape(b, s, g, -1) for t in (gB, gC))
        return g_x, g_dt, g_a, gB, gC, gD, g_initial if ctx.has_initial else None, None, None


def _decayed_inputs(x_t: torch.Tensor, dt_t: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """x * dt decayed to its chunk's last token, [B, G, c, Q, R*P] (written token-major), from x and dt as
    ``_token_major`` views and the decays L [B, G, c, R, Q, Q]."""
    b, g, c, q, r, p = x_t.shape
    to_end = dt_t * L[..., -1, :].transpose(-1, -2)[..., None]  # [B, G, c, Q, R, 1]
    return torch.mul(x_t, to_end, out=x_t.new_empty(b, g, c, q, r, p)).view(b, g, c, q, r * p)


def _token_major(t: torch.Tensor, q: int, g: int) -> torch.Tensor:
    """[B, S, G*R, ...] -> a view [B, G, c, Q, R, ...] (chunks of Q tokens, groups of R heads)."""
    b, s = t.shape[:2]
    t = t.view(b, s // q, q, g, -1, *t.shape[3:])
    return t.permute(0, 3, 1, 2, *range(4, t.dim()))


def _head_major(t: torch.Tensor, q: int, g: int) -> torch.Tensor:
    """[B, S, G*R] -> [B, G, c, R, Q] (contiguous)."""
    return _token_major(t, q, g).transpose(-1, -2).contiguous()


def _chunk_states_forward(chunk_states: torch.Tensor, decay: torch.Tensor,
                          initial: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The state entering each chunk [B, G, c, N, R*P] (transposed) and the final one, from the chunks' own states,
    their decays [B, G, c, R] and an initial state [B, G, N, R*P] (None: zeros): state_{i+1} = state_i * decay_i +
    chunk_state_i, each written straight into its slot."""
    b, g, c, n, rp = chunk_states.shape
    r = decay.shape[-1]
    starts = torch.empty_like(chunk_states)
    if initial is None:
        starts[:, :, 0].zero_()
    else:
        starts[:, :, 0] = initial
    by_head = starts.view(b, g, c, n, r, -1)
    for i in range(c):
        out = by_head[:, :, i + 1] if i + 1 < c else None
        final = torch.addcmul(chunk_states[:, :, i].view(b, g, n, r, -1), by_head[:, :, i], decay[:, :, i, None, :, None],
                              out=out)
    return starts, final.view(b, g, n, rp)


def _chunk_states_backward(grad_starts: torch.Tensor, grad_final: torch.Tensor, starts: torch.Tensor,
                           decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the chunks' own states, their decays and the initial state: the recurrence in reverse."""
    b, g, c, n, rp = starts.shape
    r = decay.shape[-1]
    grad_chunks = torch.empty_like(starts)  # [i]: the gradient of the state leaving chunk i
    grad_chunks[:, :, c - 1] = grad_final
    by_head, starts_by_head = grad_chunks.view(b, g, c, n, r, -1), grad_starts.view(b, g, c, n, r, -1)
    entering = starts.view(b, g, c, n, r, -1)
    grad_decay = decay.new_empty(b, g, c, r)
    product = by_head.new_empty(by_head[:, :, 0].shape)  # one chunk's: still in cache when summed
    for i in reversed(range(c)):
        torch.sum(torch.mul(by_head[:, :, i], entering[:, :, i], out=product), (2, 4), out=grad_decay[:, :, i])
        out = by_head[:, :, i - 1] if i > 0 else None
        grad_initial = torch.addcmul(starts_by_head[:, :, i], by_head[:, :, i], decay[:, :, i, None, :, None], out=out)
    return grad_chunks, grad_decay, grad_initial.view(b, g, n, rp)


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
