"""Output projection + cross-entropy fused and chunked over tokens, so the [tokens, vocab] logits never exist whole.

With a large vocabulary the logits are the largest tensors of a small model (8 x 256 tokens x 49k vocab = 400 MB in
fp32), and the plain path writes and re-reads them several times (logits, log-softmax, its gradient, the gradient of
the logits). Here the forward walks over chunks of tokens: logits of the chunk -> log-softmax -> loss, and right
away the chunk's gradients (softmax - one-hot) times the weight (-> grad of the hidden states) and times the hidden
states (-> accumulated grad of the weight). Backward only scales what forward stored. Same FLOPs as the plain path,
a chunk-sized working set. In fp32 it matches ``cross_entropy(hidden @ weight.T, labels)`` to round-off (~1e-6).
"""

from __future__ import annotations

from typing import Callable

import torch

DEFAULT_CHUNK = 1024  # tokens per chunk: 1024 x 49k vocab = 200 MB of fp32 logits at a time


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul dtype the plain path would use: the autocast dtype when autocast is on, else the input's."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def _chunks(n: int, chunk: int):
    return ((s, min(s + chunk, n)) for s in range(0, n, chunk))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk, dtype, grad_enabled):
        h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        w = weight.to(dtype)
        valid = y != ignore_index
        # per-token factor of the mean: 1 / (number of counted tokens), 0 for ignored ones (0 / 0 = nan if none)
        scale = valid.to(torch.float32) / valid.sum()
        target = torch.where(valid, y, 0).unsqueeze(1)
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for s, e in _chunks(h.shape[0], chunk):
            hc = h[s:e].to(dtype)
            logp = torch.log_softmax((hc @ w.t()).float(), dim=-1)
            loss -= (logp.gather(1, target[s:e]).squeeze(1) * scale[s:e]).sum()
            if not (need_h or need_w):
                continue
            # d loss / d logits = (softmax - one-hot) * scale; the scale goes onto the small [chunk, H] operands
            g = logp.exp_()
            g.scatter_add_(1, target[s:e], torch.full_like(target[s:e], -1, dtype=g.dtype))
            g = g.to(dtype)
            sc = scale[s:e].unsqueeze(1)
            if need_h:
                grad_h[s:e] = (g @ w).float() * sc
            if need_w and dtype == torch.float32:
                grad_w.addmm_(g.t(), hc * sc)
            elif need_w:
                grad_w += (g.t() @ (hc.float() * sc).to(dtype)).float()
        ctx.grads = (
            grad_h.view(hidden.shape).to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
        )
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.grads
        del ctx.grads
        if not torch.equal(grad_out, torch.ones_like(grad_out)):  # 1 / micro-batches, fp16 loss scale
            grad_h = grad_h * grad_out if grad_h is not None else None
            grad_w = grad_w * grad_out if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` ([..., H] x [V, H]) against ``labels`` [...]; labels equal to
    ``ignore_index`` do not count. Under autocast the matmuls run in the autocast dtype, the softmax in fp32."""
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk, _compute_dtype(hidden),
                                         torch.is_grad_enabled())


class FusedLinearCrossEntropy:
    """``loss(hidden, labels)`` for a model that returns its final hidden states (``model.return_hidden = True``);
    ``weight`` gives the output projection's weight when called (``model.output_weight``: tied or not)."""

    def __init__(self, weight: Callable[[], torch.Tensor], ignore_index: int = -100, chunk: int = DEFAULT_CHUNK):
        self.weight, self.ignore_index, self.chunk = weight, ignore_index, chunk

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden, self.weight(), labels, self.ignore_index, self.chunk)
