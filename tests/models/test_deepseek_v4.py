"""DeepSeek-V4's model (megapipe.models.compressed_attention, megapipe.models.hyper_connections): the presets count
what transformers' DeepseekV4ForCausalLM counts for the published configs (meta device), the hyper-connections' mix
is doubly stochastic, hash routing follows its table, a training step reaches every weight but the indexer's, and
the config refuses what it cannot build. Logit parity with transformers: tests/checkpoint/test_hf_deepseek_v4.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megapipe.checkpoint.hf import adapter_for_arch
from megapipe.config import ModelConfig, from_dict, load_config
from megapipe.errors import ConfigError
from megapipe.models import build_model
from megapipe.models.hyper_connections import HyperConnection
from megapipe.parallel.plan import param_counts


def tiny(**fields) -> ModelConfig:
    return from_dict(ModelConfig, {"preset": "deepseek-v4-tiny", "vocab_size": 256, **fields})


@pytest.mark.parametrize("preset, published", [("deepseek-v4-flash", (284e9, 13e9)),
                                               ("deepseek-v4-pro", (1.6e12, 49e9))])
def test_preset_counts_equal_transformers_on_meta(preset, published):
    import transformers

    cfg = from_dict(ModelConfig, {"preset": preset})
    hf_cfg = adapter_for_arch("deepseek_v4").hf_config(cfg)
    with torch.device("meta"):
        hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**hf_cfg))
    total = sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    active = total - experts * (1 - cfg.moe_router_topk / cfg.num_experts)
    counts = param_counts(cfg)
    assert abs(counts.total / total - 1) < 1e-5 and abs(counts.active / active - 1) < 1e-5
    assert abs(counts.total / published[0] - 1) < 0.02 and abs(counts.active / published[1] - 1) < 0.07
    # the published MTP layer, counted apart: a sliding-window, score-routed block (transformers' decoder layer of
    # that kind) with its e / h projections, three norms and its hyper-connection head
    assert cfg.mtp_depth == 1 == hf_cfg["num_nextn_predict_layers"]
    one = {**hf_cfg, "num_hidden_layers": 1, "layer_types": ["sliding_attention"], "mlp_layer_types": ["moe"]}
    with torch.device("meta"):
        layer = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**one)).model.layers[0]
    h, n = cfg.hidden_size, cfg.hc_mult
    assert counts.mtp == sum(p.numel() for p in layer.parameters()) + 2 * h * h + 3 * h + n * n * h + n + 1


def test_presets_default_to_muon():
    assert load_config(overrides={"model.preset": "deepseek-v4-tiny"}).optim.optimizer == "muon"
    chosen = load_config(overrides={"model.preset": "deepseek-v4-tiny", "optim.optimizer": "adamw"})
    assert chosen.optim.optimizer == "adamw"


def test_hyper_connection_mix_is_doubly_stochastic():
    hc = HyperConnection(tiny())
    hc.init_weights(0.02)
    streams = torch.randn(2, 5, 4, 128)
    post, comb, collapsed = hc(streams)
    assert collapsed.shape == (2, 5, 128) and post.shape == (2, 5, 4) and bool((post <= 2).all())
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(2, 5, 4), atol=1e-4, rtol=0)


def test_training_step_reaches_every_weight_but_the_indexers():
    cfg = tiny()
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    missing = {n for n, p in model.named_parameters() if p.grad is None}
    # the indexer only chooses entries (top-k): frozen; layer 0's hash-routed experts are still weighted by the router
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert missing == frozen and frozen and all(".indexer." in n for n in frozen)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    table = model.layers["0"].moe.tid2eid
    assert table.shape == (256, 2) and bool((table[:, 0] != table[:, 1]).all())


def test_sequence_shorter_than_a_block_and_last_only():
    model = build_model(tiny(), seed=0).eval()
    tokens = torch.randint(0, 256, (1, 3))
    with torch.no_grad():
        full, last = model(tokens), model(tokens, last_only=True)
    torch.testing.assert_close(last, full[:, -1:])


@pytest.mark.parametrize("fields, culprit", [
    ({"attention_layer_types": ["sliding_attention"]}, "model.attention_layer_types"),
    ({"o_groups": 3}, "model.o_groups"),
    ({"moe_hash_layers": 9}, "model.moe_hash_layers"),
])
def test_config_refusals_name_the_culprit(fields, culprit):
    with pytest.raises(ConfigError, match=culprit):
        load_config(overrides={"model.preset": "deepseek-v4-tiny", "model.vocab_size": 256,
                               **{f"model.{k}": v for k, v in fields.items()}})


def test_hyper_connections_need_v4_attention():
    cfg = dataclasses.replace(ModelConfig(), hc_mult=4)
    with pytest.raises(ConfigError, match="model.hc_mult"):
        load_config(overrides={f"model.{k}": v for k, v in {"hc_mult": cfg.hc_mult}.items()})


def test_plan_kv_bytes_per_token_of_the_compressed_cache():
    from megapipe.parallel.plan import kv_cache_bytes

    # V4-Pro: 61 layers, each the last 128 tokens' 512-wide key = value head; 32 HCA layers one 512 entry per 128
    # tokens, 29 CSA layers one 512 entry + a 128 indexer key per 4 tokens; bf16
    pro = kv_cache_bytes(from_dict(ModelConfig, {"preset": "deepseek-v4-pro"}))
    at_8k = (61 * 128 * 512 + 32 * (8192 // 128) * 512 + 29 * (8192 // 4) * 640) * 2 / 8192
    assert pro["bytes_per_token_at"][8192] == at_8k == 10512
    v3 = kv_cache_bytes(from_dict(ModelConfig, {"preset": "deepseek-v3"}))
    assert v3["bytes_per_token"] == 61 * (512 + 64) * 2 and pro["bytes_per_token"] < v3["bytes_per_token"] / 7


def test_flops_count_the_compressed_layers():
    from megapipe.models.transformer import flops_per_token, layer_flops_per_token, matmul_params

    cfg = from_dict(ModelConfig, {"preset": "deepseek-v4-flash"})
    counts = param_counts(cfg)
    # the matmul weights a token uses: all active parameters but the embedding table, the norms and the
    # hyper-connections' and compressors' small vectors / maps (0.3%)
    assert abs(matmul_params(cfg) / (counts.active - counts.embedding) - 1) < 0.005
    per_layer = layer_flops_per_token(cfg, 8192)
    sliding, csa, hca = per_layer[0], per_layer[2], per_layer[3]
    assert csa > hca > sliding  # the indexer and the top-k entries; the 64 HCA entries over the window alone
    head = 6 * cfg.hidden_size * cfg.vocab_size
    assert flops_per_token(cfg, 8192) == sum(per_layer) + head
