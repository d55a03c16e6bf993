"""Multi-latent attention (megapipe.models.mla) and YaRN (megapipe.models.rope) against transformers' DeepseekV3:
the rope frequencies and scales, packed documents, the TP plan's split, the parameter counts of the published
shapes, and the capability row's refusals."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ModelConfig, load_config
from megapipe.errors import ConfigError, MegapipeError
from megapipe.models import build_model, count_params
from megapipe.models.capabilities import require
from megapipe.models.mla import MLAttention, softmax_scale
from megapipe.models.rope import model_inv_frequencies, yarn_attention_factor

TINY = dict(arch="deepseek_v3", multi_latent_attention=True, vocab_size=96, hidden_size=48, intermediate_size=64,
            num_layers=2, num_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8,
            v_head_dim=10, max_position_embeddings=64, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
            moe_first_k_dense_replace=1, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
YARN = dict(rotary_scaling_factor=4.0, original_max_position_embeddings=16, mscale=0.8, mscale_all_dim=1.0)


def _hf_config(cfg: ModelConfig):
    import transformers

    from megapipe.checkpoint.hf import adapter_for_arch

    return transformers.DeepseekV3Config(**adapter_for_arch(cfg.arch).hf_config(cfg))


@pytest.mark.parametrize("yarn", [dict(YARN), dict(YARN, beta_fast=8.0, beta_slow=2.0, mscale=0.0), {}])
def test_rope_frequencies_and_scales_equal_transformers(yarn):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cfg = ModelConfig(**TINY, **yarn)
    hf = _hf_config(cfg)
    if yarn:
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
        assert factor == pytest.approx(yarn_attention_factor(cfg), abs=1e-12)
        assert torch.equal(model_inv_frequencies(cfg), inv_freq)
    assert softmax_scale(cfg) == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)


def test_packed_documents_equal_separate_sequences():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY, **YARN, rope_interleave=True), seed=0).eval()
    a, b = torch.randint(0, 96, (1, 7)), torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), document_ids=torch.tensor([[0] * 7 + [1] * 5]))
        alone = torch.cat([model(a), model(b)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_plain_query_projection_and_latent_api():
    cfg = ModelConfig(**dict(TINY, q_lora_rank=None))
    model = build_model(cfg, seed=0).eval()
    attn: MLAttention = model.layers["0"].attention
    assert attn.wq is not None and attn.wq_a is None
    x = torch.randn(2, 5, 48)
    from megapipe.models.rope import model_rope

    rope = model_rope(cfg, torch.arange(5), x.dtype)
    with torch.no_grad():
        c_kv, k_rope = attn.latent(x, rope)
        assert c_kv.shape == (2, 5, 16) and k_rope.shape == (2, 1, 5, 8)
        k, v = attn.expand(c_kv, k_rope)
        w_uk, w_uv = attn.kv_up_weights()
        # absorbed: q_nope . k_nope == (q_nope @ w_uk) . c_kv, and the values are w_uv @ c_kv
        q_nope = torch.randn(2, 4, 5, 12)
        torch.testing.assert_close(q_nope @ k[..., :12].transpose(-1, -2),
                                   (q_nope @ w_uk[None]) @ c_kv[:, None].transpose(-1, -2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, c_kv[:, None] @ w_uv[None].transpose(-1, -2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset, total, active", [("deepseek-v3", 671e9, 37e9), ("kimi-k2", 1.03e12, 32e9)])
def test_published_shapes_count_as_published_and_as_transformers(preset, total, active):
    """DeepSeek-V3 without its MTP layer: 671 B / 37 B (its report; the 37 B is rounded down from 37.55 B);
    Kimi-K2: 1.03 T / 32 B (its Hub page). The exact count is transformers' own for the same config."""
    import transformers

    from megapipe.parallel.plan import param_counts

    cfg = load_config(None, {"model.preset": preset}).model
    pc = param_counts(cfg)
    assert abs(pc.total / total - 1) < 0.01 and abs(pc.active / active - 1) < 0.03
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(_hf_config(cfg))
    assert pc.total == sum(p.numel() for p in hf.parameters()) == count_params(build_model(cfg, device="meta"))


def test_validation_names_the_key_and_value():
    tiny = {**{f"model.{k}": v for k, v in TINY.items()}, "data.seq_length": 32}
    with pytest.raises(ConfigError, match=r"model.qk_pos_emb_head_dim = 7"):
        load_config(None, {**tiny, "model.qk_pos_emb_head_dim": 7})
    with pytest.raises(ConfigError, match=r"model.num_kv_heads = 2 does not apply"):
        load_config(None, {**tiny, "model.num_kv_heads": 2})
    with pytest.raises(ConfigError, match=r"model.arch = 'deepseek_v3' needs model.multi_latent_attention"):
        load_config(None, {"model.arch": "deepseek_v3"})


@pytest.mark.parametrize("stage", ["prune"])
def test_the_capability_row_refuses_what_does_not_work_yet(stage):
    with pytest.raises(MegapipeError, match=f"{stage.replace('_', ' ')} does not support DeepSeek-V3 "):
        require(ModelConfig(**TINY), stage)
    with pytest.raises(MegapipeError, match="int8_sq"):
        require(ModelConfig(**TINY), "quantize", quant="int8_sq")
    require(ModelConfig(**TINY), "pretrain", layouts=["tp", "sp", "pp", "cp", "ep"])  # tests/parallel/test_dist_layouts
