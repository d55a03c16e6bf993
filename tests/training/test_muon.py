"""Muon (--optimizer muon): one step against the published algorithm written out here, parameter routing, the
lr override on the schedule, exact resume through state_dict, and the refusals. Every layout equal to one process,
resume and resharding: tests/parallel/test_dist_layouts.py ("optim=muon" cases)."""

import inspect
import math

import pytest
import torch
from torch import nn

from megapipe.config import MUON_NS_COEFFICIENTS, ModelConfig, OptimConfig, load_config
from megapipe.errors import ConfigError
from megapipe.models import build_model
from megapipe.models.moe import GroupedExperts
from megapipe.training.optim import Muon, build_optimizer, describe_optimizer, newton_schulz, set_lr
from tests.dist import parallel_cases as pc

LR, WD, MU = 0.01, 0.1, 0.95


class Toy(nn.Module):
    """A tall, a wide and a square matrix, 3-D experts, and what AdamW takes: embedding, norm, biases, output."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 6)
        self.tall = nn.Linear(6, 14)  # weight [14, 6]
        self.wide = nn.Linear(14, 6)  # weight [6, 14]
        self.square = nn.Linear(6, 6, bias=False)
        self.experts = GroupedExperts(3, 6, 4)  # w1, w3 [3, 4, 6], w2 [3, 6, 4]
        self.norm = nn.Parameter(torch.ones(6))
        self.output = nn.Linear(6, 10, bias=False)
        g = torch.Generator().manual_seed(0)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.3


def published_ns5(m: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's Newton-Schulz on one matrix: X = G / ||G||_F (transposed when tall), then
    X <- a X + (b X X^T + c (X X^T)^2) X."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def published_step(w, grad, buf, nesterov=True):
    """One Muon step on a matrix [A, B] (Moonlight's scale, decoupled weight decay), momentum in torch's EMA form."""
    buf = MU * buf + (1 - MU) * grad
    u = (1 - MU) * grad + MU * buf if nesterov else buf
    o = published_ns5(u)
    rows, cols = w.shape
    return w * (1 - LR * WD) - LR * 0.2 * math.sqrt(max(rows, cols)) * o, buf


# the tiny preset's groups as the run prints them: 4 layers of 7 linears to Muon (q 256x256, k and v 128x256, o
# 256x256, gate / up / down 688x256: 724,992 a layer); to AdamW its tied embedding (512x256, decayed) and its 9 norms
# (2 a layer and the final one, 256 each, not decayed)
GROUPS_MUON = ("muon: 28 tensors, 2,899,968 parameters, lr 20 x --lr, weight decay 0.1, momentum 0.95, 4 "
               "Newton-Schulz steps (3.4, -4.7, 2), scale original x 0.5")
GROUPS_DECAY = "adamw: 1 tensors, 131,072 parameters, weight decay 0.1"
GROUPS_NO_DECAY = "adamw: 9 tensors, 2,304 parameters, weight decay 0"


def grads_for(model, step: int):
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("nesterov", [True, False])
def test_two_steps_equal_the_published_algorithm_on_tall_wide_square_and_expert_matrices(nesterov):
    model = Toy()
    cfg = OptimConfig(optimizer="muon", weight_decay=WD, muon_nesterov=nesterov)
    opt = build_optimizer(model, cfg, LR)
    ref = Toy()
    ref_adamw = torch.optim.AdamW([{"params": [ref.tok_embeddings.weight, ref.output.weight], "weight_decay": WD},
                                   {"params": [ref.norm, ref.tall.bias, ref.wide.bias], "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True)
    matrices = ["tall.weight", "wide.weight", "square.weight"]
    experts = ["experts.w1", "experts.w2", "experts.w3"]
    want = {n: p.detach().double().clone() for n, p in ref.named_parameters()}
    bufs = {n: torch.zeros_like(w) for n, w in want.items()}
    for step in range(2):
        grads_for(model, step)
        grads_for(ref, step)
        opt.step()
        ref_adamw.step()
        for n in matrices:
            want[n], bufs[n] = published_step(want[n], dict(ref.named_parameters())[n].grad.double(), bufs[n],
                                               nesterov)
        for n in experts:  # each expert its own matrix
            g = dict(ref.named_parameters())[n].grad.double()
            for e in range(3):
                w, b = published_step(want[n][e], g[e], bufs[n][e], nesterov)
                want[n][e], bufs[n][e] = w, b
    got = dict(model.named_parameters())
    for n in matrices + experts:
        torch.testing.assert_close(got[n].double(), want[n], rtol=0, atol=1e-6, msg=n)
        assert (got[n].double() - dict(Toy().named_parameters())[n].double()).abs().max() > 1e-3  # it moved
    for n in ["tok_embeddings.weight", "output.weight", "norm", "tall.bias", "wide.bias"]:  # AdamW's, exactly
        torch.testing.assert_close(got[n], dict(ref.named_parameters())[n], rtol=0, atol=0, msg=n)


def test_newton_schulz_makes_singular_values_near_one_and_agrees_with_torch_muon():
    """NS5 leaves every singular value in Keller Jordan's ~[0.5, 1.5] band; one step of ours is torch.optim.Muon's
    (adjust_lr_fn="match_rms_adamw") up to torch's bf16 iteration, and our defaults are torch's."""
    g = torch.randn(32, 12, generator=torch.Generator().manual_seed(1))
    s = torch.linalg.svdvals(newton_schulz(g, MUON_NS_COEFFICIENTS, 5))
    assert 0.5 < s.min() and s.max() < 1.5
    w = nn.Linear(12, 32, bias=False)
    w.weight.grad = g.clone()
    ref = nn.Linear(12, 32, bias=False)
    ref.weight.data.copy_(w.weight.data)
    ref.weight.grad = g.clone()
    before = w.weight.detach().clone()
    Muon([{"params": [w.weight], "muon": True, "lr": LR, "lr_scale": 1.0, "weight_decay": WD, "momentum": MU,
           "nesterov": True, "ns_steps": 5, "ns_coefficients": MUON_NS_COEFFICIENTS, "scale": "match_rms_adamw"}],
         lr=LR).step()
    torch.optim.Muon([ref.weight], lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw").step()
    ours, theirs = w.weight.detach() - before, ref.weight.detach() - before
    assert ((ours - theirs).norm() / theirs.norm()).item() < 2e-2
    defaults = inspect.signature(torch.optim.Muon).parameters
    o = OptimConfig()
    assert tuple(o.muon_ns_coefficients) == defaults["ns_coefficients"].default
    assert (o.muon_ns_steps, o.muon_momentum, o.muon_nesterov) == (
        defaults["ns_steps"].default, defaults["momentum"].default, defaults["nesterov"].default)


def routed(model_name: str) -> tuple[set, set]:
    model = build_model(ModelConfig(**pc.MODELS[model_name]), device="meta")
    opt = build_optimizer(model, OptimConfig(optimizer="muon"), 1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g.get("muon") for p in g["params"]}
    adamw = {names[id(p)] for g in opt.param_groups if not g.get("muon") for p in g["params"]}
    assert not muon & adamw and len(muon) + len(adamw) == len(names)
    return muon, adamw


def test_routing_matrices_to_muon_everything_else_to_adamw():
    muon, adamw = routed("moe")
    assert {"layers.0.attention.wq.weight", "layers.0.feed_forward.w2.weight", "layers.1.moe.experts.w1",
            "layers.1.moe.shared_experts.w1.weight"} <= muon
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.1.moe.gate.weight",
            "layers.1.moe.shared_gate.weight", "layers.0.attention_norm.weight"} <= adamw
    muon, adamw = routed("hybrid")  # Mamba: projections to Muon; A_log, D, dt_bias, conv weights and biases AdamW
    assert {"layers.0.mixer.in_x.weight", "layers.0.mixer.out_proj.weight"} <= muon
    assert {"layers.0.mixer.A_log", "layers.0.mixer.D", "layers.0.mixer.dt_bias", "layers.0.mixer.conv_x.weight",
            "layers.0.mixer.conv_x.bias", "layers.0.mixer.norm.weight"} <= adamw
    muon, adamw = routed("tied")  # the tied output is the embedding: AdamW
    assert "tok_embeddings.weight" in adamw and all(n.startswith("layers.") for n in muon)
    muon, adamw = routed("gpt2")
    assert "pos_embeddings.weight" in adamw and "layers.0.attention.wq.bias" in adamw


def test_groups_settings_lr_override_and_summary():
    model = build_model(ModelConfig(**pc.MODELS["base"]), seed=0)
    cfg = OptimConfig(optimizer="muon", weight_decay=0.1, muon_lr=0.02, muon_weight_decay=0.05)
    opt = build_optimizer(model, cfg, 1e-3)
    muon, decay, no_decay = opt.param_groups
    assert muon["muon"] and len(muon["params"]) == 4 * 7
    assert (muon["weight_decay"], decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.1, 0.0)
    assert len(decay["params"]) == 2 and len(no_decay["params"]) == 9  # embedding + output; norms
    set_lr(opt, 5e-4)  # the schedule's lr: Muon's follows it at --muon-lr / --lr
    assert muon["lr"] == pytest.approx(1e-2) and decay["lr"] == no_decay["lr"] == 5e-4
    lines = describe_optimizer(opt)
    assert lines[0].startswith("muon: 28 tensors, ") and "lr 20 x --lr, weight decay 0.05, momentum 0.95 nesterov" in lines[0]
    assert lines[1].startswith("adamw: 2 tensors, 8,192 parameters, weight decay 0.1")
    plain = build_optimizer(model, OptimConfig(weight_decay=0.1), 1e-3)
    assert type(plain) is torch.optim.AdamW and describe_optimizer(plain)[0].startswith("adamw: 30 tensors")


def test_resume_from_state_dict_is_exact():
    def run(steps, state=None):
        model = build_model(ModelConfig(**pc.MODELS["moe"]), seed=0)
        opt = build_optimizer(model, OptimConfig(optimizer="muon", weight_decay=0.1), 1e-2)
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        for step in steps:
            grads_for(model, step)
            opt.step()
        return model, opt

    full, _ = run(range(3))
    half, opt = run(range(2))
    bufs = [s for s in opt.state.values() if "momentum_buffer" in s]
    assert bufs and all("exp_avg" not in s for s in bufs)
    resumed, _ = run([2], (half.state_dict(), opt.state_dict()))
    for (n, a), b in zip(full.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("override, culprit", [
    ({"optim.muon_ns_steps": 0}, "optim.muon_ns_steps (--muon-ns-steps) = 0 must be >= 1"),
    ({"optim.muon_momentum": 1.0}, "optim.muon_momentum (--muon-momentum) = 1.0 must be within [0, 1)"),
    ({"optim.muon_momentum": -0.1}, "optim.muon_momentum (--muon-momentum) = -0.1 must be within [0, 1)"),
    ({"optim.muon_ns_coefficients": [3.4, -4.7]}, "must be three numbers a b c"),
    ({"optim.muon_lr": -1.0}, "optim.muon_lr (--muon-lr) = -1.0 must be >= 0"),
    ({"optim.muon_scale": "shape"}, "optim.muon_scale = 'shape' is not valid: expected one of "
                                    "'match_rms_adamw', 'original', 'spectral', 'unit_rms_norm'"),
    ({"optim.muon_extra_scale_factor": 0.0}, "optim.muon_extra_scale_factor (--muon-extra-scale-factor) = 0.0 must "
                                             "be > 0"),
    ({"optim.muon_tp_mode": "blockwise"}, "optim.muon_tp_mode (--muon-tp-mode) = 'blockwise' orthogonalises each "
                                          "tensor-parallel shard on its own, which megapipe does not"),
    ({"optim.muon_fp32_matmul_prec": "medium"}, "optim.muon_fp32_matmul_prec (--muon-fp32-matmul-prec) = 'medium' "
                                                "would run Newton-Schulz's matmuls below fp32"),
    ({"optim.muon_ns_stpes": 3}, "muon_ns_stpes"),
])
def test_bad_muon_settings_are_refused_in_one_sentence(override, culprit):
    with pytest.raises(ConfigError) as e:
        load_config(overrides={"optim.optimizer": "muon", **override})
    assert culprit in str(e.value) and "\n" not in str(e.value)


def test_update_scales_megatrons_modes_too():
    """Megatron's --muon-scale-mode rules on a 32 x 8 matrix: spectral sqrt(max(A, B)), unit_rms_norm sqrt(A/B),
    shape_scaling (our original) sqrt(max(1, A/B)); match_rms_adamw is spectral x 0.2, and a step with
    --muon-extra-scale-factor 0.2 on spectral is match_rms_adamw's."""
    from megapipe.training.optim import update_scale

    shape = torch.Size([32, 8])
    assert update_scale("spectral", shape) == pytest.approx(32**0.5)
    assert update_scale("unit_rms_norm", shape) == pytest.approx(2.0)
    assert update_scale("unit_rms_norm", torch.Size([8, 32])) == pytest.approx(0.5)
    assert update_scale("original", shape) == pytest.approx(2.0) and update_scale("original", shape[::-1]) == 1.0
    assert update_scale("match_rms_adamw", shape) == pytest.approx(0.2 * 32**0.5)
    moved = []
    for scale, extra in (("match_rms_adamw", 1.0), ("spectral", 0.2)):
        model = Toy()
        grads_for(model, 0)
        cfg = OptimConfig(optimizer="muon", muon_scale=scale, muon_extra_scale_factor=extra)
        build_optimizer(model, cfg, LR).step()
        moved.append(model.tall.weight.detach().clone())
    torch.testing.assert_close(moved[0], moved[1], rtol=1e-7, atol=1e-9)


def test_muon_settings_without_muon_are_refused():
    with pytest.raises(ConfigError, match=r"optim.muon_lr \(--muon-lr\) = 0.02 applies to --optimizer muon only, "
                                          r"not optim.optimizer = 'adamw'"):
        load_config(overrides={"optim.muon_lr": 0.02})


def test_pretrain_with_muon_flags_megatron_spellings_too(pretrain_data, tmp_path, one_thread, capsys):
    """`megapipe pretrain --optimizer dist_muon` (Megatron's name) end to end: the flags (Megatron's spellings for
    nesterov, the step count, the scale mode and factor, the TP mode and matmul precision) land in the checkpoint's
    config, the run prints its groups (Muon's settings, AdamW's decayed and undecayed), and its optimizer state holds
    Muon's momentum beside AdamW's moments."""
    import json

    from megapipe.checkpoint import list_checkpoints
    from megapipe.cli import main

    prefix, tok = pretrain_data
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["pretrain", "--data-path", str(prefix), "--tokenizer", str(tok), "--model", "tiny", "--seq-length",
                 "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--eval-iters",
                 "0", "--lr", "1e-3", "--optimizer", "dist_muon", "--muon-num-ns-steps", "4", "--no-muon-use-nesterov",
                 "--muon-ns-coefficients", "3.4", "-4.7", "2.0", "--muon-lr", "2e-2", "--muon-scale-mode",
                 "shape_scaling", "--muon-extra-scale-factor", "0.5", "--muon-tp-mode", "distributed",
                 "--muon-fp32-matmul-prec", "high", "--weight-decay", "0.1", "--save", str(run)]) == 0
    printed = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    ckpt = list_checkpoints(run)[-1][1]
    optim = json.loads((ckpt / "megapipe.json").read_text())["config"]["optim"]
    assert optim["optimizer"] == "muon" and optim["muon_ns_steps"] == 4 and optim["muon_nesterov"] is False
    assert optim["muon_ns_coefficients"] == [3.4, -4.7, 2.0] and optim["muon_lr"] == 2e-2
    assert (optim["muon_scale"], optim["muon_extra_scale_factor"]) == ("original", 0.5)
    assert (optim["muon_tp_mode"], optim["muon_fp32_matmul_prec"]) == ("distributed", "high")
    summary = [line for line in printed if line.startswith(("muon:", "adamw:"))]
    assert summary == [GROUPS_MUON, GROUPS_DECAY, GROUPS_NO_DECAY], printed
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt / "optim")).read_metadata().state_dict_metadata
    assert "state.layers.0.attention.wq.weight.momentum_buffer" in keys
    assert "state.tok_embeddings.weight.exp_avg" in keys and "state.layers.0.attention.wq.weight.exp_avg" not in keys
