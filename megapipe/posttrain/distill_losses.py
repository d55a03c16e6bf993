"""Logit distillation losses, chunked over tokens so no [tokens, vocab] fp32 tensor is ever held whole.

Per token, with student logits z_s, teacher logits z_t, temperature T, p = softmax(z / T):

- forward KL (Hinton): ``T^2 * KL(p_t || p_s) = T^2 * sum p_t (log p_t - log p_s)``;
- reverse KL: ``T^2 * KL(p_s || p_t)``;
- generalized JSD(beta) (GKD, Agarwal et al. 2024): with m = beta p_t + (1 - beta) p_s,
  ``T^2 * (beta KL(p_t || m) + (1 - beta) KL(p_s || m))``; beta = 0 is forward KL and beta = 1 reverse KL
  (the ends taken as those divergences, as TRL does, rather than the vanishing limits);
- top-k: only the teacher's k most likely tokens count, both distributions renormalised over them;
- mixed with the LM loss: ``alpha * distill + (1 - alpha) * cross_entropy(z_s, label)``.

The T^2 factor keeps the gradient's size independent of T (Hinton et al. 2015). The gradients with respect to the
student logits are written out (d/du with u = z / T: p_s - p_t for forward KL; p_s (g - sum p_s g) with
g = log p_s - log p_t for reverse KL and g = (1 - beta)(log p_s - log m) for JSD), so a chunk's softmaxes are
dropped as soon as its gradient is formed. Two entry points:

- ``fused``: the student's final hidden states and output weight (the loop's fused path): the chunk's logits are
  computed, used and dropped in the forward, which also forms the gradients of the hidden states and the weight,
  as megapipe.models.fused_cross_entropy does for cross-entropy;
- ``logits``: the student's logits (any layout); the forward keeps nothing per chunk, the backward recomputes each
  chunk's teacher logits and fills the logits' gradient chunk by chunk.

The teacher always comes as its final hidden states [tokens, H_t] and output weight [V, H_t]: its logits exist one
chunk at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_CHUNK = 512  # tokens per chunk: 512 x 49k vocab x 4 bytes = 100 MB per [chunk, vocab] buffer


@dataclass(frozen=True)
class KDSpec:
    kind: str = "forward_kl"  # forward_kl | reverse_kl | jsd
    temperature: float = 1.0
    alpha: float = 1.0  # weight of the distillation term; 1 - alpha on the LM cross-entropy
    beta: float = 0.5  # generalized JSD
    top_k: int = 0  # 0: the whole vocabulary

    @classmethod
    def from_config(cls, d) -> "KDSpec":
        return cls(d.loss, d.temperature, d.alpha, d.jsd_beta, d.top_k)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def _divergence(us: torch.Tensor, ut: torch.Tensor, spec: KDSpec, need_grad: bool):
    """Per-token divergence [c] between softmax(us) and softmax(ut) (already divided by T), and d/dus [c, K]."""
    ls, lt = torch.log_softmax(us, dim=-1), torch.log_softmax(ut, dim=-1)
    ps = ls.exp()
    kind, beta = spec.kind, spec.beta
    if kind == "jsd" and beta == 0.0:
        kind = "forward_kl"
    elif kind == "jsd" and beta == 1.0:
        kind = "reverse_kl"
    if kind == "forward_kl":
        pt = lt.exp()
        d = (pt * (lt - ls)).sum(-1)
        return d, (ps - pt) if need_grad else None
    if kind == "reverse_kl":
        g = ls - lt
        d = (ps * g).sum(-1)
    else:
        lm = torch.logaddexp(ls + math.log(1 - beta), lt + math.log(beta))
        pt = lt.exp()
        d = beta * (pt * (lt - lm)).sum(-1) + (1 - beta) * (ps * (ls - lm)).sum(-1)
        g = (1 - beta) * (ls - lm)
    if not need_grad:
        return d, None
    return d, ps * (g - (ps * g).sum(-1, keepdim=True))


def chunk_loss(zs: torch.Tensor, zt: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, spec: KDSpec,
               need_grad: bool):
    """One chunk: (weighted sum of alpha * T^2 * D + (1 - alpha) * CE, sum of D * T^2, sum of CE, d total / d zs or
    None). zs, zt fp32 [c, V]; labels [c] (any valid id where ``weights`` is 0); weights [c] fp32 (0/1)."""
    T, a = spec.temperature, spec.alpha
    us, ut = zs / T, zt / T
    if spec.top_k:
        k = min(spec.top_k, zt.shape[-1])
        idx = ut.topk(k, dim=-1).indices
        d, g_k = _divergence(us.gather(-1, idx), ut.gather(-1, idx), spec, need_grad)
        g = torch.zeros_like(zs).scatter_(-1, idx, g_k) if need_grad else None
    else:
        d, g = _divergence(us, ut, spec, need_grad)
    kd = d * (T * T)
    total = a * kd
    ce = torch.zeros_like(kd)
    if need_grad:
        g = g.mul_(a * T)  # d (T^2 D) / dz = T * dD/du
    if a < 1.0:
        lse = torch.logsumexp(zs, dim=-1)
        ce = lse - zs.gather(-1, labels[:, None]).squeeze(-1)
        total = total + (1 - a) * ce
        if need_grad:
            sm = torch.softmax(zs, dim=-1).mul_(1 - a)
            sm[torch.arange(len(labels), device=zs.device), labels] -= 1 - a
            g = g.add_(sm)
    if need_grad:
        g = g.mul_(weights[:, None])
    return (total * weights).sum(), (kd * weights).sum(), (ce * weights).sum(), g


def _chunks(n: int, chunk: int):
    return ((s, min(s + chunk, n)) for s in range(0, n, chunk))


def _teacher_logits(th: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
    return (th @ tw.to(th.dtype).t()).float()


class _FusedKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t_hidden, t_weight, labels, weights, spec, chunk, dtype, grad_enabled):
        with torch.autocast(hidden.device.type, enabled=False):  # the casts below are explicit
            need_h = grad_enabled and ctx.needs_input_grad[0]
            need_w = grad_enabled and ctx.needs_input_grad[1]
            need = need_h or need_w
            w = weight.to(dtype)
            grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device) if need_w else None
            sums = torch.zeros(3, dtype=torch.float32, device=hidden.device)
            for s, e in _chunks(hidden.shape[0], chunk):
                h = hidden[s:e].to(dtype)
                zs = (h @ w.t()).float()
                zt = _teacher_logits(t_hidden[s:e], t_weight)
                total, kd, ce, g = chunk_loss(zs, zt, labels[s:e], weights[s:e], spec, need)
                sums += torch.stack([total, kd, ce])
                del zs, zt
                if need_h:
                    grad_h[s:e] = (g.to(dtype) @ w).float()
                if need_w:
                    grad_w += (g.t().to(dtype) @ h).float()
        ctx.grads = (grad_h.to(hidden.dtype) if grad_h is not None else None,
                     grad_w.to(weight.dtype) if grad_w is not None else None)
        return sums[0], sums[1], sums[2]

    @staticmethod
    def backward(ctx, grad_total, _kd, _ce):
        grad_h, grad_w = ctx.grads
        del ctx.grads
        grad_h = grad_h * grad_total if grad_h is not None else None
        grad_w = grad_w * grad_total if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None


class _LogitsKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, t_hidden, t_weight, labels, weights, spec, chunk):
        sums = torch.zeros(3, dtype=torch.float32, device=logits.device)
        for s, e in _chunks(logits.shape[0], chunk):
            total, kd, ce, _ = chunk_loss(logits[s:e].float(), _teacher_logits(t_hidden[s:e], t_weight),
                                          labels[s:e], weights[s:e], spec, need_grad=False)
            sums += torch.stack([total, kd, ce])
        ctx.save_for_backward(logits, t_hidden, t_weight, labels, weights)
        ctx.spec, ctx.chunk = spec, chunk
        return sums[0], sums[1], sums[2]

    @staticmethod
    def backward(ctx, grad_total, _kd, _ce):
        logits, t_hidden, t_weight, labels, weights = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s, e in _chunks(logits.shape[0], ctx.chunk):
            *_, g = chunk_loss(logits[s:e].float(), _teacher_logits(t_hidden[s:e], t_weight), labels[s:e],
                               weights[s:e], ctx.spec, need_grad=True)
            grad[s:e] = (g * grad_total).to(grad.dtype)
        return grad, None, None, None, None, None, None


def distill_fused(hidden, weight, t_hidden, t_weight, labels, weights, spec: KDSpec, chunk: int = DEFAULT_CHUNK):
    """(total, kd, ce) sums over tokens from the student's hidden states [n, H] and output weight [V, H]; the
    student's matmuls run in the autocast dtype when autocast is on (as the plain path would), the softmaxes in fp32."""
    return _FusedKD.apply(hidden, weight, t_hidden, t_weight, labels, weights, spec, chunk, _compute_dtype(hidden),
                          torch.is_grad_enabled())


def distill_logits(logits, t_hidden, t_weight, labels, weights, spec: KDSpec, chunk: int = DEFAULT_CHUNK):
    """(total, kd, ce) sums over tokens from the student's logits [n, V]."""
    return _LogitsKD.apply(logits, t_hidden, t_weight, labels, weights, spec, chunk)
