"""The MoE layer on one process: routing against transformers' routers (Mixtral, Qwen2/3-MoE, DeepSeek-V3), the
balancing losses against transformers' / Megatron's formulas and their gradients, capacity dropping, the grouped
GEMM against the expert loop (zero tokens included), layer patterns, the expert bias and the config refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapipe.config import ConfigError, ModelConfig, load_config
from megapipe.models import build_model
from megapipe.models.moe import GroupedExperts, MoE, MoEBlock, capacity_keep, expert_loop, moe_layers, route
from megapipe.parallel.ep import moe_step_stats, update_expert_biases

E, H = 8, 32


def moe_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=H, intermediate_size=48, num_layers=2, num_heads=4, num_experts=E,
                moe_router_topk=2, moe_ffn_hidden_size=16)
    return ModelConfig(**{**base, **kw})


def logits_and_states(t: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=g), torch.randn(E, H, generator=g) * 0.5


def same_routing(idx, w, ref_idx, ref_w) -> None:
    """Equal up to the order of the k choices (some routers do not sort them)."""
    a, b = idx.sort(dim=-1), ref_idx.sort(dim=-1)
    assert torch.equal(a.values, b.values)
    torch.testing.assert_close(w.gather(1, a.indices), ref_w.gather(1, b.indices), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_softmax_routing_matches_transformers(family):
    import transformers

    x, weight = logits_and_states()
    if family == "mixtral":
        hf_cfg = transformers.MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2)
        router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(hf_cfg)
        ours = moe_cfg()  # top-k of the logits, softmax over the k (Megatron's default) == Mixtral's renormalised top-k
    else:
        norm = family == "qwen3_moe"
        cls = transformers.Qwen3MoeConfig if norm else transformers.Qwen2MoeConfig
        mod = transformers.models.qwen3_moe.modeling_qwen3_moe if norm else transformers.models.qwen2_moe.modeling_qwen2_moe
        hf_cfg = cls(hidden_size=H, num_experts=E, num_experts_per_tok=2, norm_topk_prob=norm)
        router = (mod.Qwen3MoeTopKRouter if norm else mod.Qwen2MoeTopKRouter)(hf_cfg)
        ours = moe_cfg(moe_router_pre_softmax=True, moe_router_norm_topk_prob=norm)
    with torch.no_grad():
        router.weight.copy_(weight)
        _, ref_w, ref_idx = router(x)
    idx, w, _ = route(x @ weight.t(), ours)
    same_routing(idx, w, ref_idx, ref_w)
    if family == "qwen2_moe":
        assert (w.sum(-1) < 0.9).any()  # not renormalised


def test_sigmoid_group_limited_biased_routing_matches_deepseek_v3():
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = transformers.DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(hf_cfg)
    x, weight = logits_and_states(seed=3)
    bias = torch.randn(E) * 0.3
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
        _, ref_w, ref_idx = router(x)
    cfg = moe_cfg(moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                  moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5)
    idx, w, _ = route(x @ weight.t(), cfg, bias)
    same_routing(idx, w, ref_idx, ref_w)
    # the bias changes the choice, not the weights: the same experts without the bias get the same weights
    plain_idx, _, _ = route(x @ weight.t(), cfg)
    assert not torch.equal(plain_idx.sort(-1).values, idx.sort(-1).values)
    groups = idx // (E // 4)
    assert all(len(set(row.tolist())) <= 2 for row in groups)  # at most topk_group groups per token


def run_moe(cfg: ModelConfig, x: torch.Tensor, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg)
    moe.init_weights(0.5, 0.5)
    torch.nn.init.normal_(moe.gate.weight, 0.0, 0.5)
    moe(x)
    return moe


def test_aux_loss_matches_transformers_and_z_loss_the_formula():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = moe_cfg(moe_aux_loss_coeff=0.3, moe_z_loss_coeff=0.02)
    x = torch.randn(2, 20, H, generator=torch.Generator().manual_seed(1))
    moe = run_moe(cfg, x)
    aux, z = moe.stats[0].item(), moe.stats[1].item()
    logits = x.reshape(-1, H) @ moe.gate.weight.detach().t()
    # transformers' loss is k times Megatron's per-layer definition
    want = 0.3 * load_balancing_loss_func((logits,), E, 2).item() / 2
    assert abs(aux - want) <= 1e-6 * want
    assert abs(z - 0.02 * torch.logsumexp(logits, -1).square().mean().item()) <= 1e-7
    assert moe.stats[4].item() == 1 and moe.tokens_per_expert.sum().item() == 40 * 2


def test_sequence_aux_loss_is_per_sequence():
    cfg = moe_cfg(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1.0)
    x = torch.randn(4, 10, H, generator=torch.Generator().manual_seed(2))
    full = run_moe(cfg, x).stats[0].item()
    halves = [run_moe(cfg, part).stats[0].item() for part in (x[:2], x[2:])]
    assert abs(full - sum(halves) / 2) <= 1e-6
    moe = run_moe(cfg, x[:1])
    logits = x[0] @ moe.gate.weight.detach().t()
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(logits.topk(2, -1).indices.flatten(), minlength=E).float()
    want = (counts * E / (10 * 2) * probs.mean(0)).sum().item()  # Megatron's sequence_load_balancing_loss_func
    assert abs(moe.stats[0].item() - want) <= 1e-6
    assert abs(run_moe(moe_cfg(moe_aux_loss_coeff=1.0), x).stats[0].item() - full) > 1e-4  # not the batch loss


def test_balancing_losses_reach_backward_with_their_scale_only():
    """The layer's output is unchanged; backward gives the router scale * d(aux + z)/d(router) besides the output's
    own gradient (here zero, so only the balancing losses' part is left)."""
    cfg = moe_cfg(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1)
    x = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(4))
    moe = run_moe(cfg, x)
    plain = MoE(dataclasses.replace(cfg, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None))
    plain.load_state_dict(moe.state_dict())
    moe.aux_loss_scale = 0.25
    out = moe(x)
    assert torch.equal(out, plain(x))
    (out * 0).sum().backward()
    logits = x.reshape(-1, H) @ moe.gate.weight.t()
    idx, _, scores = route(logits, cfg)
    counts = torch.bincount(idx.flatten(), minlength=E).float()
    t = logits.shape[0]
    losses = 0.5 * E / (2 * t * t) * (counts * scores.sum(0)).sum() + 0.1 * torch.logsumexp(logits, -1).square().mean()
    (want,) = torch.autograd.grad(0.25 * losses, moe.gate.weight)
    torch.testing.assert_close(moe.gate.weight.grad, want, rtol=1e-5, atol=1e-9)
    assert not moe.experts.w1.grad.any()  # the experts are not in the balancing losses


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_what_megatron_drops(policy):
    g = torch.Generator().manual_seed(5)
    t, k, factor = 30, 2, 0.6
    weights = torch.rand(t, k, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    keep = capacity_keep(idx, weights, E, factor, policy)
    capacity = -(-t * k * factor // E)
    for e in range(E):
        rows, cols = (idx == e).nonzero(as_tuple=True)
        order = weights[rows, cols].argsort(descending=True) if policy == "probs" else torch.arange(len(rows))
        want = torch.zeros(len(rows), dtype=torch.bool)
        want[order[: int(capacity)]] = True
        assert torch.equal(keep[rows, cols], want), e
    cfg = moe_cfg(moe_expert_capacity_factor=factor, moe_token_drop_policy=policy)
    moe = run_moe(cfg, torch.randn(1, t, H, generator=g))
    dropped, assigned = moe.stats[2].item(), moe.stats[3].item()
    assert assigned == t * k and 0 < dropped < assigned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_expert_loop(dtype):
    g = torch.Generator().manual_seed(6)
    experts = GroupedExperts(E, H, 16).to(dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, 0.0, 0.3, generator=g)
    counts = torch.tensor([5, 0, 7, 0, 0, 9, 1, 3])  # experts without tokens
    x = torch.randn(int(counts.sum()), H, generator=g, dtype=dtype, requires_grad=True)
    y = experts(x, counts)
    grads = torch.autograd.grad(y.square().sum(), [x, *experts.parameters()])
    ref = expert_loop(x, counts, experts.w1, experts.w2, experts.w3)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *experts.parameters()])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_no_tokens_at_all_still_gives_every_expert_a_gradient():
    """What an expert-parallel rank that receives nothing runs: no crash, zero (not missing) gradients."""
    experts = GroupedExperts(E, H, 16)
    for w in experts.parameters():
        torch.nn.init.normal_(w)
    x = torch.zeros(0, H, requires_grad=True)
    y = experts(x, torch.zeros(E, dtype=torch.long))
    assert y.shape == (0, H)
    y.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in experts.parameters())


def test_layer_patterns():
    assert moe_cfg(num_layers=6, moe_layer_freq=2).moe_layers == [0, 2, 4]
    assert moe_cfg(num_layers=4, moe_layer_freq=[0, 1, 1, 0]).moe_layers == [1, 2]
    assert moe_cfg(num_layers=5, moe_first_k_dense_replace=2).moe_layers == [2, 3, 4]
    cfg = load_config(None, {"model.num_layers": 8, "model.num_experts": 4, "model.moe_layer_freq": 1})
    assert cfg.model.moe_layers == list(range(8))
    model = build_model(moe_cfg(num_layers=4, moe_layer_freq=[1, 0, 0, 1]), device="meta")
    assert [type(b).__name__ for b in model.layers.values()] == ["MoEBlock", "TransformerBlock",
                                                                  "TransformerBlock", "MoEBlock"]
    assert [i for i, _ in moe_layers(model)] == [0, 3]


def test_layer_freq_flag_parses_megatron_expressions():
    from megapipe.config import _layer_pattern

    assert _layer_pattern("([0]*1+[1]*3)*2") == [0, 1, 1, 1] * 2
    assert _layer_pattern("1,0,1,1") == [1, 0, 1, 1] and _layer_pattern("[1,0]") == [1, 0]
    assert _layer_pattern("3") == 3
    for bad in ("__import__('os')", "[2, 0]", "[1]*x", "1.5"):
        with pytest.raises(ValueError):
            _layer_pattern(bad)


@pytest.mark.parametrize("overrides, words", [
    ({"model.moe_router_topk": 9}, "model.moe_router_topk = 9 must be within [1, model.num_experts = 8]"),
    ({"model.moe_layer_freq": [1, 0]}, "must hold one 0 or 1 per layer (model.num_layers = 4)"),
    ({"model.moe_layer_freq": [0, 0, 0, 0]}, "no layer is an MoE layer"),
    ({"model.moe_router_num_groups": 3, "model.moe_router_group_topk": 1}, "must divide model.num_experts = 8"),
    ({"model.moe_router_num_groups": 4}, "go together"),
    ({"model.moe_router_num_groups": 4, "model.moe_router_group_topk": 1, "model.moe_router_topk": 4},
     "at most 2 experts (one group's size) per group"),
    ({"model.activation": "gelu_tanh"}, "MoE experts are SwiGLU"),
    ({"model.moe_expert_capacity_factor": 0}, "model.moe_expert_capacity_factor = 0.0 must be > 0"),
    ({"model.num_experts": -1}, "model.num_experts = -1 must be >= 0"),
])
def test_bad_moe_configs_are_refused(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, {"model.num_layers": 4, "model.num_experts": 8, **overrides})
    assert words in str(e.value)


def test_expert_bias_update_and_step_metrics():
    """One process: sign rule from the step's tokens per expert, metrics as ratios, statistics reset after."""
    cfg = moe_cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=0.01, moe_aux_loss_coeff=0.1)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    model(tokens).float().logsumexp(-1).mean().backward()
    metrics, loads = moe_step_stats(model, None)
    assert set(loads) == {0, 1} and all(load.sum().item() == 4 * 16 * 2 for load in loads.values())
    load = loads[0]
    assert metrics["moe/L0/load_max_over_mean"] == pytest.approx((load.max() / load.mean()).item())
    assert metrics["moe/aux_loss"] == pytest.approx(metrics["moe/L0/aux_loss"] + metrics["moe/L1/aux_loss"])
    assert metrics["moe/dropped_fraction"] == 0.0
    update_expert_biases(model, loads)
    bias = model.layers["0"].moe.expert_bias
    assert torch.equal(bias, 0.01 * torch.sign(load.mean() - load).float())
    assert not model.layers["0"].moe.stats.any()  # reset for the next step
    assert "layers.0.moe.expert_bias" in model.state_dict()  # checkpointed


def test_recompute_counts_alike():
    """Full recompute runs each MoE forward twice: gradients, reported metrics and the bias update are the same."""
    from megapipe.parallel.recompute import apply_recompute

    cfg = moe_cfg(moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for mode in ("none", "full"):
        model = build_model(cfg, seed=0)
        apply_recompute(model, mode)
        model(tokens).float().logsumexp(-1).mean().backward()
        metrics, loads = moe_step_stats(model, None)
        update_expert_biases(model, loads)
        results.append((metrics, [p.grad for p in model.parameters()], model.layers["1"].moe.expert_bias.clone()))
    (m0, g0, b0), (m1, g1, b1) = results
    assert m0 == pytest.approx(m1, rel=1e-6) and torch.equal(b0, b1)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(g0, g1, strict=True))


def test_moe_block_keeps_the_dense_attention():
    block = MoEBlock(moe_cfg(), 0)
    assert sorted(n for n, _ in block.named_children()) == ["attention", "attention_norm", "ffn_norm", "moe"]
