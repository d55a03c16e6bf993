"""The one training step: global token-weighted normalisation, whatever the micro-batching (dp2 and pipeline
cases run in tests/dist/parallel_cases.py with the same uneven masks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.models import build_model
from megapipe.models.objective import IGNORE_INDEX, LossResult, TokenCrossEntropy
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.step import eval_step, train_step

MODEL = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64)


def uneven_batch(rows: int = 8, seq: int = 12) -> dict:
    """Rows whose loss masks keep very different numbers of tokens (12, 1, 7, 0, ...)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (rows, seq + 1), generator=g)
    keep = torch.tensor([12, 1, 7, 0, 3, 12, 5, 9])[:rows]
    mask = torch.arange(seq)[None] < keep[:, None]
    return {"tokens": data[:, :-1], "labels": data[:, 1:], "loss_mask": mask}


def grads_of(n_micro: int, fused: bool = False):
    model = build_model(MODEL, seed=1)
    batch = uneven_batch()
    size = batch["tokens"].shape[0] // n_micro
    mbs = [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, batch["tokens"].shape[0], size)]
    result = train_step(model, mbs, ParallelDims(), fused=fused)
    return result, {n: p.grad.clone() for n, p in model.named_parameters()}


def reference():
    """Direct: the mean cross-entropy over every unmasked token of the global batch, by autograd."""
    model = build_model(MODEL, seed=1)
    b = uneven_batch()
    labels = b["labels"].masked_fill(~b["loss_mask"], IGNORE_INDEX)
    loss = F.cross_entropy(model(b["tokens"]).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fused", [False, True])
def test_one_two_and_four_micro_batches_give_the_global_token_mean(fused):
    ref_loss, ref_grads = reference()
    for n in (1, 2, 4):
        result, grads = grads_of(n, fused)
        assert result.units == int(uneven_batch()["loss_mask"].sum())
        assert result.loss.item() == pytest.approx(ref_loss, rel=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0, atol=1e-6, msg=f"{n} micro-batches: {name}")


def test_the_old_per_micro_batch_mean_would_differ():
    """Sanity of the test above: averaging each micro-batch's own mean weights tokens differently here."""
    ref_loss, _ = reference()
    model = build_model(MODEL, seed=1)
    b = uneven_batch()
    labels = b["labels"].masked_fill(~b["loss_mask"], IGNORE_INDEX)
    means = [F.cross_entropy(model(t).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
             for t, y in zip(b["tokens"].split(2), labels.split(2), strict=True)]
    assert abs(torch.stack(means).mean().item() - ref_loss) > 1e-3


def test_every_batch_key_reaches_the_loss_and_aux_enters_backward_only():
    seen = []

    class Probe(TokenCrossEntropy):
        def __call__(self, out, batch):
            seen.append(sorted(batch))
            result = super().__call__(out, batch)
            weight = out.logits.float().pow(2).mean() if out.logits is not None else out.hidden.pow(2).mean()
            return LossResult(result.total, aux=0.5 * weight, metrics={"units_seen": self.units(batch).float()})

    model = build_model(MODEL, seed=1)
    batch = {**uneven_batch(), "advantages": torch.arange(8.0)}
    mbs = [{k: v[i:i + 4] for k, v in batch.items()} for i in (0, 4)]
    result = train_step(model, mbs, ParallelDims(), Probe())
    assert seen == [["advantages", "labels", "loss_mask", "tokens"]] * 2
    ref_loss, _ = reference()
    assert result.loss.item() == pytest.approx(ref_loss, rel=1e-6)  # aux not in the reported loss
    assert result.metrics["units_seen"] == pytest.approx(1.0)  # a metric is a sum over units, normalised
    ev = eval_step(model, mbs, ParallelDims(), Probe())
    assert ev.loss.item() == pytest.approx(ref_loss, rel=1e-6)


def test_a_batch_with_no_unit_is_not_finite():
    model = build_model(MODEL, seed=1)
    b = uneven_batch()
    b["loss_mask"] = torch.zeros_like(b["loss_mask"])
    result = train_step(model, [b], ParallelDims())
    assert result.units == 0 and torch.isnan(result.loss)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
