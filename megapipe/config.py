"""The one typed config tree: model, parallel, data, train, optim, rl, checkpoint, sft, lora, distill, dpo, rm.

Loaded from YAML (errors name ``file:line``), overridden with dotted keys (``train.lr=3e-4``), validated with
messages that name the key and the allowed values. Every section is a plain dataclass so library code reads
``cfg.train.lr`` with types, and ``to_dict``/``from_dict`` round-trip through JSON for checkpoint manifests.

A field declared with ``opt(default, "--flag", ...)`` also gets that command-line flag (Megatron's name first,
shorter aliases after) in every stage that takes its section (``stages.common.config_flags``): one declaration
gives the YAML key, the ``--set`` path and the flag.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from megapipe.errors import ConfigError, DataError
from megapipe.presets import PRESET_DEFAULTS, PRESETS

# --------------------------------------------------------------------------------------------------- sections


def opt(default: Any = None, *flags: str, help: str = "", factory: Any = None, parse: Any = None,
        scale: float | None = None, flag_type: Any = None):
    """A config field with command-line flags. ``parse``: text -> value for flags whose text is not the field's
    type (e.g. "3,5" -> [3, 5]); ``scale``: the flag's unit times ``scale`` is the field's (minutes -> seconds);
    ``flag_type``: the flag's Python type when it differs from the field's (with ``scale``)."""
    meta = {"flags": flags, "help": help, "parse": parse, "scale": scale, "flag_type": flag_type}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ValueError("is not a comma-separated list of integers (e.g. 3,5)") from None


def _layer_pattern(text: str) -> int | list[int]:
    """Megatron's --moe-layer-freq: N (every N-th layer from layer 0), "1,0,1,1", or a list expression such as
    "([0]*1+[1]*3)*2" (lists of 0/1, + and *, nothing else is evaluated)."""
    import ast

    text = str(text).strip()
    if text.lstrip("-").isdigit():
        return int(text)

    def ev(node):
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError
    try:
        value = ev(ast.parse(text, mode="eval").body)
    except (ValueError, SyntaxError, TypeError):
        value = None
    if not isinstance(value, list) or not all(v in (0, 1) for v in value):
        raise ValueError("is not an integer N, a list of 0/1 such as 1,0,1,1, or an expression such as ([0]*1+[1]*3)*2")
    return value




MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's default

HYBRID_SYMBOLS = {"M": "Mamba", "*": "attention", "-": "MLP", "E": "MoE",
                  "P": "Falcon-H1's parallel Mamba + attention, then MLP"}
# Falcon-H1's muP multipliers (megapipe.models.parallel_hybrid): fields -> their neutral value; other layer kinds refuse
# any other value
FALCON_MULTIPLIERS = {"embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "attention_in_multiplier": 1.0,
                      "attention_out_multiplier": 1.0, "key_multiplier": 1.0, "mamba_in_multiplier": 1.0,
                      "mamba_out_multiplier": 1.0, "mamba_proj_multipliers": [1.0] * 5, "mlp_multipliers": [1.0] * 2}


def allocate_hybrid_layers(num_layers: int, attention_ratio: float, mlp_ratio: float) -> str:
    """Megatron's hybrid layer allocation: round(L * attention_ratio) attention layers spread evenly between Mamba
    sections (never first), then round(L * mlp_ratio) of the remaining Mamba layers turned into MLP layers, spread
    evenly the same way."""
    kinds = ["M"] * num_layers
    attention = round(num_layers * attention_ratio)
    mamba = num_layers - attention
    section = mamba / (attention + 1)
    x = section
    for i in range(num_layers):
        if x < 0.5:
            kinds[i] = "*"
            x += section
        else:
            x -= 1
    mlp = round(num_layers * mlp_ratio)
    if mlp > 0:
        per_mlp = (mamba - mlp) / mlp
        x = per_mlp
        for i in range(num_layers):
            if kinds[i] == "M":
                if x < 0.5:
                    kinds[i] = "-"
                    x += per_mlp
                else:
                    x -= 1
    return "".join(kinds)

@dataclass
class ModelConfig:
    """One decoder-only family; Llama / Qwen2 / Qwen3 / Mistral / GPT-2 are shapes of it."""

    # fields of a named preset are applied first, then the ones given here
    preset: Optional[str] = opt(None, "--model", help="Model preset (tiny, llama3-1b, ...); other fields: --set model.*=.")
    arch: Literal["llama", "qwen2", "qwen3", "mistral", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe",
                  "deepseek_v3", "deepseek_v32", "nemotron_h", "falcon_h1", "gpt_oss", "qwen2_5_vl",
                  "deepseek_v4"] = "llama"
    vocab_size: Optional[int] = None  # None: the tokenizer's size, padded to make_vocab_size_divisible_by
    make_vocab_size_divisible_by: int = 128
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: Optional[int] = None  # None: num_heads (no GQA)
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    max_position_embeddings: int = 2048
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    # relu2: squared ReLU (Megatron's --squared-relu; Nemotron-H), up and down projections only, like gelu_tanh
    activation: Literal["swiglu", "gelu_tanh", "relu2"] = "swiglu"
    position_embedding: Literal["rope", "learned", "none"] = "rope"  # none: no positions (Nemotron-H's attention)
    rope_theta: float = 10000.0
    # Llama-3 frequency scaling: {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: Optional[dict] = None
    qkv_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    # a sequence classifier (a reward model: 1) instead of a language model: the output projection gives num_labels
    # scores per position (HF's ``score`` of ``...ForSequenceClassification``), never tied to the embeddings
    num_labels: Optional[int] = None
    sliding_window: Optional[int] = None
    # which layers the window applies to (None: every layer), Megatron's meaning: N = every N-th layer (N-1, 2N-1, ...)
    # attends fully, the others through the window; or one 1 (windowed) / 0 (full) per layer (GPT-OSS: 2)
    window_attn_skip_freq: Union[int, list[int], None] = opt(
        None, "--window-attn-skip-freq", parse=_layer_pattern, flag_type=str,
        help="Full-attention layers among the sliding-window ones: every N-th, or a 1 (window) / 0 (full) pattern.")
    # a learned logit per head in every softmax row's denominator (GPT-OSS's attention sinks)
    attention_sinks: bool = False
    init_std: float = 0.02
    # Multi-latent attention (megapipe.models.mla), Megatron's names: queries through a q_lora_rank bottleneck (None
    # or 0: one projection), keys/values from a kv_lora_rank latent; per head qk_head_dim (no rope) +
    # qk_pos_emb_head_dim (rope, one key shared by all heads) for q/k, v_head_dim for v
    multi_latent_attention: bool = opt(False, "--multi-latent-attention", help="Multi-latent attention (DeepSeek).")
    q_lora_rank: Optional[int] = opt(None, "--q-lora-rank", help="MLA query bottleneck rank (none/0: a plain projection).")
    kv_lora_rank: int = opt(32, "--kv-lora-rank", help="MLA key/value latent rank.")
    qk_head_dim: int = opt(128, "--qk-head-dim", help="MLA per-head q/k dims without rope (qk_nope_head_dim).")
    qk_pos_emb_head_dim: int = opt(64, "--qk-pos-emb-head-dim", help="MLA per-head q/k dims with rope.")
    v_head_dim: int = opt(128, "--v-head-dim", help="MLA per-head value dims.")
    rope_interleave: bool = False  # rotary pairs (x0, x1), (x2, x3)... as DeepSeek's weights lay them out
    # DeepSeek Sparse Attention on top of MLA (megapipe.models.dsa), Megatron's names: a lightning indexer of its own
    # small heads scores the earlier tokens and each query attends to its top dsa_indexer_topk keys only
    experimental_attention_variant: Optional[Literal["dsa"]] = opt(
        None, "--experimental-attention-variant", help="dsa: DeepSeek Sparse Attention on top of MLA (DeepSeek-V3.2).")
    dsa_indexer_n_heads: int = opt(64, "--dsa-indexer-n-heads", help="DSA: the lightning indexer's heads.")
    dsa_indexer_head_dim: int = opt(128, "--dsa-indexer-head-dim", help="DSA: the lightning indexer's head dims.")
    dsa_indexer_topk: int = opt(2048, "--dsa-indexer-topk", help="DSA: keys each query attends to.")
    dsa_indexer_loss_coeff: float = opt(
        0.0, "--dsa-indexer-loss-coeff", help="DSA: weight of the indexer's KL loss towards the main attention (0: "
        "the indexer is frozen).")
    # YaRN (megapipe.models.rope), on when rotary_scaling_factor != 1; transformers' rope_type "yarn"
    rotary_scaling_factor: float = opt(1.0, "--rotary-scaling-factor", help="YaRN context extension factor (1: off).")
    original_max_position_embeddings: Optional[int] = opt(
        None, "--original-max-position-embeddings", help="YaRN: the pretraining context (default: max positions).")
    beta_fast: float = 32.0  # YaRN: the ramp's bounds, in rotations over the original context
    beta_slow: float = 1.0
    yarn_truncate: bool = True  # YaRN: the ramp's bounds floored / ceiled to whole dims (GPT-OSS: false)
    mscale: float = opt(1.0, "--mscale", help="YaRN: scale of log(factor) in the rope attention factor.")
    mscale_all_dim: float = opt(
        0.0, "--mscale-all-dim", help="YaRN: scale of log(factor) in the softmax scale (DeepSeek: 1).")
    # Mixture of experts (megapipe.models.moe), Megatron's names; num_experts = 0 is a dense model
    num_experts: int = opt(0, "--num-experts", help="Routed experts per MoE layer (0: a dense model).")
    moe_ffn_hidden_size: Optional[int] = opt(
        None, "--moe-ffn-hidden-size", help="FFN width of each routed expert (default: intermediate_size).")
    moe_router_topk: int = opt(2, "--moe-router-topk", help="Experts each token is routed to.")
    moe_router_score_function: Literal["softmax", "sigmoid", "sqrtsoftplus"] = opt(
        "softmax", "--moe-router-score-function",
        help="Router scores: softmax (Mixtral, Qwen), sigmoid (DeepSeek-V3) or sqrt(softplus) (DeepSeek-V4).")
    moe_router_pre_softmax: bool = opt(
        False, "--moe-router-pre-softmax",
        help="softmax over all experts, then top-k (default: top-k of the logits, softmax over the k chosen).")
    moe_router_norm_topk_prob: bool = opt(
        True, "--moe-router-norm-topk-prob",
        help="Normalise the k routing weights to sum to 1 (after a pre-softmax or a sigmoid).")
    moe_router_topk_scaling_factor: Optional[float] = opt(
        None, "--moe-router-topk-scaling-factor", help="Routing weights times this (DeepSeek's routed_scaling_factor).")
    moe_router_num_groups: Optional[int] = opt(
        None, "--moe-router-num-groups", help="Group-limited routing: experts in this many groups (DeepSeek-V3).")
    moe_router_group_topk: Optional[int] = opt(
        None, "--moe-router-group-topk", help="Group-limited routing: groups each token may use.")
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = opt(
        "aux_loss", "--moe-router-load-balancing-type",
        help="aux_loss (per micro-batch), seq_aux_loss (per sequence) or none.")
    moe_aux_loss_coeff: float = opt(0.0, "--moe-aux-loss-coeff", help="Load-balancing loss weight (per MoE layer).")
    moe_z_loss_coeff: Optional[float] = opt(None, "--moe-z-loss-coeff", help="Router z-loss weight.")
    moe_router_enable_expert_bias: bool = opt(
        False, "--moe-router-enable-expert-bias", help="Aux-loss-free balancing: a per-expert bias for selection.")
    moe_router_bias_update_rate: float = opt(
        1e-3, "--moe-router-bias-update-rate", help="Expert bias step per global batch: rate * sign(mean - load).")
    moe_shared_expert_intermediate_size: Optional[int] = opt(
        None, "--moe-shared-expert-intermediate-size", help="Width of the shared expert(s) every token goes through.")
    moe_shared_expert_gate: bool = opt(
        False, "--moe-shared-expert-gate", help="Scale the shared expert by sigmoid(a learned gate) (Qwen2-MoE).")
    moe_layer_freq: Union[int, list[int]] = opt(
        1, "--moe-layer-freq", parse=_layer_pattern, flag_type=str,
        help="MoE on every N-th layer (from layer 0), or a 0/1 pattern such as ([0]*1+[1]*3)*2.")
    moe_first_k_dense_replace: int = opt(
        0, "--moe-first-k-dense-replace", help="The first K layers stay dense (DeepSeek's first_k_dense_replace).")
    moe_expert_capacity_factor: Optional[float] = opt(
        None, "--moe-expert-capacity-factor", help="Tokens per expert <= factor * tokens * k / experts (default: dropless).")
    moe_token_drop_policy: Literal["probs", "position"] = opt(
        "probs", "--moe-token-drop-policy", help="Over capacity, drop the lowest-probability or the latest tokens.")
    moe_grouped_gemm: bool = opt(
        True, "--moe-grouped-gemm", help="One grouped GEMM for all experts where torch has it (else a loop).")
    moe_router_bias: bool = False  # a learned bias on the router logits (GPT-OSS)
    moe_expert_bias: bool = False  # biases on each routed expert's gate, up and down projections (GPT-OSS)
    # the routed experts' activation: swiglu silu(gate) * up; clamped_swiglu (GPT-OSS) with gate <= limit and
    # |up| <= limit: gate * sigmoid(alpha * gate) * (up + 1); clamped_silu (DeepSeek-V4, its shared experts too):
    # silu(gate) * up with gate <= limit and |up| <= limit
    moe_activation: Literal["swiglu", "clamped_swiglu", "clamped_silu"] = "swiglu"
    moe_swiglu_alpha: float = 1.702
    moe_swiglu_limit: float = 7.0
    # Multi-token prediction (megapipe.models.mtp), Megatron's names; None or 0: off
    mtp_num_layers: Optional[int] = opt(
        None, "--mtp-num-layers", help="Multi-token prediction modules (DeepSeek-V3's MTP depth; 0 or unset: none).")
    mtp_loss_scaling_factor: float = opt(
        0.1, "--mtp-loss-scaling-factor", help="Weight of the MTP loss (the mean over depths) in the training loss.")

    # DeepSeek-V4 (megapipe.models.compressed_attention, megapipe.models.hyper_connections), transformers' names.
    # attention_layer_types: one per layer, sliding_attention / compressed_sparse_attention (CSA) /
    # heavily_compressed_attention (HCA); None: not V4's attention. One KV head of head_dim over the last
    # sliding_window tokens, plus on CSA / HCA layers entries pooled from csa_compress_rate / hca_compress_rate tokens
    # each (CSA's chosen per query by the lightning indexer: index_n_heads heads of index_head_dim, the best
    # index_topk); queries through q_lora_rank; rope on the last qk_pos_emb_head_dim dims of each head (rope_theta on
    # sliding layers, compress_rope_theta with YaRN on CSA / HCA ones); the output through o_groups groups of
    # o_lora_rank; attention sinks. hc_mult residual streams mixed by Sinkhorn-normalised matrices (0: the plain
    # residual). The first moe_hash_layers MoE layers route by a fixed token -> experts table.
    attention_layer_types: Optional[list[str]] = None
    csa_compress_rate: int = 4
    hca_compress_rate: int = 128
    compress_rope_theta: float = 160000.0
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    moe_hash_layers: int = 0

    # Hybrid Transformer-Mamba (megapipe.models.hybrid, megapipe.models.mamba), Megatron's names: one symbol per
    # layer (M Mamba-2, * attention, - MLP, E MoE), given or allocated from the two ratios (the rest Mamba)
    hybrid_override_pattern: Optional[str] = opt(
        None, "--hybrid-override-pattern", help="Layer kinds, one symbol per layer: M Mamba, * attention, - MLP, E MoE, P Mamba | attention + MLP.")
    hybrid_attention_ratio: float = opt(
        0.0, "--hybrid-attention-ratio", help="Share of attention layers in an allocated hybrid pattern.")
    hybrid_mlp_ratio: float = opt(0.0, "--hybrid-mlp-ratio", help="Share of MLP layers in an allocated hybrid pattern.")
    mamba_state_dim: int = opt(128, "--mamba-state-dim", help="Mamba-2 SSM state size per group (d_state).")
    mamba_head_dim: int = opt(64, "--mamba-head-dim", help="Mamba-2 head dim.")
    mamba_num_groups: int = opt(8, "--mamba-num-groups", help="Mamba-2 B/C groups (n_groups).")
    mamba_num_heads: Optional[int] = opt(
        None, "--mamba-num-heads", help="Mamba-2 heads (default: 2 * hidden_size / mamba_head_dim).")
    mamba_chunk_size: int = opt(128, "--mamba-chunk-size", help="Chunk length of the Mamba-2 SSD scan.")
    mamba_conv_kernel: int = 4  # the causal depthwise conv's width (d_conv)
    mamba_proj_bias: bool = False  # biases of the in/out projections
    mamba_conv_bias: bool = True
    mamba_dt_min: float = 0.001  # dt_bias init: softplus^-1 of dt ~ log-uniform [dt_min, dt_max], >= dt_init_floor
    mamba_dt_max: float = 0.1
    mamba_dt_init_floor: float = 1e-4
    mamba_dt_limit_min: float = 0.0  # dt clamped to [min, max] after softplus (max None: no upper limit)
    mamba_dt_limit_max: Optional[float] = None
    mamba_out_proj_bias: Optional[bool] = None  # the out-projection's own (Falcon's projectors_bias); None: as in_*
    mamba_gated_norm: bool = True  # False: y * silu(z) without a norm (Falcon-H1's mamba_rms_norm = false)
    mamba_norm_before_gate: bool = False  # True: norm(y) * weight * silu(z) (Falcon's); False: norm(y * silu(z)) * weight
    # Falcon-H1 (arch falcon_h1, layer kind "P"): Mamba-2 and attention side by side on one normed input, then the MLP,
    # with muP multipliers (constants in the forward; 1: none): the token embeddings, the logits, the attention's
    # input and output, its keys (before RoPE), the Mamba mixer's input and output, its in-projections z, x, B, C, dt
    # (Falcon's ssm_multipliers), the MLP's gate projection output and its output (Falcon's mlp_multipliers)
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    mamba_in_multiplier: float = 1.0
    mamba_out_multiplier: float = 1.0
    mamba_proj_multipliers: list[float] = field(default_factory=lambda: [1.0] * 5)
    mlp_multipliers: list[float] = field(default_factory=lambda: [1.0] * 2)
    # Vision-language (megapipe.models.vision, Qwen2.5-VL's vision tower and patch merger; transformers' vision_config
    # names after vision_): vision_depth 0 is a text-only model. Windows of vision_window_size pixels, full attention in
    # the vision_fullatt_block_indexes blocks; mrope_section: rotary frequencies per axis (temporal, height, width) of
    # the decoder's M-RoPE (None: 1-D rope); the *_token_id: the chat template's image / video placeholders
    vision_depth: int = 0  # vision blocks
    vision_hidden_size: int = 1280
    vision_intermediate_size: int = 3420
    vision_num_heads: int = 16
    vision_patch_size: int = 14  # pixels a patch's side
    vision_temporal_patch_size: int = 2  # frames a patch spans (an image is repeated)
    vision_in_channels: int = 3
    vision_spatial_merge_size: int = 2  # merge x merge patches make one decoder token
    vision_window_size: int = 112  # pixels a window's side
    vision_fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    vision_tokens_per_second: int = 4
    vision_rope_theta: float = 10000.0
    mrope_section: Optional[list[int]] = None
    image_token_id: Optional[int] = None
    video_token_id: Optional[int] = None
    vision_start_token_id: Optional[int] = None
    vision_end_token_id: Optional[int] = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers (empty for a dense model)."""
        if not self.is_moe:
            return []
        freq = self.moe_layer_freq
        pattern = [int(i % freq == 0) for i in range(self.num_layers)] if isinstance(freq, int) else list(freq)
        return [i for i, on in enumerate(pattern) if on and i >= self.moe_first_k_dense_replace]

    @property
    def is_hybrid(self) -> bool:
        """A hybrid Transformer-Mamba model: each layer one mixer (``layer_kinds``), not attention + MLP."""
        return (self.arch in ("nemotron_h", "falcon_h1") or self.hybrid_override_pattern is not None
                or self.hybrid_attention_ratio > 0 or self.hybrid_mlp_ratio > 0)

    @property
    def layer_kinds(self) -> Optional[str]:
        """One symbol per layer of a hybrid model (M Mamba-2, * attention, - MLP, E MoE): the override pattern, else
        the allocation from the ratios (``allocate_hybrid_layers``); None for a model that is not hybrid."""
        if not self.is_hybrid:
            return None
        if self.hybrid_override_pattern is not None:
            return self.hybrid_override_pattern
        if self.arch == "falcon_h1" and not (self.hybrid_attention_ratio or self.hybrid_mlp_ratio):
            return "P" * self.num_layers  # every layer parallel Mamba + attention, then MLP
        return allocate_hybrid_layers(self.num_layers, self.hybrid_attention_ratio, self.hybrid_mlp_ratio)

    @property
    def mamba_heads(self) -> int:
        return self.mamba_num_heads or 2 * self.hidden_size // self.mamba_head_dim

    @property
    def mamba_inner(self) -> int:
        """Width of the Mamba-2 mixer's x and z (d_inner = heads * head_dim)."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_out_bias(self) -> bool:
        return self.mamba_proj_bias if self.mamba_out_proj_bias is None else self.mamba_out_proj_bias

    @property
    def mamba_dt_limit(self) -> tuple[float, float]:
        return self.mamba_dt_limit_min, math.inf if self.mamba_dt_limit_max is None else self.mamba_dt_limit_max

    @property
    def windowed_layers(self) -> list[int]:
        """Indices of the layers that attend through ``sliding_window`` (empty without a window)."""
        return [i for i in range(self.num_layers) if self.layer_window(i) is not None]

    def layer_window(self, layer_id: int) -> Optional[int]:
        """The sliding window of layer ``layer_id`` (None: full attention; an MTP layer past a pattern's end: full)."""
        freq, window = self.window_attn_skip_freq, self.sliding_window
        if window is None or freq is None:
            return window
        if isinstance(freq, int):
            return window if (layer_id + 1) % freq else None
        return window if layer_id < len(freq) and freq[layer_id] else None

    @property
    def mixed_windows(self) -> bool:
        """Some layers attend through the window and others fully (GPT-OSS): one window for the whole model does not
        describe it."""
        return 0 < len(self.windowed_layers) < self.num_layers

    @property
    def mtp_depth(self) -> int:
        """Number of multi-token prediction modules (0: none)."""
        return self.mtp_num_layers or 0

    @property
    def sparse_attention(self) -> bool:
        """DeepSeek Sparse Attention (the lightning indexer's top-k keys per query) on top of MLA."""
        return self.multi_latent_attention and self.experimental_attention_variant == "dsa"

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.intermediate_size

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def rope_dim(self) -> int:
        """The dims RoPE rotates per head: MLA's decoupled rope part, else the whole head."""
        return self.qk_pos_emb_head_dim if self.multi_latent_attention else self.dim_per_head


@dataclass
class ParallelConfig:
    """Layout dp_replicate x dp_shard x cp x tp x pp; -1 for dp_shard means 'the rest of the world size'."""

    tp: int = opt(1, "--tensor-model-parallel-size", "--tp", help="Tensor parallel size.")
    pp: int = opt(1, "--pipeline-model-parallel-size", "--pp", help="Pipeline stages.")
    cp: int = opt(1, "--context-parallel-size", "--cp", help="Context parallel size.")
    ep: int = opt(1, "--expert-model-parallel-size", "--ep",
                  help="Expert parallel size: MoE experts sharded over this many of the dp_shard ranks.")
    dp_shard: int = opt(-1, "--dp-shard", help="FSDP sharding size (-1: the rest of the world size).")
    dp_replicate: int = opt(1, "--dp-replicate", help="Replicas (HSDP with --dp-shard).")
    dp_mode: Literal["fsdp", "ddp"] = opt("fsdp", "--dp-mode", help="FSDP2/HSDP, or DDP (replication only).")
    sequence_parallel: bool = opt(True, "--sequence-parallel", help="Split norms/residuals over TP ranks.")
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"] = opt(
        "1F1B", "--pp-schedule", help="Pipeline schedule.")
    pp_virtual_stages: int = opt(
        1, "--pp-virtual-stages", help="Stages per pipeline rank (Interleaved1F1B; default: what the schedule needs).")
    # layers per (virtual) stage, e.g. [3, 5]; None: balanced by the layers' FLOPs (as even as possible when they cost alike)
    pp_layer_split: Optional[list[int]] = opt(
        None, "--pp-layer-split", help="Layers per pipeline stage, comma-separated, e.g. 3,5.", parse=_int_list,
        flag_type=str)
    pp_microbatches: Optional[int] = opt(None, "--pp-microbatches", help="Default: global batch / (micro batch x dp).")
    fsdp_reshard_after_forward: bool = True
    timeout_s: float = opt(600.0, "--distributed-timeout-minutes", scale=60.0,
                           help="A collective waiting longer than this fails (default 10).")


@dataclass
class DataConfig:
    # ["A"] or Megatron blend ["0.7", "A", "0.3", "B"]
    data_path: list[str] = opt(None, "--data-path", factory=list,
                               help="Data PREFIX, or a blend: --data-path 0.7 PREFIX_A 0.3 PREFIX_B.")
    split: str = opt("969,30,1", "--split", help="train,valid,test weights, e.g. 969,30,1.")
    seq_length: int = opt(256, "--seq-length")
    tokenizer: Optional[str] = opt(None, "--tokenizer", help="Tokenizer directory or tokenizer.json.")
    cache_dir: Optional[str] = opt(None, "--data-cache-path", help="Index cache (default: next to the first prefix).")
    num_workers: int = 0
    # packed pretraining samples (Megatron's flags): documents are cut at the end-of-document token
    reset_position_ids: bool = opt(False, "--reset-position-ids", help="Positions restart after each end-of-document.")
    reset_attention_mask: bool = opt(
        False, "--reset-attention-mask", help="Attention stays within each document (block-diagonal causal).")
    eod_mask_loss: bool = opt(False, "--eod-mask-loss", help="No loss on predicting the token after an end-of-document.")
    allow_tokenizer_mismatch: bool = opt(
        False, "--allow-tokenizer-mismatch", help="Train on data that records another tokenizer than the model's.")


@dataclass
class TrainConfig:
    micro_batch_size: int = opt(4, "--micro-batch-size")
    global_batch_size: int = opt(8, "--global-batch-size")
    train_iters: Optional[int] = opt(None, "--train-iters")
    train_tokens: Optional[int] = opt(None, "--train-tokens", help="Instead of --train-iters.")
    seed: int = opt(1234, "--seed")
    precision: Literal["fp32", "bf16", "fp16"] = opt("fp32", "--precision", help="Also --bf16 / --fp16.")
    recompute: Literal["none", "selective", "full"] = opt("none", "--recompute", help="Activation recompute.")
    compile: bool = opt(False, "--compile", help="torch.compile each block.")
    eval_interval: Optional[int] = opt(None, "--eval-interval")
    eval_iters: int = opt(10, "--eval-iters")
    log_interval: int = opt(10, "--log-interval")
    log_dir: Optional[str] = opt(None, "--log-dir", help="metrics.jsonl + TensorBoard (default: --save).")
    max_nan_skips: int = 5  # this many non-finite losses in a row abort the run
    exit_interval: Optional[int] = opt(None, "--exit-interval", help="Stop with a checkpoint after this step.")
    exit_duration_in_mins: Optional[float] = opt(
        None, "--exit-duration-in-mins", help="Stop with a checkpoint once the run has taken this long.")
    exit_signal_handler: bool = opt(
        True, "--exit-signal-handler", help="SIGTERM/SIGINT save a checkpoint and stop (default on).")
    peak_flops: Optional[float] = None  # per device, for MFU; None: from the device when known
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    # learning-rate schedule: warmup, then decay to min_lr
    lr: float = opt(3e-4, "--lr")
    min_lr: float = opt(0.0, "--min-lr")
    lr_warmup_iters: int = opt(0, "--lr-warmup-iters")
    lr_decay_iters: Optional[int] = opt(None, "--lr-decay-iters", help="Default: --train-iters.")
    lr_decay_style: Literal["cosine", "linear", "wsd", "constant"] = opt("cosine", "--lr-decay-style")
    lr_wsd_decay_fraction: float = 0.1  # wsd: fraction of decay_iters spent decaying at the end
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"


def _optimizer_name(text: str) -> str:
    """Megatron's ``--optimizer dist_muon`` is Muon with its state sharded over the data-parallel ranks, which
    megapipe's Muon is under FSDP (dp_shard)."""
    return "muon" if text == "dist_muon" else text


def _muon_scale(text: str) -> str:
    return "original" if text == "shape_scaling" else text  # Megatron's name for Keller Jordan's rule


@dataclass
class OptimConfig:
    optimizer: Literal["adamw", "sgd", "muon"] = opt(
        "adamw", "--optimizer", parse=_optimizer_name, flag_type=str,
        help="adamw, sgd or muon: Muon for the blocks' weight matrices, AdamW for the rest (Megatron's dist_muon: "
             "muon, whose state FSDP shards).")
    weight_decay: float = opt(0.01, "--weight-decay")
    clip_grad: float = opt(1.0, "--clip-grad", help="Max total gradient norm (0: no clipping).")
    adam_beta1: float = opt(0.9, "--adam-beta1")
    adam_beta2: float = opt(0.95, "--adam-beta2")
    adam_eps: float = opt(1e-8, "--adam-eps")
    # Muon (megapipe.training.optim); Megatron's spellings as second flags
    muon_momentum: float = opt(0.95, "--muon-momentum")
    muon_nesterov: bool = opt(True, "--muon-nesterov", "--muon-use-nesterov")
    muon_ns_steps: int = opt(5, "--muon-ns-steps", "--muon-num-ns-steps", help="Newton-Schulz iterations.")
    muon_ns_coefficients: list[float] = opt(
        None, "--muon-ns-coefficients", factory=lambda: list(MUON_NS_COEFFICIENTS),
        help="Newton-Schulz quintic coefficients a b c.")
    muon_scale: Literal["match_rms_adamw", "original", "spectral", "unit_rms_norm"] = opt(
        "match_rms_adamw", "--muon-scale", "--muon-scale-mode", parse=_muon_scale, flag_type=str,
        help="Update scale of an A x B matrix: match_rms_adamw = 0.2*sqrt(max(A, B)) (Moonlight: AdamW's lr and "
             "weight decay carry over), original = sqrt(max(1, A/B)) (Keller Jordan's; Megatron's shape_scaling), "
             "spectral = sqrt(max(A, B)), unit_rms_norm = sqrt(A/B) (Megatron's).")
    muon_extra_scale_factor: float = opt(
        1.0, "--muon-extra-scale-factor", help="Multiplies the update scale (Megatron's; spectral with 0.2 is "
                                               "match_rms_adamw).")
    # Megatron's ways to orthogonalise tensor-parallel shards and its Newton-Schulz matmul precision: megapipe takes
    # the whole matrix (gathered) in fp32, which is what "duplicated" / "distributed" and "high" compute
    muon_tp_mode: Literal["duplicated", "distributed", "blockwise"] = opt("duplicated", "--muon-tp-mode")
    muon_fp32_matmul_prec: Literal["high", "medium", "low"] = opt("high", "--muon-fp32-matmul-prec")
    muon_lr: Optional[float] = opt(None, "--muon-lr", help="Muon's peak lr, on --lr's schedule. Default: --lr.")
    muon_weight_decay: Optional[float] = opt(None, "--muon-weight-decay", help="Default: --weight-decay.")


@dataclass
class RLConfig:
    """``megapipe posttrain rl``: GRPO with verifiable rewards (megapipe.training.recipes.rl)."""

    task: Optional[str] = opt(None, "--task", help="arithmetic, format or jsonl:FILE (prompt and answer fields).")
    reward: list[str] = opt(
        None, "--reward", factory=list,
        help="Reward functions NAME[=WEIGHT]: accuracy, format, or package.module:function (default: the task's).")
    prompts_per_step: int = opt(8, "--prompts-per-step", help="Prompts per rollout batch (all ranks together).")
    group_size: int = opt(8, "--group-size", help="Completions sampled per prompt (G).")
    max_prompt_tokens: int = opt(256, "--max-prompt-tokens", help="Longest prompt (after the chat template).")
    max_completion_tokens: int = opt(128, "--max-completion-tokens", help="Completion length limit.")
    min_completion_tokens: int = opt(0, "--min-completion-tokens", help="No end-of-sequence before this many tokens.")
    temperature: float = opt(1.0, "--temperature", help="Sampling temperature (the policy trained is p^(1/T)).")
    top_p: float = opt(1.0, "--top-p", help="Nucleus sampling (1: off); see the docs on truncated sampling.")
    top_k: int = opt(0, "--top-k", help="Top-k sampling (0: off).")
    scale_rewards: Literal["group", "batch", "none"] = opt(
        "group", "--scale-rewards", help="Advantage = (r - group mean) / std of the group, of the batch, or 1 (Dr. GRPO).")
    clip_low: float = opt(0.2, "--clip-low", help="Ratio clipped below at 1 - clip_low.")
    clip_high: float = opt(0.2, "--clip-high", help="Ratio clipped above at 1 + clip_high (DAPO: 0.28).")
    kl_coef: float = opt(0.0, "--kl-coef", help="KL penalty to the starting policy (0: no reference model).")
    kl_estimator: Literal["k1", "k3"] = opt("k3", "--kl-estimator", help="k1 = log(p/ref), k3 = ref/p - log(ref/p) - 1.")
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = opt(
        "token-mean", "--loss-aggregation", help="Mean over completion tokens, or over sequences of their sum / mean.")
    updates_per_batch: int = opt(1, "--updates-per-batch", help="Optimizer steps per rollout batch (old log-probs).")
    dynamic_sampling: bool = opt(False, "--dynamic-sampling", help="Drop groups whose rewards are all equal.")
    mask_truncated: bool = opt(False, "--mask-truncated", help="No loss on completions cut at the length limit.")
    max_mismatch: float = opt(
        1e-2, "--max-mismatch", help="Stop when the engine/trainer log-prob mismatch (--mismatch-metric) exceeds this.")
    mismatch_metric: Literal["kl", "max", "mean"] = opt(
        "kl", "--mismatch-metric", help="kl (per token, k3), max or mean absolute log-prob difference.")
    check_weights: bool = opt(True, "--check-weights", help="Compare the engine's weights with the trainer's.")
    rollout_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = opt(
        None, "--rollout-dtype", help="Engine weights (default: the training precision's dtype).")
    chat_template: Optional[str] = opt(
        None, "--chat-template", help="chatml, llama3, harmony, a template name of the tokenizer's, FILE.jinja, or "
                                      "none for raw prompts (default: the tokenizer's template).")
    system_prompt: Optional[str] = opt(None, "--system-prompt", help="A system message before every prompt.")
    prompt_field: str = opt("prompt", "--prompt-field", help="jsonl task: the prompt field.")
    answer_field: str = opt("answer", "--answer-field", help="jsonl task: the reference answer field.")
    answer_match: Literal["exact", "numeric"] = opt("exact", "--answer-match", help="jsonl task: how answers compare.")
    reward_model: Optional[str] = opt(
        None, "--reward-model", help="RM_CKPT[=WEIGHT]: a reward model's score (posttrain rm) as one more reward.")
    answer_regex: Optional[str] = opt(
        None, "--answer-regex", help="Regex whose last match (group 1 if any) is the answer (default: see docs).")
    format_regex: str = opt(r"^\s*-?\d+\s*$", "--format-regex", help="format reward: a completion matching it gets 1.")
    arithmetic_max: int = opt(20, "--arithmetic-max", help="arithmetic task: operands within [0, this].")
    arithmetic_ops: str = opt("+", "--arithmetic-ops", help="arithmetic task: operators drawn from, e.g. +-*.")
    logprob_chunk: int = opt(1024, "--logprob-chunk", help="Tokens per chunk of the log-prob computation.")
    shared_prompts: bool = opt(
        True, "--shared-prompts", help="Train a group's prompt once, its completions packed after it (off: a row each).")


def validate_rl(r: RLConfig) -> None:
    """Range checks of the rl section (the task and rewards are checked when the run is resolved)."""
    for name in ("prompts_per_step", "group_size", "max_prompt_tokens", "max_completion_tokens",
                 "updates_per_batch", "logprob_chunk", "arithmetic_max"):
        if getattr(r, name) < 1:
            raise ConfigError(f"rl.{name} = {getattr(r, name)} must be >= 1")
    if r.group_size < 2:
        raise ConfigError(f"rl.group_size = {r.group_size} must be >= 2: GRPO compares completions within a group")
    if not 0 <= r.min_completion_tokens <= r.max_completion_tokens:
        raise ConfigError(f"rl.min_completion_tokens = {r.min_completion_tokens} must be within [0, "
                          f"rl.max_completion_tokens = {r.max_completion_tokens}]")
    if r.temperature <= 0:
        raise ConfigError(f"rl.temperature = {r.temperature} must be > 0 (GRPO needs sampled completions)")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rl.top_p = {r.top_p} must be within (0, 1]")
    if r.top_k < 0:
        raise ConfigError(f"rl.top_k = {r.top_k} must be >= 0 (0: off)")
    for name in ("clip_low", "clip_high"):
        if getattr(r, name) < 0:
            raise ConfigError(f"rl.{name} = {getattr(r, name)} must be >= 0")
    if r.clip_low >= 1:
        raise ConfigError(f"rl.clip_low = {r.clip_low} must be < 1 (the ratio is clipped at 1 - clip_low > 0)")
    if r.kl_coef < 0:
        raise ConfigError(f"rl.kl_coef = {r.kl_coef} must be >= 0 (0: no reference model)")
    if r.max_mismatch <= 0:
        raise ConfigError(f"rl.max_mismatch = {r.max_mismatch} must be > 0")
    if not r.arithmetic_ops or set(r.arithmetic_ops) - set("+-*"):
        raise ConfigError(f"rl.arithmetic_ops = {r.arithmetic_ops!r} must be made of + - *")


@dataclass
class CheckpointConfig:
    save: Optional[str] = opt(None, "--save", help="Run directory for checkpoints and metrics.")
    load: Optional[str] = opt(None, "--load", help="Resume from the newest complete checkpoint here.")
    save_interval: Optional[int] = opt(None, "--save-interval")
    keep_last: int = opt(3, "--keep-last", help="Checkpoints kept in the run directory.")
    finetune: bool = opt(False, "--finetune", help="With --load: weights only, a new run.")


# post-training sections (megapipe posttrain sft / distill): only the stages that take them show their flags


@dataclass
class SFTConfig:
    data: list[str] = opt(None, "--data", factory=list,
                          help="SFT records: JSONL (.gz), parquet or saved HF datasets with 'messages', "
                               "'prompt'/'completion' or 'text'.")
    chat_template: Optional[str] = opt(
        None, "--chat-template", help="chatml, llama3, harmony, a template name of the tokenizer's or FILE.jinja "
                                      "(default: the tokenizer's own template).")
    train_on_prompt: bool = opt(False, "--train-on-prompt", help="Train on every token, not only the assistant's.")
    packing: bool = opt(False, "--packing", help="Pack several conversations per sequence (attention kept apart).")
    skip_bad_records: bool = opt(False, "--skip-bad-records", help="Leave out malformed records (counted) instead "
                                                                   "of stopping at the first.")
    overlong: Literal["truncate", "drop"] = opt(
        "truncate", "--overlong", help="Conversations longer than --seq-length: cut at the end, or leave out.")
    freeze_vision: bool = opt(False, "--freeze-vision", help="A vision-language model's vision tower (patch "
                                                             "embedding and blocks) is not trained.")
    freeze_projector: bool = opt(False, "--freeze-projector", help="A vision-language model's patch merger "
                                                                   "(projector) is not trained.")


@dataclass
class LoRAConfig:
    rank: int = opt(0, "--lora-rank", help="LoRA rank (0: train all weights).")
    alpha: Optional[float] = opt(None, "--lora-alpha", help="LoRA alpha; the update is scaled by alpha / rank "
                                                            "(default: alpha = rank).")
    dropout: float = opt(0.0, "--lora-dropout", help="Dropout on the LoRA input.")
    targets: str = opt("all-linear", "--lora-targets",
                       help="all-linear, or a comma-separated subset of q,k,v,o,gate,up,down (multi-latent "
                            "attention: q,q_a,kv_a,kv_b,o).")


@dataclass
class DistillConfig:
    teacher: Optional[str] = opt(None, "--teacher", help="Teacher checkpoint (or run directory).")
    student: Optional[str] = opt(None, "--student", help="Student checkpoint whose weights start the run.")
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = opt(
        "forward_kl", "--kd-loss", help="Divergence between teacher and student distributions.")
    temperature: float = opt(1.0, "--kd-temperature", help="Softmax temperature of both distributions.")
    alpha: float = opt(1.0, "--kd-alpha", help="Weight of the distillation loss; 1 - alpha goes to the LM loss.")
    jsd_beta: float = opt(0.5, "--kd-jsd-beta", help="Generalized JSD mixing weight beta (0: forward KL, 1: reverse).")
    top_k: int = opt(0, "--kd-top-k", help="Only the teacher's k most likely tokens (0: the whole vocabulary).")
    teacher_precision: Literal["fp32", "bf16"] = opt("fp32", "--teacher-precision", help="Teacher weights' dtype.")
    teacher_parallel: Literal["replicate", "fsdp"] = opt(
        "replicate", "--teacher-parallel", help="Teacher on every rank, or FSDP-sharded over the data-parallel ranks.")


@dataclass
class DPOConfig:
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = opt(
        "sigmoid", "--loss-type", help="Preference loss: sigmoid (DPO), ipo, hinge, robust; simpo and orpo need no "
                                       "reference.")
    beta: float = opt(0.1, "--beta", help="Scale of the log-ratios (DPO's beta; ORPO's odds-ratio weight).")
    label_smoothing: float = opt(0.0, "--label-smoothing", help="Assumed label noise of sigmoid / robust / simpo.")
    simpo_gamma: float = opt(0.5, "--simpo-gamma", help="SimPO's target reward margin.")
    rpo_alpha: Optional[float] = opt(None, "--rpo-alpha", help="Weight of an NLL term on the chosen answer (RPO).")
    precompute_ref_logprobs: bool = opt(False, "--precompute-ref-logprobs",
                                        help="The reference's log-probs in one pass before training (no reference "
                                             "model during training).")
    ref_parallel: Literal["replicate", "fsdp"] = opt(
        "replicate", "--ref-parallel", help="Reference model on every rank, or FSDP-sharded over the data-parallel "
                                            "ranks.")
    ref_precision: Literal["fp32", "bf16"] = opt("fp32", "--ref-precision", help="Reference weights' dtype.")


@dataclass
class RMConfig:
    center_rewards_coefficient: Optional[float] = opt(
        None, "--center-rewards-coefficient", help="Weight of (r_chosen + r_rejected)^2 (rewards centred on 0).")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rm: RMConfig = field(default_factory=RMConfig)


# --------------------------------------------------------------------------------------------------- building


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints widen to floats, nothing else is guessed."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{where}{key} = {value!r} is not valid: expected {_describe(tp)}")
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, where)
            except ConfigError:
                continue
        raise bad
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise bad
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise bad
    raise bad


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: dict, prefix: str = "", where: str = "", lines: dict[str, int] | None = None):
    """Build dataclass ``cls`` from ``data``; unknown keys and bad values raise ConfigError naming them."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    if cls is ModelConfig and data.get("preset") is not None:
        data = {**resolve_preset(data["preset"], f"{where}{prefix}preset"), **data}
    for key, value in data.items():
        full = prefix + key
        loc = _loc(where, lines, full)
        if key not in names:
            raise ConfigError(f"{loc}unknown key '{full}' (allowed: {', '.join(names)})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, full + ".", where, lines)
        else:
            kwargs[key] = _coerce(value, tp, full, loc)
    return cls(**kwargs)


def _loc(where: str, lines: dict[str, int] | None, key: str) -> str:
    if lines and key in lines:
        return f"{where.rstrip(': ')}:{lines[key]}: "
    return where


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def flag_fields(section: str) -> list[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) of every field of ``section`` that has command-line flags, in declaration order."""
    cls = _field_types(Config)[section]
    hints = _field_types(cls)
    return [(f"{section}.{f.name}", f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("flags")]


def resolve_preset(name: str, key: str = "model.preset") -> dict:
    if name not in PRESETS:
        raise ConfigError(f"{key} = {name!r} is not a known model preset (allowed: {', '.join(PRESETS)})")
    return dict(PRESETS[name])


# --------------------------------------------------------------------------------------------------- YAML + overrides


def _yaml_lines(node: yaml.Node, prefix: str = "", out: dict[str, int] | None = None) -> dict[str, int]:
    """Map every dotted key of a YAML mapping to its (1-based) line, for error messages."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = prefix + str(k.value)
            out[key] = k.start_mark.line + 1
            _yaml_lines(v, key + ".", out)
    return out


def load_yaml(path: str | Path) -> tuple[dict, dict[str, int]]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not valid UTF-8 (byte 0x{e.object[e.start]:02x} at byte offset "
                          f"{e.start} of the file)") from None
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: the config must be a mapping of sections (model, train, ...)")
    return data, (_yaml_lines(node) if node is not None else {})


def parse_override(item: str) -> tuple[str, Any]:
    """``train.lr=3e-4`` -> ("train.lr", 3e-4); the value is read as YAML (numbers, bools, lists, null)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.lr=3e-4)")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: '{p}' is not a section")
        node = nxt
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """YAML file (optional) + dotted overrides -> validated Config."""
    data: dict = {}
    lines: dict[str, int] = {}
    where = ""
    if path is not None:
        data, lines = load_yaml(path)
        where = f"{path}: "
    items = overrides.items() if isinstance(overrides, dict) else (parse_override(o) for o in overrides or [])
    for key, value in items:
        set_dotted(data, key, value)
        lines.pop(key, None)
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    for key, value in PRESET_DEFAULTS.get(model.get("preset"), {}).items():
        section, name = key.split(".")
        if isinstance(data.setdefault(section, {}), dict):
            data[section].setdefault(name, value)
    cfg = from_dict(Config, data, "", where, lines)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Range checks that a type cannot express; each failure names the key, the value and the limit."""

    def positive(section: str, obj: Any, *names: str) -> None:
        for n in names:
            v = getattr(obj, n)
            if v is not None and v <= 0:
                raise ConfigError(f"{section}.{n} = {v} must be > 0")

    for key, value in _non_finite(to_dict(cfg)):  # NaN/inf would poison training and cannot go into a manifest
        hint = "; use 0 for no clipping" if key == "optim.clip_grad" else ""
        raise ConfigError(f"{_named(key)} = {value} must be a finite number{hint}")
    if cfg.data.data_path:
        _check_blend(cfg.data.data_path)
    m, t, o, p = cfg.model, cfg.train, cfg.optim, cfg.parallel
    if m != ModelConfig():  # a model given here (else it may come from the checkpoint: see check_seq_length)
        check_seq_length(m, cfg.data.seq_length)
    positive("model", m, "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
             "num_labels")
    positive("train", t, "micro_batch_size", "global_batch_size", "train_iters", "train_tokens", "log_interval")
    positive("parallel", p, "tp", "pp", "cp", "dp_replicate", "pp_virtual_stages")
    positive("data", cfg.data, "seq_length")
    validate_rl(cfg.rl)
    if m.num_heads and m.hidden_size % m.num_heads and m.head_dim is None:
        raise ConfigError(
            f"model.hidden_size = {m.hidden_size} is not divisible by model.num_heads = {m.num_heads}; set model.head_dim"
        )
    if m.num_heads % m.kv_heads:
        raise ConfigError(f"model.num_heads = {m.num_heads} is not divisible by model.num_kv_heads = {m.kv_heads}")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size = {t.micro_batch_size}"
        )
    for name in ("lr", "min_lr"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name} = {getattr(t, name)} must be >= 0")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr} is larger than train.lr = {t.lr}")
    if not 0 <= t.lr_wsd_decay_fraction <= 1:
        raise ConfigError(f"train.lr_wsd_decay_fraction = {t.lr_wsd_decay_fraction} must be within [0, 1]")
    for name in ("clip_grad", "weight_decay"):
        if getattr(o, name) < 0:
            raise ConfigError(f"{_named('optim.' + name)} = {getattr(o, name)} must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(o, name) < 1:
            raise ConfigError(f"optim.{name} (--{name.replace('_', '-')}) = {getattr(o, name)} must be within [0, 1)")
    positive("optim", o, "adam_eps")
    validate_muon(o)
    if p.dp_shard != -1 and p.dp_shard <= 0:
        raise ConfigError(f"parallel.dp_shard = {p.dp_shard} must be > 0, or -1 for the rest of the world size")
    positive("parallel", p, "ep")
    validate_moe(m)
    validate_attention(m)
    validate_mtp(m)
    validate_mla(m)
    validate_hybrid(m)
    validate_deepseek_v4(m)
    validate_vision(m)
    validate_posttrain(cfg)


def validate_attention(m: ModelConfig) -> None:
    """The sliding window's layers and the attention sinks."""
    if m.sliding_window is not None and m.sliding_window <= 0:
        raise ConfigError(f"model.sliding_window = {m.sliding_window} must be > 0 (or unset: full attention)")
    freq = m.window_attn_skip_freq
    if freq is not None:
        if m.sliding_window is None:
            raise ConfigError(f"model.window_attn_skip_freq = {freq} picks the sliding-window layers, but "
                              "model.sliding_window is not set")
        if isinstance(freq, int) and freq < 1:
            raise ConfigError(f"model.window_attn_skip_freq = {freq} must be >= 1 (or a 0/1 pattern, one per layer)")
        if isinstance(freq, list) and (len(freq) != m.num_layers or set(freq) - {0, 1}):
            raise ConfigError(f"model.window_attn_skip_freq = {freq} must hold one 0 or 1 per layer "
                              f"(model.num_layers = {m.num_layers})")
    if m.attention_sinks and m.multi_latent_attention:
        raise ConfigError("model.attention_sinks = true does not go with model.multi_latent_attention (MLA's "
                          "attention has no sinks)")
    if m.moe_swiglu_limit <= 0 or m.moe_swiglu_alpha <= 0:
        raise ConfigError(f"model.moe_swiglu_limit = {m.moe_swiglu_limit} and model.moe_swiglu_alpha = "
                          f"{m.moe_swiglu_alpha} must be > 0")


def validate_vision(m: ModelConfig) -> None:
    """The vision tower's shapes and the M-RoPE sections."""
    if m.mrope_section is not None and (len(m.mrope_section) != 3 or 2 * sum(m.mrope_section) != m.dim_per_head):
        raise ConfigError(f"model.mrope_section = {m.mrope_section} must be 3 numbers (temporal, height, width) "
                          f"summing to half the head dim ({m.dim_per_head // 2})")
    if m.vision_depth < 0:
        raise ConfigError(f"model.vision_depth = {m.vision_depth} must be >= 0 (0: no vision tower)")
    if not m.vision_depth:
        return
    if m.position_embedding != "rope" or m.mrope_section is None:
        raise ConfigError("model.vision_depth > 0 needs the decoder's M-RoPE: model.position_embedding = 'rope' and "
                          "model.mrope_section set")
    if m.vision_hidden_size % (4 * m.vision_num_heads):
        raise ConfigError(f"model.vision_hidden_size = {m.vision_hidden_size} must be divisible by 4 x "
                          f"model.vision_num_heads = {m.vision_num_heads} (2-D rotary over each head)")
    unit = m.vision_patch_size * m.vision_spatial_merge_size
    if m.vision_window_size < unit:
        raise ConfigError(f"model.vision_window_size = {m.vision_window_size} must be at least one merged patch "
                          f"(vision_patch_size x vision_spatial_merge_size = {unit} pixels)")
    late = [i for i in m.vision_fullatt_block_indexes if not 0 <= i < m.vision_depth]
    if late:
        raise ConfigError(f"model.vision_fullatt_block_indexes holds {late}, outside the "
                          f"model.vision_depth = {m.vision_depth} blocks")


def validate_muon(o: OptimConfig) -> None:
    if o.optimizer != "muon":
        default = OptimConfig()
        for f in dataclasses.fields(o):
            if f.name.startswith("muon_") and getattr(o, f.name) != getattr(default, f.name):
                raise ConfigError(f"optim.{f.name} ({f.metadata['flags'][0]}) = {getattr(o, f.name)} applies to "
                                  f"--optimizer muon only, not optim.optimizer = {o.optimizer!r}")
    if not 0 <= o.muon_momentum < 1:
        raise ConfigError(f"optim.muon_momentum (--muon-momentum) = {o.muon_momentum} must be within [0, 1)")
    if o.muon_ns_steps < 1:
        raise ConfigError(f"optim.muon_ns_steps (--muon-ns-steps) = {o.muon_ns_steps} must be >= 1")
    if len(o.muon_ns_coefficients) != 3:
        raise ConfigError(f"optim.muon_ns_coefficients (--muon-ns-coefficients) = {o.muon_ns_coefficients} must be "
                          "three numbers a b c")
    for name in ("muon_lr", "muon_weight_decay"):
        if getattr(o, name) is not None and getattr(o, name) < 0:
            raise ConfigError(f"optim.{name} (--{name.replace('_', '-')}) = {getattr(o, name)} must be >= 0")
    if o.muon_extra_scale_factor <= 0:
        raise ConfigError(f"optim.muon_extra_scale_factor (--muon-extra-scale-factor) = {o.muon_extra_scale_factor} "
                          "must be > 0")
    if o.muon_tp_mode == "blockwise":
        raise ConfigError("optim.muon_tp_mode (--muon-tp-mode) = 'blockwise' orthogonalises each tensor-parallel shard "
                          "on its own, which megapipe does not: it orthogonalises whole matrices, gathered, as "
                          "'duplicated' and 'distributed' do")
    if o.muon_fp32_matmul_prec != "high":
        raise ConfigError(f"optim.muon_fp32_matmul_prec (--muon-fp32-matmul-prec) = {o.muon_fp32_matmul_prec!r} "
                          "would run Newton-Schulz's matmuls below fp32, which megapipe does not: it runs them in fp32 "
                          "('high') so that every parallel layout gives one process's update")


def validate_mtp(m: ModelConfig) -> None:
    if m.mtp_num_layers is not None and m.mtp_num_layers < 0:
        raise ConfigError(f"model.mtp_num_layers (--mtp-num-layers) = {m.mtp_num_layers} must be >= 0 (0: no MTP)")
    if m.mtp_depth and m.position_embedding != "rope":
        raise ConfigError(f"model.mtp_num_layers = {m.mtp_num_layers} needs rotary positions (model.position_embedding "
                          f"= {m.position_embedding!r}): multi-token prediction is not defined for learned positions")
    if m.mtp_loss_scaling_factor < 0:
        raise ConfigError(
            f"model.mtp_loss_scaling_factor (--mtp-loss-scaling-factor) = {m.mtp_loss_scaling_factor} must be >= 0")


def validate_moe(m: ModelConfig) -> None:
    """The MoE fields of ``m``: each failure names the key, the value and the limit."""
    if m.num_experts < 0:
        raise ConfigError(f"model.num_experts = {m.num_experts} must be >= 0 (0: a dense model)")
    if not m.is_moe:
        return
    e, k = m.num_experts, m.moe_router_topk
    if not 1 <= k <= e:
        raise ConfigError(f"model.moe_router_topk = {k} must be within [1, model.num_experts = {e}]")
    if m.activation != "swiglu":
        raise ConfigError(f"model.activation = {m.activation!r}: MoE experts are SwiGLU; use 'swiglu'")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor",
                 "moe_expert_capacity_factor"):
        v = getattr(m, name)
        if v is not None and v <= 0:
            raise ConfigError(f"model.{name} = {v} must be > 0")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate", "moe_first_k_dense_replace"):
        v = getattr(m, name)
        if v is not None and v < 0:
            raise ConfigError(f"model.{name} = {v} must be >= 0")
    freq = m.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        raise ConfigError(f"model.moe_layer_freq = {freq} must be >= 1 (or a 0/1 pattern with one entry per layer)")
    if isinstance(freq, list):
        if len(freq) != m.num_layers or any(v not in (0, 1) for v in freq):
            raise ConfigError(
                f"model.moe_layer_freq = {freq} must hold one 0 or 1 per layer (model.num_layers = {m.num_layers})")
    if not m.moe_layers:
        raise ConfigError(
            f"model.num_experts = {e} but no layer is an MoE layer (model.moe_layer_freq = {freq}, "
            f"model.moe_first_k_dense_replace = {m.moe_first_k_dense_replace})")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ConfigError(
            "model.moe_router_num_groups and model.moe_router_group_topk go together (group-limited routing): "
            f"got {groups} and {group_topk}")
    if groups is not None:
        if groups < 1 or e % groups:
            raise ConfigError(f"model.moe_router_num_groups = {groups} must divide model.num_experts = {e}")
        if not 1 <= group_topk <= groups:
            raise ConfigError(f"model.moe_router_group_topk = {group_topk} must be within [1, num_groups = {groups}]")
        if k % group_topk or k // group_topk > e // groups:
            raise ConfigError(
                f"model.moe_router_topk = {k} must be a multiple of model.moe_router_group_topk = {group_topk}, with "
                f"at most {e // groups} experts (one group's size) per group")
        if group_topk * (e // groups) < k:
            raise ConfigError(
                f"model.moe_router_group_topk = {group_topk} groups of {e // groups} experts hold fewer than "
                f"moe_router_topk = {k} experts")


def validate_mla(m: ModelConfig) -> None:
    """The multi-latent attention and YaRN fields of ``m``: each failure names the key and the value."""
    if m.rotary_scaling_factor <= 0:
        raise ConfigError(f"model.rotary_scaling_factor = {m.rotary_scaling_factor} must be > 0 (1: no YaRN)")
    if m.rotary_scaling_factor != 1 and m.rope_scaling:
        raise ConfigError("model.rope_scaling (Llama-3 scaling) and model.rotary_scaling_factor = "
                          f"{m.rotary_scaling_factor} (YaRN) cannot be combined: pick one")
    if m.original_max_position_embeddings is not None and m.original_max_position_embeddings <= 0:
        raise ConfigError(f"model.original_max_position_embeddings = {m.original_max_position_embeddings} must be > 0")
    if not m.multi_latent_attention:
        if m.experimental_attention_variant is not None:
            raise ConfigError(f"model.experimental_attention_variant = {m.experimental_attention_variant!r} needs "
                              "model.multi_latent_attention = true")
        if m.arch in ("deepseek_v3", "deepseek_v32"):
            raise ConfigError(f"model.arch = {m.arch!r} needs model.multi_latent_attention = true")
        return
    if m.q_lora_rank is not None and m.q_lora_rank < 0:
        raise ConfigError(f"model.q_lora_rank = {m.q_lora_rank} must be >= 0 (0 or none: a plain query projection)")
    for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name} = {getattr(m, name)} must be > 0")
    if m.qk_pos_emb_head_dim <= 0 or m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"model.qk_pos_emb_head_dim = {m.qk_pos_emb_head_dim} must be a positive even number")
    for name, value in (("position_embedding", m.position_embedding), ("norm_type", m.norm_type)):
        if value != ("rope" if name == "position_embedding" else "rmsnorm"):
            raise ConfigError(f"model.{name} = {value!r} does not go with model.multi_latent_attention "
                              "(MLA uses rope and RMSNorm)")
    for name in ("num_kv_heads", "head_dim", "sliding_window"):
        if getattr(m, name) is not None and not (name == "num_kv_heads" and m.num_kv_heads == m.num_heads):
            raise ConfigError(f"model.{name} = {getattr(m, name)} does not apply to multi-latent attention "
                              "(its heads are set by qk_head_dim, qk_pos_emb_head_dim and v_head_dim): leave it unset")
    if m.qk_norm:
        raise ConfigError("model.qk_norm = true does not apply to multi-latent attention (its latents are normed)")
    validate_dsa(m)


def validate_dsa(m: ModelConfig) -> None:
    """DeepSeek Sparse Attention's fields (MLA's are checked already)."""
    if m.experimental_attention_variant != "dsa":
        if m.arch == "deepseek_v32":
            raise ConfigError("model.arch = 'deepseek_v32' needs model.experimental_attention_variant = 'dsa'")
        return
    if not m.q_lora_rank:
        raise ConfigError("model.experimental_attention_variant = 'dsa' needs model.q_lora_rank (the indexer's "
                          "queries come from the query latent)")
    for name in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name} = {getattr(m, name)} must be > 0")
    if m.dsa_indexer_loss_coeff < 0:
        raise ConfigError(f"model.dsa_indexer_loss_coeff = {m.dsa_indexer_loss_coeff} must be >= 0")
    if m.dsa_indexer_head_dim < m.qk_pos_emb_head_dim:
        raise ConfigError(f"model.dsa_indexer_head_dim = {m.dsa_indexer_head_dim} must be >= model.qk_pos_emb_head_dim "
                          f"= {m.qk_pos_emb_head_dim} (the indexer ropes that many of its dims)")
    if m.mtp_depth:
        raise ConfigError(f"model.mtp_num_layers = {m.mtp_num_layers}: multi-token prediction is not supported with "
                          "model.experimental_attention_variant = 'dsa' yet")


V4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def validate_deepseek_v4(m: ModelConfig) -> None:
    """DeepSeek-V4's attention, hyper-connection and hash-routing fields of ``m``."""
    kinds = m.attention_layer_types
    if kinds is None:
        for name in ("hc_mult", "moe_hash_layers"):
            if getattr(m, name):
                raise ConfigError(f"model.{name} = {getattr(m, name)} needs DeepSeek-V4's attention "
                                  "(model.attention_layer_types)")
        return
    if len(kinds) != m.num_layers or set(kinds) - set(V4_LAYER_TYPES):
        raise ConfigError(f"model.attention_layer_types = {kinds} must hold one of {', '.join(V4_LAYER_TYPES)} per "
                          f"layer (model.num_layers = {m.num_layers})")
    for name in ("csa_compress_rate", "hca_compress_rate", "o_groups", "o_lora_rank", "index_n_heads",
                 "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "q_lora_rank", "sliding_window"):
        if not getattr(m, name) or getattr(m, name) <= 0:
            raise ConfigError(f"model.{name} = {getattr(m, name)} must be > 0 with model.attention_layer_types")
    if m.num_heads * m.dim_per_head % m.o_groups:
        raise ConfigError(f"model.o_groups = {m.o_groups} must divide num_heads x head_dim = "
                          f"{m.num_heads * m.dim_per_head}")
    rope = m.qk_pos_emb_head_dim
    if rope % 2 or rope > min(m.dim_per_head, m.index_head_dim):
        raise ConfigError(f"model.qk_pos_emb_head_dim = {rope} (the rotary dims) must be even and at most head_dim "
                          f"= {m.dim_per_head} and index_head_dim = {m.index_head_dim}")
    if m.multi_latent_attention or m.window_attn_skip_freq is not None:
        raise ConfigError("model.attention_layer_types (DeepSeek-V4's attention) does not go with "
                          "multi_latent_attention or window_attn_skip_freq")
    if not 0 <= m.moe_hash_layers <= len(m.moe_layers):
        raise ConfigError(f"model.moe_hash_layers = {m.moe_hash_layers} must be within [0, the number of MoE "
                          f"layers = {len(m.moe_layers)}]")


def validate_hybrid(m: ModelConfig) -> None:
    """The hybrid Transformer-Mamba fields of ``m``: each failure names the key, the value and the limit."""
    for name in ("hybrid_attention_ratio", "hybrid_mlp_ratio"):
        if not 0 <= getattr(m, name) <= 1:
            raise ConfigError(f"model.{name} (--{name.replace('_', '-')}) = {getattr(m, name)} must be within [0, 1]")
    if m.hybrid_attention_ratio + m.hybrid_mlp_ratio > 1:
        raise ConfigError(f"model.hybrid_attention_ratio + model.hybrid_mlp_ratio = "
                          f"{m.hybrid_attention_ratio + m.hybrid_mlp_ratio} must be <= 1 (the rest are Mamba layers)")
    validate_falcon_multipliers(m)
    if not m.is_hybrid:
        return
    pattern = m.hybrid_override_pattern
    if pattern is not None and (m.hybrid_attention_ratio or m.hybrid_mlp_ratio):
        raise ConfigError(f"model.hybrid_override_pattern = {pattern!r} and the hybrid ratios (attention "
                          f"{m.hybrid_attention_ratio}, MLP {m.hybrid_mlp_ratio}) cannot be combined: pick one")
    if pattern is not None:
        for i, symbol in enumerate(pattern):
            if symbol not in HYBRID_SYMBOLS:
                raise ConfigError(f"model.hybrid_override_pattern = {pattern!r}: symbol {symbol!r} at position {i} is "
                                  f"not a layer kind (M Mamba, * attention, - MLP, E MoE, P Falcon-H1's parallel hybrid)")
        if len(pattern) != m.num_layers:
            raise ConfigError(f"model.hybrid_override_pattern = {pattern!r} has {len(pattern)} layers but "
                              f"model.num_layers = {m.num_layers}: make them equal")
    kinds = m.layer_kinds
    if "E" in kinds and not m.is_moe:
        raise ConfigError(f"model.hybrid_override_pattern = {kinds!r} has MoE layers (E) but model.num_experts = 0")
    if m.is_moe and "E" not in kinds:
        raise ConfigError(f"model.num_experts = {m.num_experts} but the hybrid pattern {kinds!r} has no MoE layer (E)")
    if m.multi_latent_attention:
        raise ConfigError("model.multi_latent_attention = true does not go with a hybrid pattern (its attention "
                          "layers are multi-head / grouped-query)")
    if m.mtp_depth:
        raise ConfigError(f"model.mtp_num_layers = {m.mtp_num_layers}: multi-token prediction is not defined for "
                          "hybrid Transformer-Mamba models")
    if "P" in kinds and m.activation != "swiglu":
        raise ConfigError(f"model.activation = {m.activation!r}: the parallel hybrid layers (P, Falcon-H1) have a "
                          "SwiGLU MLP: set it to 'swiglu'")
    if not {"M", "P"} & set(kinds):
        return
    for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_chunk_size", "mamba_conv_kernel"):
        if getattr(m, name) < 1:
            raise ConfigError(f"model.{name} = {getattr(m, name)} must be >= 1")
    if m.mamba_num_heads is not None and m.mamba_num_heads < 1:
        raise ConfigError(f"model.mamba_num_heads = {m.mamba_num_heads} must be >= 1 (or unset: 2 * hidden / head_dim)")
    if m.mamba_num_heads is None and (2 * m.hidden_size) % m.mamba_head_dim:
        raise ConfigError(f"model.mamba_head_dim = {m.mamba_head_dim} does not divide 2 * model.hidden_size = "
                          f"{2 * m.hidden_size}: set model.mamba_num_heads")
    if m.mamba_heads % m.mamba_num_groups:
        raise ConfigError(f"model.mamba_num_heads = {m.mamba_heads} is not divisible by model.mamba_num_groups = "
                          f"{m.mamba_num_groups}")
    if not 0 < m.mamba_dt_min <= m.mamba_dt_max:
        raise ConfigError(f"model.mamba_dt_min = {m.mamba_dt_min} must be within (0, model.mamba_dt_max = "
                          f"{m.mamba_dt_max}]")
    if m.mamba_dt_init_floor < 0:
        raise ConfigError(f"model.mamba_dt_init_floor = {m.mamba_dt_init_floor} must be >= 0")
    lo, hi = m.mamba_dt_limit
    if lo < 0 or hi <= lo:
        raise ConfigError(f"model.mamba_dt_limit_min = {lo} and model.mamba_dt_limit_max = {m.mamba_dt_limit_max} "
                          "must satisfy 0 <= min < max")


def validate_falcon_multipliers(m: ModelConfig) -> None:
    """Falcon-H1's muP multipliers: the right number of them, and only on a model with its layers (P)."""
    for name, count in (("mamba_proj_multipliers", 5), ("mlp_multipliers", 2)):
        if len(getattr(m, name)) != count:
            raise ConfigError(f"model.{name} = {getattr(m, name)} must have {count} values")
    if "P" in (m.layer_kinds or ""):
        return
    for name, neutral in FALCON_MULTIPLIERS.items():
        if getattr(m, name) != neutral:
            raise ConfigError(f"model.{name} = {getattr(m, name)} applies to Falcon-H1's parallel hybrid layers only "
                              f"(model.arch = 'falcon_h1'): leave it {neutral}")


# flags of `megapipe pretrain` for the keys whose checks below name them
_FLAGS = {"train.lr": "--lr", "train.min_lr": "--min-lr", "optim.clip_grad": "--clip-grad",
          "optim.weight_decay": "--weight-decay", "data.seq_length": "--seq-length", "data.data_path": "--data-path"}


def _named(key: str) -> str:
    return f"{key} ({_FLAGS[key]})" if key in _FLAGS else key


def _non_finite(obj: Any, prefix: str = ""):
    """(dotted key, value) of every NaN or infinite float inside a config dict (lists and dicts included)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        yield prefix.rstrip("."), obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _non_finite(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _non_finite(v, f"{prefix.rstrip('.')}[{i}].")


def number_or_none(text: str) -> float | None:
    """``text`` as a float; None when it is no number (a prefix among the weights of data.data_path)."""
    try:
        return float(text)
    except ValueError:
        return None


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """``(prefixes, weights)``; weights is None for a list of bare prefixes. Items may hold several
    whitespace-separated entries (``["0.7 A 0.3 B"]``), as a Megatron ``--data-path`` string does."""
    items = [t for x in (data_path or []) for t in str(x).split()]
    if not items:
        raise DataError("data.data_path is empty: give a prefix (PATH without .bin/.idx) or weight/prefix pairs")
    numbers = [number_or_none(x) for x in items]
    if all(n is None for n in numbers):
        prefixes, weights = items, None
    else:
        prefixes, weights = _weighted(items, numbers)
    twice = sorted({p for p in prefixes if prefixes.count(p) > 1})
    if twice:
        raise DataError(f"data.data_path lists prefix {twice[0]} more than once; give it one (larger) weight instead")
    return prefixes, weights


def _weighted(items: list[str], numbers: list[float | None]) -> tuple[list[str], list[float]]:
    if len(items) % 2 or any(n is None for n in numbers[::2]) or any(n is not None for n in numbers[1::2]):
        raise DataError(
            f"data.data_path {items} is malformed: give prefixes only ('A B') or weight/prefix pairs ('0.7 A 0.3 B')"
        )
    weights, prefixes = numbers[::2], items[1::2]
    for w, p in zip(weights, prefixes, strict=True):
        if not (math.isfinite(w) and w > 0):
            raise DataError(f"data.data_path weight {w} for prefix {p} must be a positive number")
    return prefixes, weights


def _check_blend(data_path: list[str]) -> None:
    """The blend's weights (positive, finite) and prefixes, checked where the value enters, not when data loads."""
    try:
        parse_data_path(data_path)
    except DataError as e:
        raise ConfigError(str(e).replace("data.data_path", _named("data.data_path"), 1)) from None


def check_seq_length(model: ModelConfig, seq_length: int) -> None:
    """Refuse a sequence longer than the model's position limit (``max_position_embeddings``): learned positions
    have no embedding past it and RoPE models were not trained there. Call it with the model the run will build
    (the checkpoint's, when the model comes from --load)."""
    limit = model.max_position_embeddings
    if limit is not None and seq_length is not None and seq_length > limit:
        name = f"model {model.preset!r}" if model.preset else "the model"
        raise ConfigError(
            f"{_named('data.seq_length')} = {seq_length} is beyond the position limit of {name}: "
            f"model.max_position_embeddings = {limit}; shorten the sequences or raise the limit"
        )


def validate_posttrain(cfg: Config) -> None:
    """Range checks of the post-training sections (sft, lora, distill)."""
    lo, kd = cfg.lora, cfg.distill
    if lo.rank < 0:
        raise ConfigError(f"lora.rank = {lo.rank} must be >= 0 (0: no LoRA)")
    if lo.alpha is not None and lo.alpha <= 0:
        raise ConfigError(f"lora.alpha = {lo.alpha} must be > 0")
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"lora.dropout = {lo.dropout} must be within [0, 1)")
    if kd.temperature <= 0:
        raise ConfigError(f"distill.temperature = {kd.temperature} must be > 0")
    if not 0 <= kd.alpha <= 1:
        raise ConfigError(f"distill.alpha = {kd.alpha} must be within [0, 1]")
    if not 0 <= kd.jsd_beta <= 1:
        raise ConfigError(f"distill.jsd_beta = {kd.jsd_beta} must be within [0, 1]")
    if kd.top_k < 0:
        raise ConfigError(f"distill.top_k = {kd.top_k} must be >= 0 (0: the whole vocabulary)")
    d = cfg.dpo
    if d.beta <= 0:
        raise ConfigError(f"dpo.beta (--beta) = {d.beta} must be > 0")
    if not 0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing (--label-smoothing) = {d.label_smoothing} must be within [0, 0.5)")
    if d.rpo_alpha is not None and d.rpo_alpha < 0:
        raise ConfigError(f"dpo.rpo_alpha (--rpo-alpha) = {d.rpo_alpha} must be >= 0")
    c = cfg.rm.center_rewards_coefficient
    if c is not None and not c >= 0:
        raise ConfigError(f"rm.center_rewards_coefficient (--center-rewards-coefficient) = {c} must be >= 0")
