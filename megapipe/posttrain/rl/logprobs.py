"""Log-probabilities of chosen tokens (and the entropy at each position), chunk by chunk over tokens, so the
[tokens, vocab] logits of a rollout batch never exist whole.

``token_logprobs(hidden, weight, targets, temperature)`` takes the final normed hidden states of the positions that
predict the targets ([N, H]) and the output projection ([V, H]); it returns log softmax(h W^T / T)[target] and the
entropy of that distribution, both [N] in fp32. Forward walks over chunks of ``chunk`` tokens keeping only each
token's log-sum-exp; backward recomputes a chunk's logits and applies d logp / d z = (onehot - softmax) / T, so
the working set is one [chunk, vocab] block in forward and in backward (one more GEMM per chunk than keeping the
logits, which is what a whole rollout batch's logits would cost in memory). The entropy is a metric: no gradient.

``logits_logprobs`` is the same on logits that a layout already produced (data-parallel runs compute the logits of
one micro-batch in the model's forward): rows = the positions that predict a target.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul dtype the model's own projection would use: autocast's when it is on, else the input's."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, inv_t: float) -> torch.Tensor:
    z = torch.mm(h, w.t()).float()
    return z.mul_(inv_t) if inv_t != 1.0 else z


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, chunk, dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.detach().to(dtype)
            n = hidden.shape[0]
            logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
            entropy = torch.empty_like(logp)
            lse = torch.empty_like(logp)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                z = _chunk_logits(hidden[s:e].detach().to(dtype), w, inv_t)
                lse[s:e] = torch.logsumexp(z, dim=-1)
                logp[s:e] = z.gather(1, targets[s:e, None])[:, 0] - lse[s:e]
                z.sub_(lse[s:e, None])  # log-probabilities
                entropy[s:e] = -(z.exp() * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.inv_t, ctx.chunk, ctx.dtype = inv_t, chunk, dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        inv_t, chunk, dtype = ctx.inv_t, ctx.chunk, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.detach().to(dtype)
            grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device) if need_w else None
            for s in range(0, hidden.shape[0], chunk):
                e = min(s + chunk, hidden.shape[0])
                h = hidden[s:e].detach().to(dtype)
                z = _chunk_logits(h, w, inv_t)
                g = grad_logp[s:e].float()
                # d logp / d z = onehot - softmax; times the upstream gradient and 1 / T (z = raw logits / T)
                dz = z.sub_(lse[s:e, None]).exp_().mul_(-(g * inv_t)[:, None])
                dz.scatter_add_(1, targets[s:e, None], (g * inv_t)[:, None])
                dz = dz.to(dtype)
                if need_h:
                    grad_h[s:e] = torch.mm(dz, w).float()
                if need_w:
                    grad_w.add_(torch.mm(dz.t(), h).float())
        return (grad_h.to(hidden.dtype) if need_h else None, grad_w.to(weight.dtype) if need_w else None,
                None, None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per row of ``hidden`` [N, H] under softmax(hidden @ weight.T / temperature)."""
    if hidden.shape[0] == 0:
        zero = hidden.sum() * 0.0 + weight.sum() * 0.0  # keeps the graph (and the gradient sync) intact
        return zero.float().expand(0), torch.zeros(0, device=hidden.device)
    return _TokenLogprobs.apply(hidden, weight, targets, 1.0 / temperature, chunk, _compute_dtype(hidden))


def logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from logits [N, V] that exist already (one micro-batch's). log p = z[target] - logsumexp(z), chunk
    by chunk: autograd keeps the logits (a view when they are fp32 and T = 1, else a tempered copy) and each
    chunk's softmax lives only inside its backward."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0 + logits.new_zeros(0, dtype=torch.float32), logits.new_zeros(0, dtype=torch.float32)
    logps, entropies = [], []
    for s in range(0, logits.shape[0], chunk):
        z = logits[s:s + chunk].float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        logps.append(z.gather(1, targets[s:s + chunk, None])[:, 0] - lse)
        with torch.no_grad():
            logz = z - lse[:, None]
            entropies.append(-(logz.exp() * logz).sum(-1))
    return torch.cat(logps), torch.cat(entropies)
