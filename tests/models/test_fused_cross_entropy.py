"""The fused, chunked output projection + cross-entropy against the plain path (logits -> cross_entropy)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.models import build_model
from megapipe.models.fused_cross_entropy import NO_SHIFT_LIMIT, _logits_may_exceed, fused_linear_cross_entropy

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(tied: bool):
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=64, tie_embeddings=tied)
    return build_model(cfg, seed=0)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_fused_loss_matches_logits_and_cross_entropy_through_the_model(tied):
    """Loss and every parameter gradient, tied and untied output weights, ignored labels, a ragged last chunk."""
    model = _model(tied)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (3, 20), generator=g)
    labels = torch.randint(0, 300, (3, 20), generator=g)
    labels[0, :5] = -100
    labels[2, -3:] = -100

    ref = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    hidden = model(tokens, return_hidden=True)
    assert hidden.shape == (3, 20, 32)
    loss = fused_linear_cross_entropy(hidden, model.output_weight(), labels, chunk=16)  # 60 tokens: 16,16,16,12
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert (model.output_weight() is model.tok_embeddings.weight) == tied
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_scale_no_grad_and_all_ignored():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 7, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (2, 7), generator=g)
    (F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten()) * 0.25).backward()  # as 4 micro-batches do
    ref_h, ref_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (fused_linear_cross_entropy(h, w, y, chunk=5) * 0.25).backward()
    torch.testing.assert_close(h.grad, ref_h, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(w.grad, ref_w, rtol=1e-5, atol=1e-8)

    with torch.no_grad():
        value = fused_linear_cross_entropy(h, w, y)
    assert not value.requires_grad
    assert value.item() == pytest.approx(F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten()).item(), rel=1e-6)
    assert math.isnan(fused_linear_cross_entropy(h, w, torch.full_like(y, -100)).item())  # as cross_entropy: 0 / 0


@pytest.mark.parametrize("scale", [0.02, 1.0, 10.0])
def test_small_and_large_logits_with_and_without_the_max_shift(scale):
    """Small logits skip the max-shift (bounded by |h| |w_v|), large ones (up to ~200, where exp alone would
    overflow) take it; both match cross_entropy."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 11, 24, generator=g).requires_grad_()
    w = (torch.randn(700, 24, generator=g) * scale).requires_grad_()
    y = torch.randint(0, 700, (3, 11), generator=g)
    assert _logits_may_exceed(h.detach().flatten(0, 1), w.detach(), NO_SHIFT_LIMIT) == (scale > 0.02)
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten())
    ref_h, ref_w = torch.autograd.grad(ref, (h, w))
    loss = fused_linear_cross_entropy(h, w, y, chunk=8)
    got_h, got_w = torch.autograd.grad(loss, (h, w))
    assert torch.isfinite(loss) and loss.item() == pytest.approx(ref.item(), rel=1e-6)
    # exp's round-off grows with the logits' size, in the reference as much as here
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-6 * scale)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6 * scale)


def test_bf16_autocast_stays_close_to_the_plain_autocast_path():
    model = _model(tied=False)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
        fused = fused_linear_cross_entropy(model(tokens, return_hidden=True), model.output_weight(), labels)
    assert fused.dtype == torch.float32
    assert fused.item() == pytest.approx(ref.item(), rel=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients_are_as_close_to_fp32_as_the_plain_autocast_path(dtype):
    """The GEMMs run in the autocast dtype, the softmax in fp32: gradients within twice the plain path's error."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(4, 128, 32, generator=g, requires_grad=True)
    w = (torch.randn(2000, 32, generator=g) * 0.1).requires_grad_()
    y = torch.randint(0, 2000, (4, 128), generator=g)

    def grads(fn, low):
        h.grad = w.grad = None
        with torch.autocast("cpu", dtype=dtype, enabled=low):
            loss = fn()
        loss.backward()
        assert loss.dtype == h.grad.dtype == w.grad.dtype == torch.float32
        return h.grad.clone(), w.grad.clone()

    def plain():
        return F.cross_entropy((h @ w.t()).flatten(0, 1).float(), y.flatten())

    def fused():
        return fused_linear_cross_entropy(h, w, y, chunk=200)

    exact = grads(plain, low=False)  # F.cross_entropy's own autograd in fp32, not the code under test
    for got, ref_low, ref in zip(grads(fused, low=True), grads(plain, low=True), exact, strict=True):
        assert (got - ref).abs().max() <= 2 * (ref_low - ref).abs().max()
