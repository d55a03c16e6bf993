"""Mamba-2's fused CUDA kernels (mamba-ssm, causal-conv1d; megapipe.models.mamba_kernels) against the PyTorch path
on the same GPU: the mixer's forward and gradients over whole and packed sequences, a prefill from states and
decode steps, within round-off. Skipped where CUDA or the kernels are missing (tests/gpu/conftest.py, below)."""

from __future__ import annotations

import pytest
import torch

from megapipe.models import mamba_kernels
from megapipe.models.attention import DocumentMask
from tests.models.test_mamba import _mixer


@pytest.fixture
def kernels():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if mamba_kernels.imported_kernels() is None:
        pytest.skip("mamba-ssm / causal-conv1d do not import here (pip install megapipe[mamba] on a GPU machine)")
    assert isinstance(mamba_kernels.path_for(torch.zeros(1, device="cuda")), mamba_kernels.FusedPath)


def _both(monkeypatch, fn):
    """fn() on the fused path, then on the PyTorch path (the kernels switched off)."""
    fused = fn()
    monkeypatch.setenv("MEGAPIPE_MAMBA_KERNELS", "0")
    assert mamba_kernels.path_for(torch.zeros(1, device="cuda")) is mamba_kernels.TorchPath
    reference = fn()
    monkeypatch.delenv("MEGAPIPE_MAMBA_KERNELS")
    return fused, reference


@pytest.mark.parametrize("packed", [False, True])
def test_fused_forward_and_gradients_equal_the_torch_path(kernels, monkeypatch, packed):
    mixer = _mixer(5).cuda()
    x = torch.randn(2, 40, mixer.in_z.in_features, device="cuda")
    mask = DocumentMask(torch.tensor([[0] * 17 + [1] * 23, [0] * 40], device="cuda")) if packed else None

    def run():
        mixer.zero_grad()
        xg = x.clone().requires_grad_()
        out = mixer(xg, mask=mask)
        out.square().sum().backward()
        return [out.detach(), xg.grad] + [p.grad.clone() for p in mixer.parameters()]

    fused, reference = _both(monkeypatch, run)
    for ours, expected in zip(fused, reference, strict=True):
        torch.testing.assert_close(ours, expected, rtol=2e-3, atol=2e-3)  # tf32-free fp32, other summation orders


def test_fused_prefill_from_states_and_decode_steps_equal_the_torch_path(kernels, monkeypatch):
    mixer = _mixer(6).cuda()
    channels, heads = mixer.conv_params()[0].shape[0], mixer.in_dt.out_features
    g = torch.Generator(device="cuda").manual_seed(0)
    xbc = torch.randn(3, 21, channels, device="cuda", generator=g)
    dt = torch.randn(3, 21, heads, device="cuda", generator=g)

    @torch.no_grad()
    def run():
        y0, conv, ssm = mixer.ssm(xbc[:, :12], dt[:, :12])
        y1, conv, ssm = mixer.ssm(xbc[:, 12:18], dt[:, 12:18], conv, ssm)
        out = [y0, y1, conv.clone(), ssm.clone()]
        for t in range(18, 21):
            y, conv, ssm = mixer.ssm(xbc[:, t : t + 1], dt[:, t : t + 1], conv, ssm, inplace=True)
            out += [y, conv.clone(), ssm.clone()]
        return out

    fused, reference = _both(monkeypatch, run)
    for ours, expected in zip(fused, reference, strict=True):
        torch.testing.assert_close(ours, expected, rtol=2e-3, atol=2e-3)
