"""GRPO's formulas against direct computation: advantages for each reward scaling, dynamic sampling's degenerate
groups, the KL estimators (values and what they estimate), clipping, the chunked log-probs (values and gradients),
and the loss of each aggregation through the loop's global normalisation over several micro-batches."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.models import build_model
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.step import train_step
from megapipe.posttrain.rl.grpo import (
    EPS,
    GRPOLoss,
    GRPOSettings,
    clipped_surrogate,
    degenerate_groups,
    group_advantages,
    kl_estimate,
)
from megapipe.posttrain.rl.logprobs import logits_logprobs, token_logprobs

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.2, 0.9, -0.3, 0.0]]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_of_each_scaling(scale):
    got = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), scale)
    every = [r for g in REWARDS for r in g]
    for gi, group in enumerate(REWARDS):
        mean = statistics.fmean(group)
        std = {"group": statistics.stdev(group), "batch": statistics.stdev(every), "none": None}[scale]
        for i, r in enumerate(group):
            want = (r - mean) if std is None else (r - mean) / (std + EPS)
            assert got[gi, i].item() == pytest.approx(want, abs=1e-12)
    assert got[1].abs().max() == 0  # a group of equal rewards carries no signal, whatever the scaling


def test_batch_scaling_takes_the_std_of_the_batch_over_every_rank():
    """With data parallelism each rank holds some groups; the std is the whole batch's (centred, unbiased), its
    sums gathered over the ranks (here: the other rank's groups added by hand)."""
    mine, theirs = torch.tensor(REWARDS[:1], dtype=torch.float64) + 10, torch.tensor(REWARDS[1:], dtype=torch.float64)
    other = [float(theirs.numel()), float(theirs.sum()), float((theirs * theirs).sum())]
    got = group_advantages(mine, "batch", all_sum=lambda v: [a + b for a, b in zip(v, other, strict=True)])
    std = statistics.stdev([r + 10 for r in REWARDS[0]] + [r for g in REWARDS[1:] for r in g])
    assert got[0].tolist() == pytest.approx([(r - 0.5) / (std + EPS) for r in REWARDS[0]], abs=1e-12)


def test_dynamic_sampling_finds_the_groups_with_equal_rewards():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.3, 0.3, 0.30001]])
    assert degenerate_groups(r).tolist() == [True, True, False, False]


def test_kl_estimators_formulas_and_what_they_estimate():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    ref = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    logp, logr = p.log(), ref.log()
    # exact values on every token
    for t in range(5):
        a, b = logp[t].item(), logr[t].item()
        assert kl_estimate(logp[t], logr[t], "k1").item() == pytest.approx(a - b, abs=1e-6)
        assert kl_estimate(logp[t], logr[t], "k3").item() == pytest.approx(math.exp(b - a) - (b - a) - 1, abs=1e-6)
        assert kl_estimate(logp[t], logr[t], "k3").item() >= 0
    # both are unbiased estimates of KL(p || ref) from tokens sampled from p
    true_kl = float((p * (logp - logr)).sum())
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=g)
    for est in ("k1", "k3"):
        mean = kl_estimate(logp[tokens].double(), logr[tokens].double(), est).mean().item()
        assert mean == pytest.approx(true_kl, rel=0.02), est
    with pytest.raises(ValueError):
        kl_estimate(logp, logr, "k2")


def test_clipping_regions_values_and_gradients():
    """ratio e^(logp - old) against 1 -/+ clip, for positive and negative advantages; clipped tokens get no
    gradient (the min picks the constant clipped term)."""
    ratios = torch.tensor([0.5, 0.9, 1.0, 1.1, 1.5, 0.5, 0.9, 1.1, 1.5], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    old = torch.zeros_like(ratios)
    logp = ratios.log().requires_grad_()
    loss, low, high = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    want = [-min(r * a, min(max(r, 0.8), 1.28) * a) for r, a in zip(ratios.tolist(), adv.tolist(), strict=True)]
    assert loss.tolist() == pytest.approx(want)
    assert high.tolist() == [False, False, False, False, True, False, False, False, False]
    assert low.tolist() == [False, False, False, False, False, True, False, False, False]
    loss.sum().backward()
    clipped = (high | low).tolist()
    for i, c in enumerate(clipped):
        assert (logp.grad[i] == 0) == c, i
    # where unclipped, d(-rho A)/d logp = -rho A
    assert logp.grad[1].item() == pytest.approx(-0.9)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_token_logprobs_equal_the_full_log_softmax(temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 16, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 40, (13,), generator=g)
    upstream = torch.randn(13, generator=g, dtype=torch.float64)
    logp, ent = token_logprobs(hidden, weight, targets, temperature, chunk=4)  # 4 chunks, the last one short
    (logp.double() * upstream).sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full = (hidden @ weight.t() / temperature).log_softmax(-1)
    want = full.gather(1, targets[:, None])[:, 0]
    (want * upstream).sum().backward()
    torch.testing.assert_close(logp.double(), want.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ent.double(), -(full.exp() * full).sum(-1).detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(gh, hidden.grad, rtol=1e-5, atol=1e-6)  # the kernel computes in fp32
    torch.testing.assert_close(gw, weight.grad, rtol=1e-5, atol=1e-6)
    # the same from logits that exist already
    logits = (hidden @ weight.t()).detach().float().requires_grad_()
    lp2, ent2 = logits_logprobs(logits, targets, temperature, chunk=5)
    torch.testing.assert_close(lp2.double(), want.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent2.double(), ent.double(), rtol=0, atol=1e-4)


def test_chunked_logprobs_under_bf16_autocast_match_the_plain_bf16_path():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 32, generator=g)
    weight = torch.randn(50, 32, generator=g)
    targets = torch.randint(0, 50, (9,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = token_logprobs(hidden, weight, targets, 1.0, chunk=4)
        plain = torch.mm(hidden, weight.t()).float().log_softmax(-1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(logp, plain, rtol=0, atol=1e-5)


MODEL = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64)


def rollout_batch(seed: int = 0) -> dict:
    """8 rows of prompt + completion with very different completion lengths (one row not trained at all), old
    log-probs off the current ones (ratios on both sides of the clip range) and a reference."""
    g = torch.Generator().manual_seed(seed)
    rows, seq = 8, 14
    tokens = torch.randint(0, 64, (rows, seq), generator=g)
    labels = torch.roll(tokens, -1, 1)
    prompt = torch.tensor([3, 5, 2, 4, 6, 3, 2, 5])
    comp = torch.tensor([10, 1, 7, 0, 5, 8, 11, 3])
    pos = torch.arange(seq)[None]
    mask = (pos >= prompt[:, None] - 1) & (pos < (prompt + comp - 1)[:, None])
    return {
        "tokens": tokens, "labels": labels, "completion_mask": mask,
        "old_logprobs": -4.2 + 0.6 * torch.randn(rows, seq, generator=g),
        "ref_logprobs": -4.1 + 0.5 * torch.randn(rows, seq, generator=g),
        "advantages": torch.randn(rows, generator=g),
    }


def direct_loss(model, batch: dict, s: GRPOSettings) -> torch.Tensor:
    """The GRPO objective written out on the whole batch with full logits, in float64."""
    logp_all = (model(batch["tokens"]).double() / s.temperature).log_softmax(-1)
    logp = logp_all.gather(2, batch["labels"][..., None])[..., 0]
    mask = batch["completion_mask"]
    ratio = torch.exp(logp - batch["old_logprobs"].double())
    a = batch["advantages"].double()[:, None]
    per = -torch.minimum(ratio * a, ratio.clamp(1 - s.clip_low, 1 + s.clip_high) * a)
    if s.kl_coef:
        d = batch["ref_logprobs"].double() - logp
        kl = (logp - batch["ref_logprobs"].double()) if s.kl_estimator == "k1" else torch.exp(d) - d - 1
        per = per + s.kl_coef * kl
    per = per * mask
    lengths = mask.sum(1)
    has = lengths > 0
    if s.aggregation == "token-mean":
        return per.sum() / mask.sum()
    if s.aggregation == "seq-mean-token-sum":
        return per.sum(1)[has].sum() / has.sum()
    return (per.sum(1)[has] / lengths[has]).sum() / has.sum()


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("kl", [None, "k1", "k3"])
@pytest.mark.parametrize("fused", [True, False])
def test_grpo_loss_through_the_loop_equals_the_direct_objective(aggregation, kl, fused):
    """Two uneven micro-batches through the loop's train_step (global normalisation) give the direct objective's
    value and gradients, whether the loss gets hidden states (chunked) or logits."""
    s = GRPOSettings(clip_low=0.2, clip_high=0.28, kl_coef=0.05 if kl else 0.0, kl_estimator=kl or "k3",
                     aggregation=aggregation, temperature=0.9, chunk=5)
    batch = rollout_batch()
    ref_model = build_model(MODEL, seed=3)
    want = direct_loss(ref_model, batch, s)
    want.backward()
    model = build_model(MODEL, seed=3)
    mbs = [{k: v[i:i + 4] for k, v in batch.items()} for i in (0, 4)]
    loss = GRPOLoss(s)
    result = train_step(model, mbs, ParallelDims(), loss, fused=fused)
    units = int(batch["completion_mask"].sum()) if aggregation == "token-mean" else 7  # one row has no tokens
    assert result.units == units
    assert result.loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad.float(), rtol=1e-4, atol=1e-6, msg=name)
    assert 0 < result.metrics["clip_low"] + result.metrics["clip_high"] < 1
    assert result.metrics["entropy"] > 0


def _rows(seed: int = 0):
    """Rollout rows of three prompts (lengths 5, 1 and 3) with 3 completions each of uneven lengths, one of them
    not trained, and the raw log-probs of their tokens under MODEL (seed 3) computed row by row."""
    from megapipe.posttrain.rl.rollout import Row, Sample

    g = torch.Generator().manual_seed(seed)
    model = build_model(MODEL, seed=3)
    rows = []
    for gi, (p, lengths) in enumerate([(5, (4, 1, 6)), (1, (3, 5, 2)), (3, (2, 2, 7))]):
        prompt = torch.randint(0, 64, (p,), generator=g).tolist()
        for k, c in enumerate(lengths):
            ids = torch.randint(0, 64, (c,), generator=g).tolist()
            with torch.no_grad():
                lp = model(torch.tensor([prompt + ids])).log_softmax(-1)[0, p - 1:p - 1 + c]
            raw = lp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
            rows.append(Row(prompt, Sample(ids, raw, "", False), float(torch.randn((), generator=g)),
                            trained=(gi, k) != (2, 1), group=gi))
    return rows


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("fused", [True, False])
def test_shared_prompt_rows_train_like_one_row_per_completion(aggregation, fused):
    """A group packed as one row (its prompt once, each completion attending to it and to itself) gives the loss,
    units, metrics and gradients of one row per completion, on-policy (no old log-probs: ratio 1), and the mismatch
    measured in the training forward is round-off against the log-probs each completion has on its own."""
    from megapipe.posttrain.rl.grpo import MismatchMeter
    from megapipe.posttrain.rl.rollout import collate, collate_shared, split_rows

    s = GRPOSettings(aggregation=aggregation, temperature=0.9, chunk=5)
    rows = _rows()
    results = {}
    for name, pack in (("rows", collate), ("shared", collate_shared)):
        model = build_model(MODEL, seed=3)
        meter = MismatchMeter()
        mbs = [pack(chunk, 0) for chunk in split_rows(rows, 2)]
        result = train_step(model, mbs, ParallelDims(), GRPOLoss(s, meter), fused=fused)
        results[name] = (result, {n: p.grad for n, p in model.named_parameters()}, meter.sums, mbs)
    (want, want_grads, want_mm, row_mbs), (got, got_grads, got_mm, shared_mbs) = results["rows"], results["shared"]
    assert sum(mb["tokens"].numel() for mb in shared_mbs) < sum(mb["tokens"].numel() for mb in row_mbs)
    assert got.units == want.units == (8 if aggregation != "token-mean" else sum(
        len(r.sample.ids) for r in rows if r.trained))
    assert got.loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    for k in want.metrics:
        assert got.metrics[k] == pytest.approx(want.metrics[k], rel=1e-5, abs=1e-7), k
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-4, atol=1e-6, msg=n)
    tokens = sum(len(r.sample.ids) for r in rows if r.trained)  # split_rows leaves the untrained row out
    for mm in (want_mm, got_mm):
        assert mm[3] == tokens and mm[0] / tokens < 1e-6 and mm[1] < 1e-5 and abs(mm[2]) < 1e-10
