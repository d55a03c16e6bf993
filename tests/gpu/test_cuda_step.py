"""On a CUDA device: the training step (fused loss, bf16 autocast) agrees with the CPU fp32 reference."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.models import build_model
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.step import train_step

pytestmark = pytest.mark.gpu

MODEL = ModelConfig(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                    vocab_size=1024)


def _step(device: str, fused: bool, precision: str | None = None):
    model = build_model(MODEL, seed=0).to(device)  # the same weights: a seed draws other numbers on CUDA's generator
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 1024, (4, 65), generator=g).to(device)
    batch = {"tokens": data[:, :-1], "labels": data[:, 1:]}
    ctx = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if precision == "bf16" else None
    loss = train_step(model, [batch], ParallelDims(), context=ctx, fused=fused).loss.item()
    return loss, {n: p.grad.float().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fused", [False, True])
def test_fp32_step_on_cuda_matches_cpu(fused):
    ref_loss, ref = _step("cpu", fused=False)
    loss, grads = _step("cuda", fused)
    assert loss == pytest.approx(ref_loss, rel=1e-4)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref[n], rtol=1e-3, atol=1e-5, msg=n)


def test_bf16_fused_step_on_cuda_stays_close():
    ref_loss, _ = _step("cpu", fused=False)
    loss, _ = _step("cuda", fused=True, precision="bf16")
    assert loss == pytest.approx(ref_loss, rel=2e-2)
