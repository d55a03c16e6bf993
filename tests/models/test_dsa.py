"""DeepSeek Sparse Attention (megapipe.models.dsa) against transformers' DeepseekV32: the published shape's parameter
count, sparsity that matters, packed documents, the indexer trained by nothing (as transformers'), and the config's
refusals."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ModelConfig, load_config
from megapipe.errors import ConfigError
from megapipe.models import build_model, count_params
from tests.models.test_mla import TINY, YARN

DSA = dict(TINY, **YARN, arch="deepseek_v32", rope_interleave=True, experimental_attention_variant="dsa",
           dsa_indexer_n_heads=8, dsa_indexer_head_dim=16, dsa_indexer_topk=3)


def test_published_shape_counts_as_transformers():
    """DeepSeek-V3.2: DeepSeek-V3's 671 B plus the indexers (61 x 13.2 M), transformers' own count for the config."""
    import transformers

    from megapipe.checkpoint.hf import adapter_for_arch
    from megapipe.parallel.plan import param_counts

    cfg = load_config(None, {"model.preset": "deepseek-v32"}).model
    pc = param_counts(cfg)
    hf_cfg = transformers.DeepseekV32Config(**adapter_for_arch(cfg.arch).hf_config(cfg))
    assert (hf_cfg.index_n_heads, hf_cfg.index_head_dim, hf_cfg.index_topk) == (64, 128, 2048)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf_total = sum(p.numel() for p in hf.parameters())
    assert abs(pc.total / hf_total - 1) < 0.01 and abs(pc.total / 671e9 - 1) < 0.01
    assert pc.total == hf_total == count_params(build_model(cfg, device="meta"))


def test_sparsity_changes_the_output_and_packed_documents_stay_apart():
    model = build_model(ModelConfig(**DSA), seed=0).eval()
    dense = build_model(ModelConfig(**dict(DSA, dsa_indexer_topk=64)), seed=0).eval()
    a, b = torch.randint(0, 96, (1, 9)), torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        assert (model(a) - dense(a)).abs().max() > 1e-3  # 3 keys of 9: the selection matters
        torch.testing.assert_close(model(a)[:, :3], dense(a)[:, :3], atol=1e-6, rtol=1e-6)  # <= 3 keys: all of them
        packed = model(torch.cat([a, b], dim=1), document_ids=torch.tensor([[0] * 9 + [1] * 6]))
        alone = torch.cat([model(a), model(b)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_scores_in_blocks_of_query_rows_select_the_same_keys(monkeypatch):
    from megapipe.models import dsa

    model = build_model(ModelConfig(**DSA), seed=0).eval()
    tokens = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        whole = model(tokens)
        monkeypatch.setattr(dsa, "SCORE_ELEMENTS", 2 * 8 * 11 * 3)  # 3 query rows at a time
        torch.testing.assert_close(model(tokens), whole, atol=0, rtol=0)


def test_the_indexer_is_frozen_the_rest_trains():
    model = build_model(ModelConfig(**DSA), seed=0)
    model(torch.randint(0, 96, (2, 10))).float().logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert p.grad is None and not p.requires_grad, name
        elif "expert_bias" not in name:
            assert p.grad is not None, name


@pytest.mark.parametrize("change, message", [
    ({"model.dsa_indexer_topk": 0}, r"model.dsa_indexer_topk = 0 must be > 0"),
    ({"model.dsa_indexer_head_dim": 4}, r"model.dsa_indexer_head_dim = 4 must be >= model.qk_pos_emb_head_dim = 8"),
    ({"model.q_lora_rank": None}, r"'dsa' needs model.q_lora_rank"),
    ({"model.experimental_attention_variant": None}, r"'deepseek_v32' needs model.experimental_attention_variant"),
    ({"model.multi_latent_attention": False}, r"'dsa' needs model.multi_latent_attention = true"),
    ({"model.mtp_num_layers": 1}, r"model.mtp_num_layers = 1: multi-token prediction"),
])
def test_validation_names_the_key_and_value(change, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {**{f"model.{k}": v for k, v in DSA.items()}, "data.seq_length": 32, **change})


def test_kv_bytes_per_token_add_the_indexer_key():
    """The published shapes in bf16: DeepSeek-V3's latent row (512 + 64 per layer) plus V3.2's indexer key (128)."""
    from megapipe.parallel.plan import kv_cache_bytes

    v3, v32 = (kv_cache_bytes(load_config(None, {"model.preset": p}).model) for p in ("deepseek-v3", "deepseek-v32"))
    assert v3["bytes_per_token"] == 61 * (512 + 64) * 2 == 70272
    assert v32["bytes_per_token"] == 61 * (512 + 64 + 128) * 2 == 85888
    assert v32["gqa_equivalent_bytes_per_token"] == v3["gqa_equivalent_bytes_per_token"]


@pytest.mark.parametrize("stage, features, named", [
    ("pretrain", dict(layouts=["cp"]), "layouts cp"), ("prune", {}, "prune does not support"),
    ("quantize", {}, "quantize does not support"), ("export_trt", {}, "export trt does not support"),
    ("generate", dict(engine=["cpu_kernels"]), "engine cpu_kernels")])
def test_the_capability_row_refuses_what_does_not_work(stage, features, named):
    from megapipe.errors import MegapipeError
    from megapipe.models.capabilities import require

    cfg = ModelConfig(**DSA)
    with pytest.raises(MegapipeError, match=f"{named}.*DeepSeek-V3.2|DeepSeek-V3.2.*{named}"):
        require(cfg, stage, **features)
    require(cfg, "pretrain", layouts=["dp_shard", "dp_replicate", "tp", "sp", "pp", "ep"])


def _kl_written_out(attn, x: torch.Tensor, rope: tuple, coeff: float) -> torch.Tensor:
    """The indexer's loss for one layer, from the module's projections, one query row at a time: KL(p || softmax of
    the index scores) over the keys t <= s, p the heads' summed attention probabilities over those keys, L1-normed."""
    q_latent = attn.q_norm(attn.wq_a(x))
    q = attn.queries(x, rope, q_latent).detach()  # [B, H, S, D], softmax scale folded in
    k = attn.expand(*attn.latent(x, rope))[0].detach()
    ix = attn.indexer
    iq = ix._rotate(ix.wq(q_latent.detach()).view(*x.shape[:2], ix.heads, ix.head_dim).transpose(1, 2), rope)
    ik = ix.keys(x.detach(), rope)  # [B, S, D]
    w = ix.head_weights(x.detach()) / ix.heads ** 0.5  # [B, S, heads]
    rows = []
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            logits = torch.einsum("hd,htd->ht", q[b, :, s], k[b, :, :s + 1]) / q.shape[-1] ** 0.5
            probs = torch.softmax(logits, dim=-1)  # [heads, keys]
            p = probs.sum(0) / probs.sum()
            scores = (w[b, s, :, None] * torch.relu(iq[b, :, s] @ ik[b, :s + 1].T / ix.head_dim ** 0.5)).sum(0)
            rows.append((p * (p.log() - torch.log_softmax(scores, dim=-1))).sum())
    return coeff * torch.stack(rows).mean()


def test_indexer_loss_is_the_kl_towards_the_attention_and_trains_the_indexer_only():
    """model.dsa_indexer_loss_coeff > 0 (Megatron's --dsa-indexer-loss-coeff): the indexer gets exactly the gradient
    of coeff x the KL written out above (one layer's, per layer), the logits and every other gradient are those of
    the frozen-indexer model (the main attention is detached from it; it never enters the LM loss)."""
    coeff = 0.3
    trained = build_model(ModelConfig(**dict(DSA, dsa_indexer_loss_coeff=coeff)), seed=0)
    frozen = build_model(ModelConfig(**DSA), seed=0)
    tokens = torch.randint(0, 96, (2, 9))
    inputs = {}
    for name, layer in trained.layers.items():
        layer.attention.register_forward_pre_hook(lambda m, args, n=name: inputs.update({n: args[:2]}))
    logits = trained(tokens)
    logits.float().logsumexp(-1).mean().backward()
    frozen(tokens).float().logsumexp(-1).mean().backward()
    torch.testing.assert_close(logits, frozen(tokens), atol=0, rtol=0)
    main = {n: p for n, p in frozen.named_parameters() if p.grad is not None}
    for name, p in trained.named_parameters():
        if ".indexer." not in name and name in main:
            torch.testing.assert_close(p.grad, main[name].grad, atol=0, rtol=0, msg=name)
    for name, layer in trained.layers.items():
        attn = layer.attention
        x, rope = inputs[name]
        want = torch.autograd.grad(_kl_written_out(attn, x.detach(), rope, coeff), list(attn.indexer.parameters()))
        assert _kl_written_out(attn, x.detach(), rope, coeff) > 0
        for got, expected in zip(attn.indexer.parameters(), want, strict=True):
            assert expected.abs().max() > 0
            torch.testing.assert_close(got.grad, expected, atol=1e-6, rtol=1e-5)


def test_indexer_loss_refuses_tensor_parallelism():
    from megapipe.config import ParallelConfig
    from megapipe.parallel.dims import ParallelDims

    cfg = ModelConfig(**dict(DSA, dsa_indexer_loss_coeff=0.1, vocab_size=96))
    with pytest.raises(ConfigError, match=r"model.dsa_indexer_loss_coeff = 0.1 is not supported with parallel.tp = 2"):
        ParallelDims.from_config(ParallelConfig(tp=2), 2, None, cfg, 16)
