"""Each preset against the published config.json of the model it is named after (the numbers below are copied
from those files, as facts), both ways: the preset written as a Hugging Face config has these values, and the
published config read through the bridge gives the preset."""

from __future__ import annotations

import pytest

from megapipe.checkpoint.hf import adapter_for_arch
from megapipe.checkpoint.hf.bridge import normalise_hf_config
from megapipe.config import ModelConfig, from_dict

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
PUBLISHED = {
    "llama3-1b": {  # meta-llama/Llama-3.2-1B config.json
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
    },
    "llama3-8b": {  # meta-llama/Llama-3.1-8B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
    },
    "llama3-70b": {  # meta-llama/Llama-3.1-70B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
    },
    "qwen2.5-0.5b": {  # Qwen/Qwen2.5-0.5B
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False, "max_window_layers": 24,
    },
    "gpt2-124m": {  # openai-community/gpt2
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768,
        "n_layer": 12, "n_head": 12, "n_positions": 1024, "n_inner": None, "layer_norm_epsilon": 1e-05,
        "activation_function": "gelu_new", "tie_word_embeddings": True, "attn_pdrop": 0.1, "embd_pdrop": 0.1,
        "resid_pdrop": 0.1,
    },
}
# what config.json leaves to the architecture's defaults, as ModelConfig fields
IMPLIED = {"gpt2-124m": {"intermediate_size": 3072}}


def _normalised(raw: dict, arch: str) -> dict:
    adapter = adapter_for_arch(arch)
    return normalise_hf_config(dict(raw), adapter, "published")


# bookkeeping that says nothing about the architecture
NOT_COMPARED = {"architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "bos_token_id",
                "eos_token_id", "pad_token_id", "use_cache", "output_hidden_states", "return_dict",
                "attn_pdrop", "embd_pdrop", "resid_pdrop",  # training dropout: megapipe has none (writes 0.0)
                "max_window_layers"}  # Qwen2: read only with use_sliding_window, which is off


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_the_preset_writes_the_published_config(preset):
    """Both sides as the installed transformers reads them, so its defaults and renamings apply to both."""
    cfg = from_dict(ModelConfig, {"preset": preset})
    ours = _normalised(adapter_for_arch(cfg.arch).hf_config(cfg), cfg.arch)
    published = _normalised(PUBLISHED[preset], cfg.arch)
    if cfg.arch == "gpt2":  # n_inner null means 4 * n_embd
        published["n_inner"] = published["n_inner"] or 4 * published["n_embd"]
    differ = {k: (ours.get(k), v) for k, v in published.items() if k not in NOT_COMPARED and ours.get(k) != v}
    assert differ == {}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_the_published_config_reads_as_the_preset(preset):
    cfg = from_dict(ModelConfig, {"preset": preset})
    adapter = adapter_for_arch(cfg.arch)
    back = ModelConfig(**adapter.config_from_hf(_normalised(PUBLISHED[preset], cfg.arch), preset))
    from megapipe.presets import PRESETS

    for field, value in {**PRESETS[preset], **IMPLIED.get(preset, {})}.items():
        if field == "make_vocab_size_divisible_by":
            continue
        got = getattr(back, field)
        if field == "rope_scaling" and got is not None:
            got = {k: v for k, v in got.items() if k in value}
        if field == "head_dim" and got is None:
            got = back.hidden_size // back.num_heads
        assert got == value, (field, got, value)
