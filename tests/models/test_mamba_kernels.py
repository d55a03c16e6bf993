"""The choice between the fused CUDA kernels and the PyTorch path (megapipe.models.mamba_kernels): on CPU the PyTorch
path is chosen, and the fused path's own code (argument layouts, broadcasts, state handling) is run here against
stand-ins that compute what the published kernels compute, token by token, so that only the kernels themselves are
left to tests/gpu/test_mamba_fused_kernels.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megapipe.models import mamba_kernels
from megapipe.models.attention import DocumentMask
from megapipe.models.mamba_kernels import FusedPath, TorchPath, path_for
from tests.models.test_mamba import _mixer


def test_cpu_takes_the_torch_path(monkeypatch):
    assert path_for(torch.zeros(1)) is TorchPath
    monkeypatch.setattr(mamba_kernels, "imported_kernels", lambda: pytest.fail("CPU tensors never look for kernels"))
    assert mamba_kernels.kernels_for(torch.zeros(1)) is None
    mixer = _mixer(0)
    y, _, _ = mixer.ssm(torch.randn(1, 3, mixer.conv_params()[0].shape[0]), torch.randn(1, 3, 8))
    assert y.shape == (1, 3, 8, 8)


# ----------------------------------------------------------------------------------- stand-ins for the kernels


def _runs(seq_idx, b, s):
    return torch.zeros(b, s, dtype=torch.int32) if seq_idx is None else seq_idx


def conv_fn(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None):
    """causal_conv1d_fn: x [B, D, L] -> [B, D, L]; taps before the sequence from initial_states [B, D, W-1], taps
    of another seq_idx left out."""
    b, d, s = x.shape
    w = weight.shape[1]
    past = initial_states if initial_states is not None else x.new_zeros(b, d, w - 1)
    full, runs = torch.cat([past, x], dim=-1), _runs(seq_idx, b, s)
    out = torch.zeros_like(x) + (0 if bias is None else bias[:, None])
    for t in range(s):
        for j in range(w):
            src = t - (w - 1) + j
            same = torch.ones(b, dtype=torch.bool) if src < 0 else runs[:, src] == runs[:, t]
            out[..., t] += full[..., t + j] * weight[:, j] * same[:, None]
    return F.silu(out) if activation == "silu" else out


def conv_update(x, conv_state, weight, bias=None, activation=None):
    """causal_conv1d_update: x [B, D], conv_state [B, D, W-1] updated in place."""
    window = torch.cat([conv_state, x[..., None]], dim=-1)
    out = (window * weight).sum(-1) + (0 if bias is None else bias)
    conv_state.copy_(window[..., 1:])
    return F.silu(out) if activation == "silu" else out


def chunk_scan(x, dt, A, B, C, chunk_size, D=None, initial_states=None, seq_idx=None, return_final_states=False):
    """mamba_chunk_scan_combined, as the recurrence it computes (the chunking changes only round-off)."""
    b, s, h, p = x.shape
    g, n = B.shape[2:]
    state = initial_states.clone() if initial_states is not None else x.new_zeros(b, h, p, n)
    runs, ys = _runs(seq_idx, b, s), []
    for t in range(s):
        if t:
            state = state * (runs[:, t] == runs[:, t - 1]).float()[:, None, None, None]
        Bh, Ch = (M[:, t].repeat_interleave(h // g, dim=1) for M in (B, C))
        state = (
            state * torch.exp(dt[:, t] * A)[..., None, None] + (x[:, t] * dt[:, t, :, None])[..., None] * Bh[:, :, None]
        )
        ys.append((state * Ch[:, :, None]).sum(-1) + (0 if D is None else D[:, None] * x[:, t]))
    y = torch.stack(ys, dim=1)
    return (y, state) if return_final_states else y


def state_update(state, x, dt, A, B, C, D=None, dt_softplus=False):
    """selective_state_update: state [B, H, P, N] updated in place; dt [B, H, P], A [H, P, N], D [H, P]."""
    assert not dt_softplus
    h = state.shape[1]
    Bh, Ch = (M.repeat_interleave(h // B.shape[1], dim=1) for M in (B, C))
    state.copy_(state * torch.exp(dt[..., None] * A) + (x * dt)[..., None] * Bh[:, :, None])
    return (state * Ch[:, :, None]).sum(-1) + (0 if D is None else D * x)


STAND_INS = SimpleNamespace(
    causal_conv1d_fn=conv_fn,
    causal_conv1d_update=conv_update,
    mamba_chunk_scan_combined=chunk_scan,
    selective_state_update=state_update,
)


def _run(mixer, xbc, dt, *states, **kw):
    with torch.no_grad():
        return mixer.ssm(xbc, dt, *states, **kw)


def test_fused_path_equals_torch_path(monkeypatch):
    """Whole sequences (from zeros and from states, packed documents), then decode steps, in place and not."""
    mixer = _mixer(1)
    torch.manual_seed(2)
    channels = mixer.conv_params()[0].shape[0]
    xbc, dt = torch.randn(2, 11, channels), torch.randn(2, 11, mixer.in_dt.out_features)
    docs = torch.tensor([[0] * 4 + [1] * 7, [0] * 9 + [1] * 2])
    torch_results = {}
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(mamba_kernels, "kernels_for", lambda t: STAND_INS)
            assert isinstance(path_for(xbc), FusedPath)
        y0, conv0, ssm0 = _run(mixer, xbc[:, :6], dt[:, :6])
        y1, conv1, ssm1 = _run(mixer, xbc[:, 6:], dt[:, 6:], conv0, ssm0)
        yd, convd, ssmd = _run(mixer, xbc, dt, document_ids=docs)
        conv_i, ssm_i = conv1.clone(), ssm1.clone()
        steps = []
        for t in range(3):
            step = torch.randn(2, 1, channels, generator=torch.Generator().manual_seed(t)), dt[:, t : t + 1]
            ys, conv1, ssm1 = _run(mixer, *step, conv1, ssm1)
            yi, _, _ = _run(mixer, *step, conv_i, ssm_i, inplace=True)
            steps += [ys, yi, conv1, ssm1, conv_i.clone(), ssm_i.clone()]
        results = [y0, conv0, ssm0, y1, yd, convd, ssmd, *steps]
        if not fused:
            torch_results = results
    for i, (ours, ref) in enumerate(zip(results, torch_results, strict=True)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5, msg=f"result {i}")


def test_fused_path_in_the_mixer_forward(monkeypatch):
    """The mixer's forward over packed documents, and its input gradient, through the fused path's calls."""
    mixer = _mixer(3)
    x = torch.randn(2, 9, mixer.in_z.in_features)
    docs = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])

    def forward_and_grad():
        xg = x.clone().requires_grad_()
        out = mixer(xg, mask=DocumentMask(document_ids=docs))
        out.square().sum().backward()
        return out.detach(), xg.grad

    ref = forward_and_grad()
    monkeypatch.setattr(mamba_kernels, "kernels_for", lambda t: STAND_INS)
    for ours, expected in zip(forward_and_grad(), ref, strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)  # round-off of sums in another order


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("chunk", [4, 16])
def test_chunked_scan_gradients_equal_the_recurrences(documents, chunk):
    """ssd_chunked's gradients (x, dt, A, B, C, D, the initial state; the chunks' states passed on by their own
    backward) against autograd through the token-by-token recurrence, in fp64. A chunk longer than the 13 tokens
    makes one chunk of 13 (with documents: no state enters, so the incoming state's product is skipped)."""
    from megapipe.models.ssd import ssd_chunked

    g = torch.Generator().manual_seed(8)
    b, s, h, p, groups, n = 2, 13, 4, 3, 2, 5
    inputs = [
        torch.randn(b, s, h, p, generator=g),
        torch.rand(b, s, h, generator=g) * 0.5 + 0.1,
        -torch.rand(h, generator=g) - 0.2,
        torch.randn(b, s, groups, n, generator=g),
        torch.randn(b, s, groups, n, generator=g),
        torch.randn(h, generator=g),
        torch.randn(b, h, p, n, generator=g),
    ]
    docs = torch.tensor([[0] * 6 + [1] * 7, [0] * 13]) if documents else None
    weights = torch.randn(b, s, h, p, generator=g).double(), torch.randn(b, h, p, n, generator=g).double()
    grads = []
    for scan in ("chunked", "recurrence"):
        leaves = [t.double().requires_grad_() for t in inputs]
        x, dt, A, B, C, D, init = leaves
        if scan == "chunked":
            y, final = ssd_chunked(x, dt, A, B, C, chunk, D, None if documents else init, docs)
        else:
            y, final = chunk_scan(
                x,
                dt,
                A,
                B,
                C,
                4,
                D,
                None if documents else init,
                None if docs is None else docs.int(),
                return_final_states=True,
            )
        ((y.double() * weights[0]).sum() + (final.double() * weights[1]).sum()).backward()
        grads.append([t.grad for t in leaves])
    for i, (ours, want) in enumerate(zip(*grads, strict=True)):
        if want is None:
            assert ours is None
        else:
            torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4, msg=f"input {i}")
