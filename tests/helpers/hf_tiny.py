"""Tiny random Hugging Face models saved as real model directories (config.json, safetensors, tokenizer), made here:
the engine loads them through the bridge, transformers is the reference (tests/inference)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
TEXTS = ["The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine.",
         "To be, or not to be, that is the question.", "All that glitters is not gold; all that wander are lost.",
         "Hello world! Numbers 12345 and symbols #@%."] * 20
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _hf_config(arch: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, initializer_range=0.3, tie_word_embeddings=False,
                  attn_implementation="eager")
    if arch == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=2, **common)
    if arch == "mistral":
        return transformers.MistralConfig(num_key_value_heads=2, sliding_window=8, **common)
    if arch == "qwen3":
        return transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, **common)
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                       initializer_range=0.3, tie_word_embeddings=True, attn_implementation="eager")
    moe = dict(common, num_key_value_heads=2, intermediate_size=96, num_experts_per_tok=2)
    if arch == "mixtral":
        return transformers.MixtralConfig(num_local_experts=4, sliding_window=8, **moe)
    if arch == "qwen2_moe":  # a shared expert behind its gate; layer 1 dense
        return transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                           mlp_only_layers=[1], norm_topk_prob=False, **moe)
    if arch == "qwen3_moe":  # qk-norm; every other layer MoE
        return transformers.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=32, head_dim=16,
                                           norm_topk_prob=True, decoder_sparse_step=2, **moe)
    if arch == "deepseek_v3":  # MLA (a q bottleneck, YaRN), layer 0 dense, sigmoid routing over 2 of 4 groups
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        return transformers.DeepseekV3Config(
            **dict(moe, num_key_value_heads=4, num_experts_per_tok=4), n_routed_experts=8, n_shared_experts=1,
            moe_intermediate_size=32, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
            v_head_dim=10, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
            rms_norm_eps=1e-6, rope_parameters=yarn, num_nextn_predict_layers=0)
    if arch == "deepseek_v4":  # sliding, CSA (the indexer keeps 2 of up to 12 entries), HCA layers; 3 hyper-connection
        # streams; layer 0 hash-routed; YaRN on the compressed layers' rope
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                "beta_slow": 1.0}
        return transformers.DeepseekV4Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
            max_position_embeddings=128, initializer_range=0.3, tie_word_embeddings=False,
            attn_implementation="eager", q_lora_rank=24, partial_rotary_factor=0.25, o_groups=2, o_lora_rank=16,
            index_n_heads=2, index_head_dim=16, index_topk=2, sliding_window=6, hc_mult=3, hc_sinkhorn_iters=5,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, swiglu_limit=1.0,
            rope_parameters=yarn, rms_norm_eps=1e-6, num_nextn_predict_layers=0)
    if arch == "deepseek_v32":  # DeepSeek-V3's shapes plus the sparse attention's indexer: 4 keys per query
        v3 = _hf_config("deepseek_v3").to_dict()
        fields = {k: v3[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                     "initializer_range", "tie_word_embeddings", "n_routed_experts",
                                     "n_shared_experts", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
                                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
                                     "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor",
                                     "rms_norm_eps", "rope_parameters")}
        return transformers.DeepseekV32Config(**fields, index_n_heads=8, index_head_dim=16, index_topk=4,
                                              attn_implementation="eager")
    if arch == "nemotron_h":  # Mamba-2, attention (no positions) and squared-ReLU MLP layers; 24 tokens span chunks
        return transformers.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, layers_block_type=[
                "linear_attention", "full_attention", "mlp", "linear_attention", "mlp"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
            initializer_range=0.1, tie_word_embeddings=False, use_cache=False, attn_implementation="eager")
    if arch == "falcon_h1":  # Mamba-2 beside attention in every layer; muP multipliers off 1; 24 tokens span chunks
        return transformers.FalconH1Config(**FALCON_H1, **dict(common, num_key_value_heads=2), use_cache=False)
    if arch == "gpt_oss":  # sinks, a 4-token window on layer 0 (layer 1 full), YaRN untruncated, clamped SwiGLU experts
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        return transformers.GptOssConfig(**dict(moe, num_key_value_heads=2, intermediate_size=32), head_dim=16,
                                         num_local_experts=4, sliding_window=4, rope_parameters=yarn,
                                         swiglu_limit=1.5)
    raise ValueError(arch)


# a tiny Falcon-H1 whose multipliers all differ from 1 (so that each is exercised), Mamba width 128 != 2 * hidden
FALCON_H1 = dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                 mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=False, embedding_multiplier=2.0,
                 lm_head_multiplier=0.5, key_multiplier=0.7, attention_in_multiplier=1.1, attention_out_multiplier=0.9,
                 ssm_in_multiplier=1.2, ssm_out_multiplier=0.8, ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9],
                 mlp_multipliers=[1.1, 0.6], rope_parameters={"rope_type": "default", "rope_theta": 1e5})


ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3",
         "deepseek_v32", "nemotron_h", "falcon_h1", "gpt_oss", "qwen2_5_vl", "deepseek_v4")


def make_hf_dir(root: Path, arch: str, seed: int = 0, dtype=torch.float32, **config) -> tuple[Path, object]:
    """A random HF model of ``arch`` (``config``: fields of its HF config to change) + a trained byte-level BPE of
    VOCAB ids (0 = <|endoftext|>) in ``root``."""
    import transformers

    if arch == "qwen2_5_vl":  # a vision-language model (tests.helpers.hf_vl)
        from tests.helpers.hf_vl import make_vl_dir

        assert not config and dtype == torch.float32
        return make_vl_dir(root, seed)
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = _hf_config(arch)
    cfg.update(config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if arch == "qwen2":  # random biases, so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.3)
    if arch in ("deepseek_v3", "deepseek_v32"):  # a trained-looking score-correction bias, so it takes part in the routing
        with torch.no_grad():
            for layer in model.model.layers[cfg.first_k_dense_replace:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    if arch == "nemotron_h":  # transformers' init sets these to constants: random ones, so each copy is checked
        randomize_mamba(model)
    if arch == "deepseek_v4":  # random sinks, position biases, hyper-connection biases, router biases, hash table
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("sinks", "position_bias", ".base", "hc_base", "scale", "hc_scale")):
                    p.normal_(0, 0.5)
            for layer in model.model.layers:
                gate = layer.mlp.gate
                if hasattr(gate, "tid2eid"):
                    gate.tid2eid.copy_(torch.stack([torch.randperm(4)[:2] for _ in range(cfg.vocab_size)]))
                else:
                    gate.e_score_correction_bias.normal_(0, 0.3)
    if arch == "gpt_oss":  # random biases and sinks (transformers' init zeroes the experts' biases)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("_bias", ".bias", ".sinks")):
                    p.normal_(0, 0.5)
    model.save_pretrained(root)
    save_tokenizer(root)
    return root, model.to(dtype)


def save_tokenizer(root: Path, special_tokens: tuple = (), chat_template: str = CHAT_TEMPLATE) -> None:
    """A trained byte-level BPE of VOCAB ids (0 = <|endoftext|>, ``special_tokens`` from id 2) with a chat template,
    in ``root``."""
    from megapipe.data.tokenizer import train_tokenizer

    train_tokenizer(TEXTS, vocab_size=VOCAB, output=root, special_tokens=special_tokens)
    config_file = root / "tokenizer_config.json"
    tok_cfg = json.loads(config_file.read_text()) if config_file.is_file() else {}
    tok_cfg["chat_template"] = chat_template
    config_file.write_text(json.dumps(tok_cfg))

def export_round_trip(hf_dir: Path, work: Path) -> Path:
    """``import hf`` then ``export hf --dtype fp32`` of ``hf_dir`` (in ``work``); asserts the exported safetensors hold
    the same tensors under the same names; returns the exported directory."""
    from safetensors.torch import load_file

    from megapipe.cli import main

    ckpt, out = work / "ckpt", work / "again"
    assert main(["import", "hf", str(hf_dir), str(ckpt), "--quiet"]) == 0
    assert main(["export", "hf", str(ckpt), str(out), "--dtype", "fp32", "--quiet"]) == 0
    source, again = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == again.keys()
    assert all(torch.equal(t, again[name]) for name, t in source.items())
    return out


def randomize_mamba(model, dt_bias_mean: float = 0.0) -> None:
    """Random norms, A_log, D, dt_bias (around ``dt_bias_mean``) and conv biases of a NemotronHForCausalLM."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                p.copy_(dt_bias_mean + torch.randn_like(p))
            elif name.endswith("conv1d.bias"):
                p.copy_(0.3 * torch.randn_like(p))


def hf_auto_class(hf_dir: Path):
    """The transformers auto class that loads ``hf_dir``: text + image models have their own."""
    import transformers

    vision = "vision_config" in json.loads((Path(hf_dir) / "config.json").read_text())
    return transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM


def hf_greedy(hf_model, prompt: list[int], max_new: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
