"""Output projection + cross-entropy fused and chunked over tokens, so the [tokens, vocab] logits never exist whole.

With a large vocabulary the logits are the largest tensors of a small model (8 x 256 tokens x 49k vocab = 400 MB in
fp32), and the plain path allocates, writes and re-reads them several times (logits, log-softmax, its gradient, the
gradient of the logits). Here the forward walks over chunks of tokens, reusing one logits buffer: logits of the chunk
-> softmax in place -> loss, and right away the chunk's gradients (softmax - one-hot) times the weight (-> grad of the
hidden states) and times the hidden states (-> accumulated grad of the weight). Backward only scales what forward
stored. Same FLOPs as the plain path, a chunk-sized working set.

The chunk's logits are kept transposed, [vocab, tokens]: on CPU all three GEMMs (weight @ hidden^T, its transpose
@ weight, it @ hidden) then run near the BLAS peak, where [tokens, vocab] made the forward GEMM ~1.5x slower, and a
reused buffer spares the page faults of a fresh 100+ MB tensor per chunk. In fp32 the result matches
``cross_entropy(hidden @ weight.T, labels)`` to round-off (~1e-6).
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024  # tokens per chunk: 1024 x 49k vocab = 200 MB of fp32 logits at a time
# When no logit can exceed this in magnitude, exp() is taken without subtracting the max first: exp(30) ~ 1e13 and
# exp(-30) ~ 1e-13 keep sums, reciprocals and products with the weights far from fp32's overflow and denormals.
NO_SHIFT_LIMIT = 30.0


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul dtype the plain path would use: the autocast dtype when autocast is on, else the input's."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def _chunks(n: int, chunk: int):
    return ((s, min(s + chunk, n)) for s in range(0, n, chunk))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk, dtype, grad_enabled):
        with torch.autocast(hidden.device.type, enabled=False):  # the casts below are explicit
            need = (grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1])
            grad_h, grad_w, loss = _forward(hidden, weight, labels, ignore_index, chunk, dtype, *need)
        ctx.grads = (
            grad_h.view(hidden.shape).to(hidden.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
        )
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.grads
        del ctx.grads
        if not torch.equal(grad_out, torch.ones_like(grad_out)):  # tokens / global tokens, fp16 loss scale
            grad_h = grad_h * grad_out if grad_h is not None else None
            grad_w = grad_w * grad_out if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None


def _logits_may_exceed(h: torch.Tensor, w: torch.Tensor, limit: float) -> bool:
    """Whether some |h_t . w_v| may exceed ``limit``, by Cauchy-Schwarz: max_t |h_t| * max_v |w_v| (one pass over
    the weight). When it cannot, the softmax needs no max-shift, which spares two of its five passes over a chunk."""
    if h.shape[0] == 0:
        return False
    norm = torch.linalg.vector_norm
    return bool(norm(h, dim=1, dtype=torch.float32).max() * norm(w, dim=1, dtype=torch.float32).max() > limit)


def _forward(hidden, weight, labels, ignore_index, chunk, dtype, need_h, need_w):
    """The loss and, as asked, fp32 gradients of the hidden states and of the weight (not yet times grad_out)."""
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    n, vocab, f32 = h.shape[0], weight.shape[0], torch.float32
    w = weight.to(dtype)
    valid = y != ignore_index
    # per-token factor of the mean: 1 / (number of counted tokens), 0 for ignored ones (0 / 0 = nan if none)
    scale = valid.to(f32) / valid.sum()
    target = torch.where(valid, y, 0).unsqueeze(0)
    shift = _logits_may_exceed(h.to(dtype), w, NO_SHIFT_LIMIT)
    grad_h = torch.empty(h.shape, dtype=f32, device=h.device) if need_h else None
    grad_w = (torch.empty if n else torch.zeros)(weight.shape, dtype=f32, device=h.device) if need_w else None
    loss = torch.zeros((), dtype=f32, device=h.device)
    size = vocab * min(chunk, n)
    buf = torch.empty(size, dtype=f32, device=h.device)  # fp32 logits -> softmax -> gradient of the logits
    low = buf if dtype == f32 else torch.empty(size, dtype=dtype, device=h.device)  # the GEMMs' copy
    for first, (s, e) in enumerate(_chunks(n, chunk)):
        hc, t, sc = h[s:e].to(dtype), target[:, s:e], scale[s:e]
        z, zl = buf[: vocab * (e - s)].view(vocab, e - s), low[: vocab * (e - s)].view(vocab, e - s)
        torch.mm(w, hc.t(), out=zl)
        if zl is not z:
            z.copy_(zl)
        picked = z.gather(0, t).squeeze(0)
        if shift:
            top = z.amax(0)
            z.sub_(top)
            picked = picked - top
        z.exp_()
        total = z.sum(0)
        loss += ((total.log() - picked) * sc).sum()
        if not (need_h or need_w):
            continue
        # d loss / d logits = (exp / total - one-hot) * scale. The per-token factors go onto the small [chunk, H]
        # operands and the one-hot part is added apart (gather, index_add), sparing passes over the chunk; only a
        # low-precision copy is normalised first, so that it holds the softmax itself (in fp16's range).
        inv = total.reciprocal_()
        if zl is z:
            col = sc * inv
        else:
            zl.copy_(z.mul_(inv))
            col = sc
        rows, col, sc = t.squeeze(0), col.unsqueeze(1), sc.unsqueeze(1)
        if need_h:
            grad_h[s:e] = torch.mm(zl.t(), w).to(f32).mul_(col)
            grad_h[s:e] -= w.index_select(0, rows).to(f32) * sc
        if need_w:
            h32 = hc.to(f32)
            hs = (h32 * col).to(dtype)
            if dtype == f32:  # straight into the accumulator
                torch.mm(zl, hs, out=grad_w) if first == 0 else grad_w.addmm_(zl, hs)
            else:
                grad_w.copy_(torch.mm(zl, hs)) if first == 0 else grad_w.add_(torch.mm(zl, hs))
            grad_w.index_add_(0, rows, h32 * -sc)
    return grad_h, grad_w, loss


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` ([..., H] x [V, H]) against ``labels`` [...]; labels equal to
    ``ignore_index`` do not count. Under autocast the matmuls run in the autocast dtype, the softmax in fp32."""
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk, _compute_dtype(hidden),
                                         torch.is_grad_enabled())
