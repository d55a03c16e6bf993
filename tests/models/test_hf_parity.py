"""fp32 logits of megapipe's Transformer == transformers' reference models with the same (copied) weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from megapipe.config import ModelConfig
from megapipe.models import build_model
from tests.helpers.hf_reference import copy_hf_weights, random_tokens

V, H, I, L, NH = 97, 64, 96, 2, 4  # noqa: E741
COMMON_HF = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                 max_position_embeddings=64)
COMMON_MP = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_layers=L, num_heads=NH,
                 max_position_embeddings=64)
LLAMA3_ROPE = {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

CASES = {
    "llama3-gqa-rope-scaling": (
        transformers.LlamaConfig, transformers.LlamaForCausalLM,
        dict(num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_parameters={"rope_type": "llama3", **LLAMA3_ROPE}),
        dict(arch="llama", num_kv_heads=2, norm_eps=1e-5, rope_theta=500000.0,
             rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}),
    ),
    "llama2-mha": (
        transformers.LlamaConfig, transformers.LlamaForCausalLM,
        dict(num_key_value_heads=NH, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        dict(arch="llama", norm_eps=1e-6),
    ),
    "qwen2-qkv-bias-tied": (
        transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
        dict(num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        dict(arch="qwen2", num_kv_heads=2, norm_eps=1e-6, qkv_bias=True, tie_embeddings=True, rope_theta=1e6),
    ),
    "qwen3-qk-norm-head-dim": (
        transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
        dict(num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        dict(arch="qwen3", num_kv_heads=2, head_dim=24, norm_eps=1e-6, qk_norm=True, tie_embeddings=True,
             rope_theta=1e6),
    ),
    "mistral-sliding-window": (
        transformers.MistralConfig, transformers.MistralForCausalLM,
        dict(num_key_value_heads=2, rms_norm_eps=1e-5, sliding_window=5, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        dict(arch="mistral", num_kv_heads=2, norm_eps=1e-5, sliding_window=5),
    ),
}


def _random_hf(config_cls, model_cls, **kwargs):
    torch.manual_seed(0)
    hf = model_cls(config_cls(**kwargs, attn_implementation="eager")).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them so the copy is tested
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name or "ln_" in name else 0.0))
    return hf


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    config_cls, model_cls, hf_kwargs, mp_kwargs = CASES[case]
    hf = _random_hf(config_cls, model_cls, **COMMON_HF, **hf_kwargs)
    model = build_model(ModelConfig(**COMMON_MP, **mp_kwargs)).eval()
    copy_hf_weights(hf, model)
    tokens = random_tokens(V, 2, 12)
    with torch.no_grad():
        ref = hf(tokens).logits
        ours = model(tokens)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-5


def test_positions_match_transformers_position_ids():
    config_cls, model_cls, hf_kwargs, mp_kwargs = CASES["llama3-gqa-rope-scaling"]
    hf = _random_hf(config_cls, model_cls, **COMMON_HF, **hf_kwargs)
    model = build_model(ModelConfig(**COMMON_MP, **mp_kwargs)).eval()
    copy_hf_weights(hf, model)
    tokens = random_tokens(V, 2, 8)
    # RoPE only sees relative offsets: gaps (as in packed or context-parallel chunks) must change the logits
    positions = torch.tensor([[3, 4, 5, 9, 10, 11, 30, 31], [0, 2, 4, 6, 8, 10, 12, 14]])
    with torch.no_grad():
        ref = hf(tokens, position_ids=positions).logits
        ours = model(tokens, positions=positions)
        plain = model(tokens)
    assert (ours - ref).abs().max().item() <= 1e-5
    assert (ours - plain).abs().max().item() > 1e-3  # the positions were really used


def test_gpt2_logits_match_transformers():
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=64, n_inner=I,
                                     layer_norm_epsilon=1e-5, activation_function="gelu_new",
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    hf = _random_hf(lambda **kw: hf_cfg, transformers.GPT2LMHeadModel)
    cfg = ModelConfig(**COMMON_MP, arch="gpt2", norm_type="layernorm", activation="gelu_tanh",
                      position_embedding="learned", qkv_bias=True, attn_out_bias=True, mlp_bias=True,
                      tie_embeddings=True)
    model = build_model(cfg).eval()
    copy_hf_weights(hf, model)
    tokens = random_tokens(V, 2, 12)
    with torch.no_grad():
        ref = hf(tokens).logits
        ours = model(tokens)
    assert (ours - ref).abs().max().item() <= 1e-5
