"""`megapipe posttrain distill`: each loss against its formula computed directly, the memory rule (no whole
[tokens, vocab] fp32 tensor), teacher/student vocabulary checks, exact resume and lineage."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe.cli import main
from megapipe.errors import MegapipeError
from megapipe.posttrain.distill_losses import KDSpec, distill_fused, distill_logits
from tests.posttrain.conftest import write_model

N, H, HT, V = 40, 12, 20, 96

SPECS = [
    KDSpec("forward_kl", temperature=1.0),
    KDSpec("forward_kl", temperature=2.0, alpha=0.6),
    KDSpec("reverse_kl", temperature=1.5),
    KDSpec("jsd", temperature=1.0, beta=0.5),
    KDSpec("jsd", temperature=3.0, beta=0.1, alpha=0.3),
    KDSpec("jsd", beta=0.0),  # the ends are the two KLs
    KDSpec("jsd", beta=1.0),
    KDSpec("forward_kl", temperature=2.0, top_k=8),
    KDSpec("reverse_kl", top_k=5, alpha=0.5),
    KDSpec("jsd", beta=0.7, top_k=12),
]


def reference(zs: torch.Tensor, zt: torch.Tensor, labels, weights, spec: KDSpec) -> torch.Tensor:
    """The loss summed over tokens, written from the formulas with torch's own kl_div (fp64)."""
    zs, zt, T = zs.double(), zt.double(), spec.temperature
    us, ut = zs / T, zt / T
    if spec.top_k:
        idx = ut.topk(spec.top_k, dim=-1).indices
        us, ut = us.gather(-1, idx), ut.gather(-1, idx)
    ls, lt = F.log_softmax(us, -1), F.log_softmax(ut, -1)

    def kl(p_log, q_log):  # KL(p || q) per token
        return F.kl_div(q_log, p_log, reduction="none", log_target=True).sum(-1)

    b = spec.beta
    if spec.kind == "forward_kl" or (spec.kind == "jsd" and b == 0):
        d = kl(lt, ls)
    elif spec.kind == "reverse_kl" or (spec.kind == "jsd" and b == 1):
        d = kl(ls, lt)
    else:
        m = (b * lt.exp() + (1 - b) * ls.exp()).log()
        d = b * kl(lt, m) + (1 - b) * kl(ls, m)
    ce = F.cross_entropy(zs, labels, reduction="none")
    return ((spec.alpha * T * T * d + (1 - spec.alpha) * ce) * weights.double()).sum()


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.7).requires_grad_()
    th, tw = torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g) * 0.5
    labels = torch.randint(0, V, (N,), generator=g)
    weights = (torch.rand(N, generator=g) > 0.25).float()
    return h, w, th, tw, labels, weights


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-T{s.temperature}-a{s.alpha}-b{s.beta}-k{s.top_k}")
def test_each_loss_equals_its_formula_with_its_gradient(spec):
    h, w, th, tw, labels, weights = inputs()
    want = reference(h @ w.t(), th @ tw.t(), labels, weights, spec)
    gh, gw = torch.autograd.grad(want, (h, w))
    fused, _, _ = distill_fused(h, w, th, tw, labels, weights, spec, chunk=7)
    fh, fw = torch.autograd.grad(fused, (h, w))
    from_logits, _, _ = distill_logits(h @ w.t(), th, tw, labels, weights, spec, chunk=7)
    lh, lw = torch.autograd.grad(from_logits, (h, w))
    for got in (fused, from_logits):
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
    scale = max(gh.abs().max().item(), gw.abs().max().item())
    for a, b in ((fh, gh), (fw, gw), (lh, gh), (lw, gw)):
        assert (a.double() - b).abs().max().item() <= 1e-5 * scale


def test_kd_and_lm_parts_are_reported_apart():
    h, w, th, tw, labels, weights = inputs(1)
    spec = KDSpec("forward_kl", temperature=2.0, alpha=0.25)
    total, kd, ce = distill_fused(h, w, th, tw, labels, weights, spec)
    only_kd = reference(h @ w.t(), th @ tw.t(), labels, weights, KDSpec("forward_kl", 2.0, 1.0))
    only_ce = F.cross_entropy(h @ w.t(), labels, reduction="none") @ weights
    assert kd.item() == pytest.approx(only_kd.item(), rel=1e-5) and ce.item() == pytest.approx(only_ce.item(), rel=1e-5)
    assert total.item() == pytest.approx(0.25 * kd.item() + 0.75 * ce.item(), rel=1e-6)


class Allocations(TorchDispatchMode):
    """The byte sizes of the storages ops create (a result sharing an input's storage, a view or an in-place op,
    is no allocation)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def test_no_whole_tokens_by_vocab_fp32_tensor_is_made():
    """Fused path: no [tokens, vocab] tensor at all (teacher or student); logits path: only the gradient of the
    student's logits (which autograd needs whole), in the backward."""
    n, vocab, chunk = 256, 512, 32
    full = n * vocab * 4
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, 16, generator=g, requires_grad=True), torch.randn(vocab, 16, generator=g, requires_grad=True)
    th, tw = torch.randn(n, 24, generator=g), torch.randn(vocab, 24, generator=g)
    labels, weights = torch.randint(0, vocab, (n,), generator=g), torch.ones(n)
    spec = KDSpec("jsd", temperature=2.0, alpha=0.5, beta=0.5)
    with Allocations() as fused:
        distill_fused(h, w, th, tw, labels, weights, spec, chunk)[0].backward()
    assert max(fused.sizes) < full / 4, max(fused.sizes)
    logits = (h @ w.t()).detach().requires_grad_()
    with Allocations() as plain:
        loss = distill_logits(logits, th, tw, labels, weights, spec, chunk)[0]
        forward = list(plain.sizes)
        loss.backward()
    assert max(forward) < full / 4
    assert sum(s >= full for s in plain.sizes) == 1  # the logits' gradient


@pytest.fixture(scope="module")
def models(pretrain_data, tmp_path_factory):
    """(teacher, student) checkpoints on the Shakespeare tokenizer: a wider teacher, a narrower student."""
    _, tok = pretrain_data
    root = tmp_path_factory.mktemp("distill")
    teacher = write_model(root / "teacher", tok, seed=3, vocab_size=512, hidden_size=96, intermediate_size=192)
    student = write_model(root / "student", tok, seed=4, vocab_size=512, hidden_size=32, intermediate_size=64,
                          num_heads=2, num_kv_heads=1)
    return teacher, student


def distill_args(pretrain_data, teacher, student, run, *extra) -> list[str]:
    prefix, _ = pretrain_data
    return ["posttrain", "distill", "--teacher", str(teacher), "--student", str(student), "--data-path", prefix,
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--split", "90,10,0",
            "--lr", "1e-2", "--eval-iters", "1", "--log-interval", "1", "--save", str(run), "--quiet", *extra]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_distill_resumes_exactly_and_records_its_lineage(pretrain_data, models, tmp_path):
    teacher, student = models
    extra = ["--train-iters", "4", "--save-interval", "2", "--kd-loss", "jsd", "--kd-jsd-beta", "0.3", "--kd-top-k",
             "50", "--kd-alpha", "0.7", "--kd-temperature", "2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(distill_args(pretrain_data, teacher, student, whole, *extra)) == 0
    assert main(distill_args(pretrain_data, teacher, student, cut, *extra, "--exit-interval", "2")) == 0
    assert main(distill_args(pretrain_data, teacher, student, cut, *extra)) == 0
    train = [r for r in records(whole) if r["kind"] == "train"]
    assert [r for r in records(cut) if r["kind"] == "train"] == [
        {**r, "tokens_per_s": c["tokens_per_s"], "mfu": c["mfu"]} for r, c in
        zip(train, [r for r in records(cut) if r["kind"] == "train"], strict=True)]
    last = train[-1]
    assert last["loss"] == pytest.approx(0.7 * last["kd_loss"] + 0.3 * last["lm_loss"], rel=1e-5)
    m = json.loads((cut / "step_00000004" / "megapipe.json").read_text())
    assert m["stage"] == "distill" and m["distill"]["teacher"] == str(teacher)
    assert (m["distill"]["loss"], m["distill"]["jsd_beta"], m["distill"]["top_k"]) == ("jsd", 0.3, 50)
    from megapipe.checkpoint import lineage

    assert [(c["stage"], c["step"]) for c in lineage(cut / "step_00000004")] == [("distill", 4), ("distill", 2),
                                                                                ("init", 0)]


def test_the_teacher_must_share_the_students_vocabulary(pretrain_data, models, chat_tokenizer, tmp_path, capsys):
    teacher, student = models
    wide = write_model(tmp_path / "wide", pretrain_data[1], vocab_size=640)
    other = write_model(tmp_path / "other", chat_tokenizer, vocab_size=512)  # same size, another tokenizer
    for t, message in ((wide, f"teacher {wide} has vocab_size 640 but the student has 512"),
                       (other, f"teacher {other} and the student use different tokenizers")):
        code = main(distill_args(pretrain_data, t, student, tmp_path / "run", "--train-iters", "1"))
        assert code == MegapipeError.exit_code
        assert message in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("change, message", [
    ({"--teacher": None}, "distill.teacher (--teacher) is not set"),
    ({"--student": None}, "give the student: --student CKPT (its weights) or --student-model PRESET"),
    ({"--student-model": "tiny"}, "give the student: --student CKPT (its weights) or --student-model PRESET"),
    ({"--context-parallel-size": "2", "--nproc-per-node": "2"}, "with context parallelism (--context-parallel-size 2)"),
    ({"--kd-alpha": "1.5"}, "distill.alpha = 1.5 must be within [0, 1]"),
    ({"--kd-temperature": "0"}, "distill.temperature = 0.0 must be > 0"),
    ({"--kd-loss": "mse"}, "Invalid value for '--kd-loss'"),
    ({"--kd-top-k": "513"}, "distill.top_k (--kd-top-k) = 513 is more than the vocabulary (512 tokens)"),
])
def test_mistakes_are_one_clear_error(pretrain_data, models, tmp_path, capsys, change, message):
    args = distill_args(pretrain_data, *models, tmp_path / "run", "--train-iters", "1")
    for flag, value in change.items():
        if flag in args:
            i = args.index(flag)
            del args[i:i + 2]
        if value is not None:
            args += [flag, value]
    assert main(args) != 0
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "run").exists()


def test_kd_top_k_reaches_the_loss(pretrain_data, models, tmp_path):
    """Over the teacher's single most likely token both renormalised distributions are [1], so by its definition
    the top-1 divergence is 0 and the student does not move (the whole vocabulary's is not)."""
    from megapipe.checkpoint.load import load_model

    run = tmp_path / "run"
    assert main(distill_args(pretrain_data, *models, run, "--train-iters", "1", "--kd-top-k", "1", "--eval-iters",
                             "0")) == 0
    step = next(r for r in records(run) if r["kind"] == "train")
    assert step["kd_loss"] == 0.0 and step["loss"] == 0.0
    before, after = load_model(models[1]).model.state_dict(), load_model(run).model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_fresh_student_gets_the_teachers_tokenizer(pretrain_data, models, tmp_path):
    teacher, _ = models
    prefix, tok = pretrain_data
    run = tmp_path / "run"
    assert main(["posttrain", "distill", "--teacher", str(teacher), "--student-model", "tiny", "--set",
                 "model.num_layers=1", "--set", "model.hidden_size=32", "--set", "model.intermediate_size=64",
                 "--set", "model.num_heads=2", "--set", "model.num_kv_heads=1", "--data-path", prefix,
                 "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
                 "--split", "90,10,0", "--eval-iters", "0", "--save", str(run), "--quiet"]) == 0
    saved = run / "step_00000002"
    assert (saved / "tokenizer" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert json.loads((saved / "megapipe.json").read_text())["parent"] is None
    assert math.isfinite(records(run)[-1]["loss"])
