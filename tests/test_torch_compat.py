"""The private PyTorch APIs megapipe calls (megapipe/torch_compat.py) are all in the installed torch, and the
oneDNN and grouped-GEMM wrappers compute what the public ops do."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe import torch_compat


def test_every_private_api_is_in_this_torch():
    assert torch_compat.check() == [], f"torch {torch.__version__} (tested: {torch_compat.TESTED_TORCH})"


def test_wrappers_compute_what_the_public_ops_do():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 64), torch.randn(48, 64), torch.randn(48)
    packed = torch_compat.reorder_linear_weight(w, 16)
    torch.testing.assert_close(torch_compat.linear_pointwise(x, packed, b), F.linear(x, w, b))
    other = torch.randn(5, 48)
    torch.testing.assert_close(torch_compat.linear_pointwise_binary(x, other, packed, b, "mul"),
                               F.linear(x, w, b) * other)
    experts = torch.randn(3, 64, 16)  # 3 groups of rows: 2, 0, 3
    got = torch_compat.grouped_mm(x, experts, torch.tensor([2, 2, 5], dtype=torch.int32))
    torch.testing.assert_close(got, torch.cat([x[:2] @ experts[0], x[2:] @ experts[2]]))
    grads, found = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])], torch.zeros(())
    torch_compat.unscale_and_check_(grads, found, torch.tensor(0.5))
    assert grads[0].tolist() == [1.0, 2.0] and found.item() == 1.0
