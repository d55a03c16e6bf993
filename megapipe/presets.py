"""Named model shapes. Each preset is a partial ModelConfig: any field can still be overridden."""

from __future__ import annotations

_LLAMA3_ROPE = {"rope_theta": 500000.0, "max_position_embeddings": 131072, "norm_eps": 1e-5}


def _llama3_scaling(factor: float) -> dict:
    return {
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# DeepSeek-V3's routing and its training-time balancing (the paper's sequence-wise alpha = 1e-4, bias speed 1e-3)
_DEEPSEEK_MOE = dict(
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
)
# DeepSeek-V3's and Kimi-K2's widths: MLA with a 1536 q rank and a 512 kv latent, 2048-wide experts with one shared
_DEEPSEEK_MLA = dict(
    arch="deepseek_v3", hidden_size=7168, intermediate_size=18432, num_layers=61, norm_eps=1e-6,
    tie_embeddings=False, multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
    qk_pos_emb_head_dim=64, v_head_dim=128, rope_interleave=True, original_max_position_embeddings=4096, mscale=1.0,
    mscale_all_dim=1.0, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
)

# GPT-OSS (openai/gpt-oss-20b, -120b config.json; transformers' GptOssConfig): 2880 wide, 64 query / 8 KV heads of 64,
# biased attention with sinks, a 128-token window on every other layer (from layer 0), YaRN x32 over 4096 positions
# (ramp not truncated), experts 2880 wide with biases and the clamped SwiGLU, top-4 of a biased router
_GPT_OSS = dict(
    arch="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_heads=64, num_kv_heads=8,
    head_dim=64, max_position_embeddings=131072, norm_eps=1e-5, tie_embeddings=False, qkv_bias=True,
    attn_out_bias=True, attention_sinks=True, sliding_window=128, window_attn_skip_freq=2, rope_theta=150000.0,
    rotary_scaling_factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
    yarn_truncate=False, moe_router_topk=4, moe_ffn_hidden_size=2880, moe_router_bias=True, moe_expert_bias=True,
    moe_activation="clamped_swiglu", moe_swiglu_alpha=1.702, moe_swiglu_limit=7.0, moe_aux_loss_coeff=1e-3 * 4 / 24,
)


# DeepSeek-V4 (transformers' DeepseekV4Config defaults, the published configs): one 512-wide KV head, 64 rope dims,
# a 128-token window on every layer, CSA entries every 4 tokens (top 512 / 1024 by the indexer's 64 heads of 128),
# HCA ones every 128, YaRN x16 from 64k on the compressed layers; 4 hyper-connection streams; every layer MoE with
# sqrt-softplus scores, one shared expert, SwiGLU clamped at 10, the first 3 layers hash-routed
_DEEPSEEK_V4 = dict(
    arch="deepseek_v4", vocab_size=129280, num_kv_heads=1, head_dim=512, qk_pos_emb_head_dim=64,
    max_position_embeddings=1048576, norm_eps=1e-6, tie_embeddings=False, rope_theta=10000.0,
    compress_rope_theta=160000.0, rotary_scaling_factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0,
    beta_slow=1.0, mscale=0.0, sliding_window=128, attention_sinks=True, csa_compress_rate=4, hca_compress_rate=128,
    index_n_heads=64, index_head_dim=128, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    moe_router_score_function="sqrtsoftplus", moe_router_enable_expert_bias=True, moe_router_topk=6,
    moe_router_topk_scaling_factor=1.5, moe_activation="clamped_silu", moe_swiglu_limit=10.0, moe_hash_layers=3,
    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
)


def _v4_layers(n: int, first: str) -> list[str]:
    """Two ``first`` layers, then CSA and HCA alternating (V4-Flash: sliding first, CSA on even layers; V4-Pro,
    transformers' default: HCA first, HCA on even layers)."""
    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    even = csa if first == "sliding_attention" else hca
    return [first] * 2 + [even if i % 2 == 0 else (hca if even == csa else csa) for i in range(2, n)]


# Qwen2.5-VL (megapipe.models.vision): a Qwen2 decoder with M-RoPE behind the vision tower (32 blocks, 112-pixel
# windows, full attention every 8th block) and its 2 x 2 patch merger; the token ids are Qwen's
_QWEN25_VL = dict(
    arch="qwen2_5_vl", qkv_bias=True, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False, vision_depth=32,
    vision_hidden_size=1280, vision_intermediate_size=3420, vision_num_heads=16, vision_patch_size=14,
    vision_temporal_patch_size=2, vision_spatial_merge_size=2, vision_window_size=112,
    vision_fullatt_block_indexes=[7, 15, 23, 31], vision_tokens_per_second=2, image_token_id=151655,
    video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
)

PRESETS: dict[str, dict] = {
    # Small enough to train a few hundred steps on 2 CPU cores in minutes; vocab comes from the tokenizer.
    "tiny": dict(
        arch="llama", hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4,
        max_position_embeddings=2048, rope_theta=10000.0, tie_embeddings=True,
    ),
    "llama3-1b": dict(
        arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, tie_embeddings=True, rope_scaling=_llama3_scaling(32.0), **_LLAMA3_ROPE,
    ),
    "llama3-8b": dict(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, tie_embeddings=False, rope_scaling=_llama3_scaling(8.0), **_LLAMA3_ROPE,
    ),
    "llama3-70b": dict(
        arch="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, tie_embeddings=False, rope_scaling=_llama3_scaling(8.0), **_LLAMA3_ROPE,
    ),
    "qwen2.5-0.5b": dict(
        arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        num_kv_heads=2, qkv_bias=True, tie_embeddings=True, rope_theta=1000000.0, norm_eps=1e-6,
        max_position_embeddings=32768,
    ),
    "gpt2-124m": dict(
        arch="gpt2", vocab_size=50257, hidden_size=768, intermediate_size=3072, num_layers=12, num_heads=12,
        max_position_embeddings=1024, norm_type="layernorm", norm_eps=1e-5, activation="gelu_tanh",
        position_embedding="learned", qkv_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True,
        make_vocab_size_divisible_by=1,
    ),
    # Mixture of experts (megapipe.models.moe). Small enough for 2 CPU cores, exportable as Mixtral.
    "tiny-moe": dict(
        arch="mixtral", hidden_size=256, intermediate_size=352, num_layers=4, num_heads=8, num_kv_heads=4,
        max_position_embeddings=2048, rope_theta=10000.0, tie_embeddings=False, num_experts=8, moe_router_topk=2,
        moe_ffn_hidden_size=352, moe_aux_loss_coeff=1e-2,
    ),
    "mixtral-8x7b": dict(
        arch="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, max_position_embeddings=32768, rope_theta=1000000.0, norm_eps=1e-5, tie_embeddings=False,
        num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336, moe_aux_loss_coeff=1e-2,
    ),
    "qwen3-30b-a3b": dict(
        arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, qk_norm=True, max_position_embeddings=40960, rope_theta=1000000.0,
        norm_eps=1e-6, tie_embeddings=False, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
        moe_router_pre_softmax=True, moe_router_norm_topk_prob=True, moe_aux_loss_coeff=1e-3,
    ),
    # DeepSeek-V3 at test size: multi-latent attention (a q bottleneck, a 64-wide kv latent, rope on interleaved
    # pairs) and its MoE (sigmoid routing over expert groups, routed scaling, aux-loss-free expert bias with a small
    # sequence aux loss, a shared expert, the first layer dense); YaRN stays off (--rotary-scaling-factor turns it on)
    "deepseek-v3-tiny": dict(
        arch="deepseek_v3", hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
        max_position_embeddings=2048, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False,
        multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16,
        v_head_dim=32, rope_interleave=True, **_DEEPSEEK_MOE, num_experts=16, moe_router_topk=4,
        moe_ffn_hidden_size=128, moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=128, moe_first_k_dense_replace=1,
    ),
    # deepseek-ai/DeepSeek-V3 (671 B parameters, 37 B active; its MTP layer is not part of megapipe's model)
    "deepseek-v3": dict(
        **_DEEPSEEK_MLA, vocab_size=129280, num_heads=128, max_position_embeddings=163840,
        rope_theta=10000.0, rotary_scaling_factor=40.0, beta_fast=32.0, beta_slow=1.0, **_DEEPSEEK_MOE,
        num_experts=256, moe_router_topk=8, moe_router_num_groups=8, moe_router_group_topk=4,
        moe_router_topk_scaling_factor=2.5, moe_first_k_dense_replace=3,
    ),
    # Hybrid Transformer-Mamba (megapipe.models.hybrid) at CPU size: 4 Mamba-2, 2 attention, 2 squared-ReLU MLP
    # layers; 2 Mamba groups (and 4 KV heads) so that TP = 2 splits them
    "nemotron-h-tiny": dict(
        arch="nemotron_h", hidden_size=256, intermediate_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
        head_dim=32, max_position_embeddings=2048, norm_eps=1e-5, tie_embeddings=False, activation="relu2",
        position_embedding="none", hybrid_override_pattern="M*-M-M*M", mamba_state_dim=32, mamba_head_dim=32,
        mamba_num_groups=2, mamba_num_heads=16, mamba_chunk_size=16,
    ),
    # nvidia/Nemotron-H-8B-Base-8K: 52 layers (24 Mamba-2, 4 attention, 24 squared-ReLU MLP), no positions
    "nemotron-h-8b": dict(
        arch="nemotron_h", vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_layers=52,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192, norm_eps=1e-5,
        tie_embeddings=False, activation="relu2", position_embedding="none",
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8, mamba_num_heads=128, mamba_chunk_size=128,
    ),
    # Falcon-H1's parallel hybrid (megapipe.models.parallel_hybrid) at CPU size: 4 layers of Mamba-2 beside attention,
    # then a SwiGLU MLP; Falcon's mixer (no gated norm, d_inner 256 != 2 * hidden), its high RoPE base; 2 Mamba groups
    # (and 2 KV heads) so that TP = 2 splits them; the muP multipliers at their neutral 1
    "falcon-h1-tiny": dict(
        arch="falcon_h1", hidden_size=192, intermediate_size=512, num_layers=4, num_heads=6, num_kv_heads=2,
        head_dim=32, max_position_embeddings=2048, norm_eps=1e-5, tie_embeddings=False, rope_theta=1e11,
        mamba_state_dim=32, mamba_head_dim=16, mamba_num_groups=2, mamba_num_heads=16, mamba_chunk_size=16,
        mamba_gated_norm=False, mamba_norm_before_gate=True, mamba_out_proj_bias=False,
    ),
    # GPT-OSS at CPU size: its block (sinks, a 16-token window on layers 0 and 2, biased experts with the clamped
    # SwiGLU, YaRN), 8 experts top-2
    "gpt-oss-tiny": dict(
        {**_GPT_OSS, "vocab_size": None, "moe_aux_loss_coeff": 1e-2}, hidden_size=256, intermediate_size=256,
        num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, max_position_embeddings=2048, sliding_window=16,
        original_max_position_embeddings=256, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256,
    ),
    # openai/gpt-oss-20b (21 B parameters, 3.6 B active)
    "gpt-oss-20b": dict(_GPT_OSS, num_layers=24, num_experts=32),
    # openai/gpt-oss-120b (117 B parameters, 5.1 B active)
    "gpt-oss-120b": dict(_GPT_OSS, num_layers=36, num_experts=128, moe_aux_loss_coeff=1e-3 * 4 / 36),
    # DeepSeek-V4 at CPU size: a sliding, two CSA (entries every 4 tokens, the indexer keeps 8) and an HCA layer
    # (entries every 16), 4 streams, 8 experts top-2, the first layer hash-routed; Muon, as DeepSeek trained V4
    "deepseek-v4-tiny": dict(
        {**_DEEPSEEK_V4, "vocab_size": None}, hidden_size=128, intermediate_size=128, num_layers=4, num_heads=4,
        head_dim=64, qk_pos_emb_head_dim=16, max_position_embeddings=4096, original_max_position_embeddings=256,
        q_lora_rank=64, o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=32, index_topk=8,
        sliding_window=16, hca_compress_rate=16, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
        moe_shared_expert_intermediate_size=128,
        moe_hash_layers=1, attention_layer_types=["sliding_attention", "compressed_sparse_attention",
                                                  "heavily_compressed_attention", "compressed_sparse_attention"],
    ),
    # deepseek-ai/DeepSeek-V4-Flash (284 B parameters, 13 B active, and its one MTP layer: plan counts it apart)
    "deepseek-v4-flash": dict(
        _DEEPSEEK_V4, mtp_num_layers=1, hidden_size=4096, intermediate_size=2048, num_layers=43, num_heads=64, q_lora_rank=1024,
        o_groups=8, o_lora_rank=1024, index_topk=512, num_experts=256, moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048, attention_layer_types=_v4_layers(43, "sliding_attention"),
    ),
    # deepseek-ai/DeepSeek-V4-Pro (1.6 T parameters, 49 B active, and its one MTP layer: plan counts it apart)
    "deepseek-v4-pro": dict(
        _DEEPSEEK_V4, mtp_num_layers=1, hidden_size=7168, intermediate_size=3072, num_layers=61, num_heads=128, q_lora_rank=1536,
        o_groups=16, o_lora_rank=1024, index_topk=1024, num_experts=384, moe_ffn_hidden_size=3072,
        moe_shared_expert_intermediate_size=3072, attention_layer_types=_v4_layers(61, "heavily_compressed_attention"),
    ),
    # Qwen2.5-VL at CPU size: the tiny decoder with M-RoPE, a 4-block tower (56-pixel windows of 2 x 2 merged patches,
    # blocks 1 and 3 full); the image token ids come with the tokenizer (model.image_token_id)
    "qwen2.5-vl-tiny": dict(
        {**_QWEN25_VL, "image_token_id": None, "video_token_id": None, "vision_start_token_id": None,
         "vision_end_token_id": None}, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8,
        num_kv_heads=4, max_position_embeddings=2048, rope_theta=10000.0, mrope_section=[4, 6, 6], vision_depth=4,
        vision_hidden_size=128, vision_intermediate_size=256, vision_num_heads=4, vision_window_size=56,
        vision_fullatt_block_indexes=[1, 3],
    ),
    # Qwen/Qwen2.5-VL-7B-Instruct (8.3 B parameters, the vision tower's 0.68 B included)
    "qwen2.5-vl-7b": dict(
        _QWEN25_VL, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, max_position_embeddings=128000, mrope_section=[16, 24, 24],
    ),
    # moonshotai/Kimi-K2-Instruct (1.04 T parameters, 32 B active): DeepSeek-V3's architecture, half the heads, 384
    # experts in one group, one dense layer
    "kimi-k2": dict(
        **_DEEPSEEK_MLA, vocab_size=163840, num_heads=64, max_position_embeddings=131072,
        rope_theta=50000.0, rotary_scaling_factor=32.0, beta_fast=1.0, beta_slow=1.0, **_DEEPSEEK_MOE,
        num_experts=384, moe_router_topk=8, moe_router_topk_scaling_factor=2.827, moe_first_k_dense_replace=1,
    ),
}

# DeepSeek-V3.2's sparse attention (megapipe.models.dsa) on DeepSeek-V3's shapes: a lightning indexer of 64 heads of
# 128 dims, 2048 keys per query
_DSA = dict(arch="deepseek_v32", experimental_attention_variant="dsa", dsa_indexer_n_heads=64,
            dsa_indexer_head_dim=128, dsa_indexer_topk=2048)
# deepseek-v3-tiny with an indexer of 4 heads of 32 dims, 64 keys per query (so a 256-token window is sparse)
PRESETS["deepseek-v32-tiny"] = dict(PRESETS["deepseek-v3-tiny"], **{
    **_DSA, "dsa_indexer_n_heads": 4, "dsa_indexer_head_dim": 32, "dsa_indexer_topk": 64})
# deepseek-ai/DeepSeek-V3.2 (-Exp; 671 B parameters, 37 B active): DeepSeek-V3 with the indexer in every layer
PRESETS["deepseek-v32"] = dict(PRESETS["deepseek-v3"], **_DSA)

# a preset's defaults outside the model section, applied where the config leaves them unset: DeepSeek-V4 was trained
# with Muon
PRESET_DEFAULTS: dict[str, dict] = {
    name: {"optim.optimizer": "muon"} for name in ("deepseek-v4-tiny", "deepseek-v4-flash", "deepseek-v4-pro")
}
