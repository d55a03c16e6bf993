"""Context parallelism: causal ring attention over load-balanced (zig-zag) sequence chunks.

The sequence is cut into 2*cp chunks; CP rank r holds chunks r and 2cp-1-r (so every rank has the same amount of
causal work). Each rank keeps its queries and passes its keys/values around the ring (cp-1 hops, overlapped with
compute); partial results are merged with the online-softmax rule using their log-sum-exp. Backward runs the same
ring, carrying the K/V gradients with the K/V so they arrive home after a full turn. Plain send/recv
(batch_isend_irecv) only, so it runs on gloo and NCCL alike. Attention math is done in fp32 (fp64 for fp64 inputs).

With zig-zag chunks, at ring step i (K/V from rank s = r - i mod cp):
  i == 0: local, causal over the two own chunks;  s < r: all queries vs the first K/V chunk;
  s > r: the second query chunk vs all K/V.  (Every other pair is fully masked.)

A sliding window (Mistral's, GPT-OSS's windowed layers) masks each pair by the global positions of its queries and
keys (a pair wholly outside the window is skipped; a row with no key in a pair adds nothing to its merge).
Attention sinks (GPT-OSS: a logit per head in every row's denominator) join each row's log-sum-exp once, after the
ring: the output is scaled by exp(lse - lse'), lse' = logaddexp(lse, sink); the backward uses lse' as every block's
normaliser and gives the sink -sum(exp(sink - lse') * rowsum(dout * out)).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# ------------------------------------------------------------------------------------------- sharding of inputs


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (into the full sequence) held by CP rank ``rank``: chunk r then chunk 2cp-1-r."""
    c = seq_len // (2 * cp)
    a = torch.arange(rank * c, (rank + 1) * c)
    b = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([a, b])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    idx = zigzag_indices(tensor.shape[dim], cp, rank).to(tensor.device)
    return tensor.index_select(dim, idx).contiguous()


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence given every rank's part (rank order)."""
    cp = len(parts)
    chunks = [None] * (2 * cp)
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp - 1 - r] = a, b
    return torch.cat(chunks, dim=dim)


# ------------------------------------------------------------------------------------------- block kernels


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _scores(q, k, scale, allowed):
    """Scaled scores, -inf where ``allowed`` [n, m] (None: every key) is False."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_forward(q, k, v, scale, allowed):
    """out [B,H,n,D] and lse [B,H,n] of softmax(q k^T) v (fp32); a row with no allowed key: out 0, lse -inf."""
    s = _scores(q, k, scale, allowed)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.masked_fill(lse.isinf(), 0).unsqueeze(-1)), v)
    return out, lse


def _merge(out, lse, blk_out, blk_lse):
    """Online-softmax merge of a partial result into the running (out, lse)."""
    if out is None:
        return blk_out, blk_lse
    new_lse = torch.logaddexp(lse, blk_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + blk_out * torch.exp(blk_lse - new_lse).unsqueeze(-1)
    return out, new_lse


def _block_backward(q, k, v, dout, lse, delta, scale, allowed):
    """Gradients of one block given the FINAL lse and delta = rowsum(dout * out)."""
    s = _scores(q, k, scale, allowed)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv


# ------------------------------------------------------------------------------------------- ring


class _Ring:
    """Pass one contiguous buffer to the next CP rank while receiving the previous rank's."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, buf: torch.Tensor):
        buf = buf.contiguous()
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        if self.rank % 2:  # odd ranks receive first: avoids send/send pairing on backends that block
            ops.reverse()
        reqs = dist.batch_isend_irecv(ops)
        return reqs, recv

    @staticmethod
    def wait(handle) -> torch.Tensor:
        reqs, recv = handle
        for r in reqs:
            r.wait()
        return recv


def _pairs(rank: int, src: int):
    """(query slice, kv slice) for the zig-zag layout; slices are 'all', 'first' or 'second' halves."""
    if src == rank:
        return "all", "all"
    if src < rank:
        return "all", "first"
    return "second", "all"


def _pair_mask(ring, src: int, local_len: int, window, device):
    """(query slice, kv slice, allowed [n, m] or None when every key is, skip: no key at all) of this rank's
    queries against rank ``src``'s keys: causal (and within ``window``) by their global positions."""
    qs, ks = _pairs(ring.rank, src)
    seq_len = local_len * ring.size
    q_pos = _half(zigzag_indices(seq_len, ring.size, ring.rank)[:, None], qs)
    k_pos = _half(zigzag_indices(seq_len, ring.size, src)[:, None], ks)
    allowed = k_pos.T <= q_pos
    if window is not None:
        allowed &= q_pos - k_pos.T < window
    return qs, ks, (None if allowed.all() else allowed.to(device)), not allowed.any()


def _half(t: torch.Tensor, which: str) -> torch.Tensor:
    if which == "all":
        return t
    n = t.shape[-2] // 2
    return t[..., :n, :] if which == "first" else t[..., n:, :]


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, window=None, sinks=None):
        ring = _Ring(group)
        dtype, work = q.dtype, _work_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        qf = q.to(work)
        widths = [k.shape[-1], v.shape[-1]]  # MLA's values are narrower than its keys: one buffer, split by width
        kv = torch.cat([k.to(work), v.to(work)], dim=-1)
        out = lse = None
        for i in range(ring.size):
            handle = ring.start(kv) if i < ring.size - 1 else None
            src = (ring.rank - i) % ring.size
            qs, ks, allowed, skip = _pair_mask(ring, src, q.shape[-2], window, q.device)
            if skip:
                kv = _Ring.wait(handle) if handle is not None else kv
                continue
            kk, vv = (_expand_kv(t, groups) for t in _half(kv, ks).split(widths, dim=-1))
            bo, bl = _block_forward(_half(qf, qs), kk, vv, scale, allowed)
            if qs == "all":
                out, lse = _merge(out, lse, bo, bl)
            else:  # only the second half of the queries: merge into that half
                n = qf.shape[-2] // 2
                o2, l2 = _merge(out[..., n:, :], lse[..., n:], bo, bl)
                out = torch.cat([out[..., :n, :], o2], dim=-2)
                lse = torch.cat([lse[..., :n], l2], dim=-1)
            if handle is not None:
                kv = _Ring.wait(handle)
        if sinks is not None:  # one more logit per head in every row's denominator, of no value
            with_sink = torch.logaddexp(lse, sinks.to(work).view(1, -1, 1).expand_as(lse))
            out = out * torch.exp(lse - with_sink).unsqueeze(-1)
            lse = with_sink
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.scale, ctx.window = group, scale, window
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ring = _Ring(ctx.group)
        scale = ctx.scale
        groups = q.shape[1] // k.shape[1]
        work = _work_dtype(q.dtype)
        qf, dof = q.to(work), dout.to(work)
        delta = (dof * out).sum(-1)
        dq = torch.zeros_like(qf)
        # travelling buffer: K, V and the gradients of the K/V it carries, side by side in the last dimension
        widths = [k.shape[-1], v.shape[-1]] * 2
        buf = torch.cat([k.to(work), v.to(work), torch.zeros_like(k, dtype=work), torch.zeros_like(v, dtype=work)],
                        dim=-1)
        n = qf.shape[-2] // 2
        for i in range(ring.size):
            src = (ring.rank - i) % ring.size
            qs, ks, allowed, skip = _pair_mask(ring, src, q.shape[-2], ctx.window, q.device)
            if skip:
                buf = _Ring.wait(ring.start(buf))
                continue
            kk, vv, _, _ = (_expand_kv(t, groups) for t in _half(buf, ks).split(widths, dim=-1))
            sl = slice(None) if qs == "all" else slice(n, None)
            gq, gk, gv = _block_backward(
                qf[..., sl, :], kk, vv, dof[..., sl, :], lse[..., sl], delta[..., sl], scale, allowed
            )
            dq[..., sl, :] += gq
            ksl = slice(None) if ks == "all" else slice(None, n)
            _, _, dk, dv = buf.split(widths, dim=-1)  # views: adding to them adds to buf
            dk[..., ksl, :] += _reduce_kv(gk, groups)
            dv[..., ksl, :] += _reduce_kv(gv, groups)
            buf = _Ring.wait(ring.start(buf))  # after cp hops the K/V gradients are back home
        _, _, dk, dv = buf.split(widths, dim=-1)
        dsinks = None
        if sinks is not None:
            dsinks = -(torch.exp(sinks.to(work).view(1, -1, 1) - lse) * delta).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, dsinks


def ring_attention(q, k, v, group, window=None, sinks=None) -> torch.Tensor:
    """Causal attention of this rank's zig-zag chunks; q/k/v are [B, heads, S_local, head_dim] (GQA allowed; v's
    head_dim may differ from q/k's, as in MLA); ``window``: a sliding window; ``sinks`` [heads]: attention sinks."""
    return RingAttention.apply(q, k, v, group, 1.0 / math.sqrt(q.shape[-1]), window, sinks)


class RingSDPA:
    """Drop-in for ``attention.sdpa``: (q, k, v, sinks=) -> out, attending across the CP group with the layer's
    sliding window (None: full)."""

    def __init__(self, group, sliding_window=None):
        self.group, self.sliding_window = group, sliding_window

    def __call__(self, q, k, v, mask=None, sinks=None):
        return ring_attention(q, k, v, self.group, self.sliding_window, sinks)


def apply_cp(model, mesh) -> None:
    """Replace every block's attention kernel (the MTP modules' blocks too) by ring attention over the CP mesh
    (1-D)."""
    group = mesh.get_group()
    for block in [*model.layers.values(), *(m.block for m in getattr(model, "mtp", None) or [])]:
        block.attention.sdpa = RingSDPA(group, getattr(block.attention.sdpa, "sliding_window", None))
