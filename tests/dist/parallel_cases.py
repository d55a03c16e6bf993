"""Multi-process equivalence cases, run under torchrun by tests/parallel/test_dist_*.py (many cases per launch).

Every case trains a tiny model for a few SGD steps in one layout and compares, against a single-process run of the
same seed and global batch computed on every rank: the per-step losses (relative), the gradients after step 1, the
clipped gradient norm, and the weights after the last step. Usage:
    torchrun --nproc-per-node N tests/dist/parallel_cases.py OUT.json CASE [CASE ...]
CASE is a layout with options, e.g. "tp2", "pp2:schedule=GPipe", "dp_shard2,tp2:recompute=full:model=qk";
"mask=1" gives every row a loss mask keeping a different number of tokens (global token-weighted normalisation);
"fused=1" trains with the fused output projection + cross-entropy (the reference uses the logits).
MoE models ("model=moe", ...) are compared with a reference that runs the same micro-batches (their balancing losses
are per micro-batch), and also on their expert biases (aux-loss-free balancing) and MoE metrics after every step.
Rank 0 writes {case: {"loss_rel": .., "grad_abs": .., "param_abs": .., "norm_rel": .., "error": ..}} to OUT.json.

"optim=muon" trains with Muon + AdamW (megapipe.training.optim) instead of SGD, in the layout and the reference, for
MUON_STEPS steps. The hyper-connections' weights (DeepSeek-V4's, AdamW's) are compared apart ("hc_abs"): many of
their gradients' entries are all but zero (layer 0's Sinkhorn mix acts on equal streams; a 2 x 2 doubly-stochastic
matrix keeps one of its 4 logits' directions), so fp32 summation-order noise near AdamW's eps is normalised into
O(lr) steps. The reference also reports how far one process drifts from itself in those weights when only its
micro-batches change ("hc_order_abs"), the bound test_dist_layouts.py holds a layout to; the other weights, which
those hyper-connections feed, also drift from themselves ("param_order_abs").

Checkpoint cases (AdamW, or Muon + AdamW with "optim=muon"; next to OUT.json): "tp2,pp2:save=NAME" trains 2 steps, saves NAME/step_00000002 with
megapipe.checkpoint and writes the full model + optimizer tensors to NAME.ref.pt (plus the loss of a 3rd step);
"dp_shard4:load=NAME" builds that layout, loads the checkpoint and reports the largest difference of every model
and optimizer tensor to the reference and the relative difference of the 3rd-step loss.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from megapipe.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megapipe.models import build_model
from megapipe.parallel.dims import ParallelDims, apply_layout, parse_layout
from megapipe.parallel.ep import update_expert_biases
from megapipe.parallel.step import clip_grad_norm_, eval_step, train_step
from megapipe.training.optim import build_optimizer

# 2 SGD steps: the first compares gradients, the second a loss and gradients after an update (a third added CI time
# and nothing the second does not check)
SEQ, GLOBAL_BATCH, MICRO, STEPS, LR, CLIP = 16, 8, 2, 2, 0.5, 0.8
MUON_LR = 0.02
MUON_STEPS = 10  # each layout equals one process over 10 Muon steps (the bar), SGD cases take STEPS

# Each model is labelled with the Hugging Face family (ModelConfig.arch) it is shaped like: every parallel layout an
# architecture declares (megapipe.models.capabilities) runs on a model of that architecture in test_dist_layouts.py.
# DeepSeek-V3-shaped routing (sigmoid scores, expert bias) has no family of its own: Llama, as the deepseek-v3-tiny
# preset.
MODELS = {
    "base": dict(arch="llama", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 vocab_size=128),
    "tied": dict(arch="llama", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 vocab_size=128, tie_embeddings=True),
    "qk": dict(hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=128,
               arch="qwen3", qk_norm=True, qkv_bias=True),
    # Qwen2: q/k/v biases, no qk norm
    "qwen2": dict(arch="qwen2", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                  vocab_size=128, qkv_bias=True),
    # Mistral: a sliding window shorter than the 16-token sequence (so it masks)
    "mistral": dict(arch="mistral", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    vocab_size=128, sliding_window=8),
    "gpt2": dict(arch="gpt2", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, vocab_size=128,
                 norm_type="layernorm", activation="gelu_tanh", position_embedding="learned", qkv_bias=True,
                 attn_out_bias=True, mlp_bias=True, max_position_embeddings=64),
    "deep": dict(arch="llama", hidden_size=32, intermediate_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
                 vocab_size=128),
    # Qwen2-MoE-shaped: softmax router, micro-batch aux loss + z-loss, a gated shared expert, first layer dense
    # (Qwen's mlp_only_layers)
    "moe": dict(arch="qwen2_moe", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                vocab_size=128, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.05,
                moe_z_loss_coeff=0.01, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                moe_first_k_dense_replace=1),
    # Mixtral-shaped: softmax over the top-2 logits, no shared expert, every layer MoE
    "mixtral": dict(arch="mixtral", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    vocab_size=128, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.05),
    # Qwen3-MoE-shaped: qk norm, softmax over all experts then top-2 with the weights renormalised, every layer MoE
    "qwen3_moe": dict(arch="qwen3_moe", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, vocab_size=128, qk_norm=True, num_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=16, moe_router_pre_softmax=True, moe_router_norm_topk_prob=True,
                      moe_aux_loss_coeff=0.05),
    # DeepSeek-V3-shaped: sigmoid scores, group-limited top-k, scaling, expert bias (aux-loss-free) + sequence aux
    "moe_bias": dict(arch="llama", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                     vocab_size=128, num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=16,
                     moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
                     moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.01, moe_router_load_balancing_type="seq_aux_loss",
                     moe_aux_loss_coeff=0.05),
    # every token routed to experts 0 and 1 (a fixed expert bias, see skewed()): other ep ranks receive no token
    "moe_skew": dict(arch="llama", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     vocab_size=128, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.0, moe_aux_loss_coeff=0.05),
    # token dropping: capacity factor 1 by probability (Mixtral-shaped otherwise)
    "moe_drop": dict(arch="mixtral", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     vocab_size=128, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                     moe_aux_loss_coeff=0.05, moe_expert_capacity_factor=1.0),
}


MODELS["mtp"] = {**MODELS["base"], "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.5}  # multi-token prediction
MODELS["mtp_moe"] = {**MODELS["moe_bias"], "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5}
# DeepSeek-V3-shaped (deepseek-v3-tiny in small): multi-latent attention (q rank, kv rank, a shared rope key, v heads
# narrower than q/k heads, YaRN with mscale, interleaved rope) on the "moe_bias" MoE with a first dense layer
MODELS["mla"] = {**MODELS["moe_bias"], "arch": "deepseek_v3", "multi_latent_attention": True, "q_lora_rank": 16,
                 "kv_lora_rank": 12, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 6,
                 "rope_interleave": True, "rotary_scaling_factor": 2.0, "mscale_all_dim": 1.0,
                 "max_position_embeddings": 64, "moe_shared_expert_intermediate_size": 16,
                 "moe_first_k_dense_replace": 1}
MODELS["mla_mtp"] = {**MODELS["mla"], "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.5}
# DeepSeek-V3.2-shaped: the "mla" model with the sparse attention's indexer (frozen), 6 keys of up to 16 per query
MODELS["dsa"] = {**MODELS["mla"], "arch": "deepseek_v32", "experimental_attention_variant": "dsa",
                 "dsa_indexer_n_heads": 4, "dsa_indexer_head_dim": 8, "dsa_indexer_topk": 6}
# ... with the indexer trained by its KL loss towards the main attention (megapipe.models.dsa)
MODELS["dsa_loss"] = {**MODELS["dsa"], "dsa_indexer_loss_coeff": 0.5}
MODELS["mtp_tied"] = {**MODELS["tied"], "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5}
# Nemotron-H-shaped hybrid (nemotron-h-tiny in small): one mixer per layer, Mamba-2 (4 heads in 2 groups, two SSD
# chunks per sequence), attention, squared-ReLU MLP and an MoE layer; its pipeline split follows the layers' costs
MODELS["hybrid"] = dict(arch="nemotron_h", hidden_size=32, intermediate_size=64, num_layers=5, num_heads=4,
                        num_kv_heads=2, vocab_size=128, activation="relu2", position_embedding="none",
                        hybrid_override_pattern="M*-ME", mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
                        mamba_num_heads=4, mamba_chunk_size=8, num_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.05)
# Falcon-H1-shaped (falcon-h1-tiny in small): Mamba-2 (4 heads in 2 groups, Falcon's norm before the gate, two SSD
# chunks per sequence) beside attention on one normed input, then a SwiGLU MLP; every muP multiplier off 1
MODELS["falcon"] = dict(arch="falcon_h1", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, vocab_size=128, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
                        mamba_num_heads=4, mamba_chunk_size=8, mamba_norm_before_gate=True, embedding_multiplier=2.0,
                        lm_head_multiplier=0.5, key_multiplier=0.7, attention_in_multiplier=1.1,
                        attention_out_multiplier=0.9, mamba_in_multiplier=1.2, mamba_out_multiplier=0.8,
                        mamba_proj_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9], mlp_multipliers=[1.1, 0.6])

# GPT-OSS-shaped: attention sinks, a window of 8 on every other layer (shorter than the 16-token sequence), q/k/v/o
# biases, YaRN, a biased router and clamped-SwiGLU experts with biases
MODELS["gptoss"] = dict(arch="gpt_oss", hidden_size=32, intermediate_size=32, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, vocab_size=128, qkv_bias=True, attn_out_bias=True,
                        attention_sinks=True, sliding_window=8, window_attn_skip_freq=2, rotary_scaling_factor=4.0,
                        original_max_position_embeddings=16, yarn_truncate=False, num_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=16, moe_router_bias=True, moe_expert_bias=True,
                        moe_activation="clamped_swiglu", moe_swiglu_alpha=1.702, moe_swiglu_limit=1.5)

# DeepSeek-V4-shaped: sliding, CSA (the indexer keeps 2 entries), HCA layers on the 16-token sequence, 2
# hyper-connection streams, layer 0 hash-routed, sqrt-softplus routing with an expert bias, clamped SwiGLU
MODELS["dsv4"] = dict(arch="deepseek_v4", hidden_size=32, intermediate_size=16, num_layers=4, num_heads=4,
                      num_kv_heads=1, head_dim=16, qk_pos_emb_head_dim=8, vocab_size=128, attention_sinks=True,
                      attention_layer_types=["sliding_attention", "compressed_sparse_attention",
                                             "heavily_compressed_attention", "compressed_sparse_attention"],
                      csa_compress_rate=2, hca_compress_rate=4, q_lora_rank=16, o_groups=2, o_lora_rank=8,
                      index_n_heads=2, index_head_dim=8, index_topk=2, sliding_window=4, hc_mult=2,
                      hc_sinkhorn_iters=5, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                      moe_shared_expert_intermediate_size=16, moe_router_score_function="sqrtsoftplus",
                      moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=1.5,
                      moe_activation="clamped_silu", moe_swiglu_limit=1.5, moe_hash_layers=1, norm_eps=1e-6)
# ... with an MTP module (its block sliding-window and score-routed, the streams through e_proj / h_proj, its own head)
MODELS["dsv4_mtp"] = {**MODELS["dsv4"], "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5}

# Qwen2.5-VL-shaped: the "qwen2" decoder with M-RoPE behind a 2-block vision tower (2-pixel patches of 2 frames, a
# window of one merged patch, block 1 full) and its patch merger; rows of the batches hold images (VL_GRIDS)
VL_IMAGE = 127  # its image token
MODELS["vl"] = {**MODELS["qwen2"], "arch": "qwen2_5_vl", "mrope_section": [2, 1, 1], "vision_depth": 2,
                "vision_hidden_size": 16, "vision_intermediate_size": 32, "vision_num_heads": 2, "vision_patch_size": 2,
                "vision_window_size": 4, "vision_fullatt_block_indexes": [1], "image_token_id": VL_IMAGE}
# row r's images' (frames, height, width) patch grids: VL_GRIDS[r] (2 images in a row; text-only rows, whole
# micro-batches of them on one data-parallel rank while the other's have images)
VL_GRIDS = ([(1, 4, 4)], [(1, 2, 4)], [(1, 2, 2), (1, 2, 2)], [], [], [], [(1, 2, 2)], [])


def parse_case(text: str) -> tuple[dict, dict]:
    layout, *opts = text.split(":")
    options = dict(o.split("=", 1) for o in opts)
    return parse_layout(layout), options


def make_config(layout: dict, opts: dict) -> Config:
    pc = apply_layout(ParallelConfig(), layout, opts.get("schedule"))
    if "split" in opts:
        pc.pp_layer_split = [int(x) for x in opts["split"].split("-")]
    pc.sequence_parallel = opts.get("sp", "1") == "1"
    pc.fsdp_reshard_after_forward = opts.get("reshard", "1") == "1"
    if "mb" in opts:
        pc.pp_microbatches = int(opts["mb"])
    model = ModelConfig(**MODELS[opts.get("model", "base")])
    train = TrainConfig(micro_batch_size=MICRO, global_batch_size=GLOBAL_BATCH, recompute=opts.get("recompute", "none"),
                        precision=opts.get("precision", "fp32"), compile=opts.get("compile", "0") == "1")
    cfg = Config(model=model, parallel=pc, train=train)
    cfg.data.seq_length = SEQ
    return cfg


def build(cfg: Config):
    """The case's model, identical on every rank (and in the reference)."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    if cfg.model.moe_router_bias_update_rate == 0.0 and cfg.model.moe_router_enable_expert_bias:
        from megapipe.models.moe import moe_layers

        for _, moe in moe_layers(model):  # "moe_skew": experts 0 and 1 win every choice
            moe.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
    return model


def batches(cfg: Config, steps: int, masked: bool = False):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, cfg.model.vocab_size, (steps, GLOBAL_BATCH, SEQ + 1), generator=g)
    out = [{"tokens": d[:, :-1], "labels": d[:, 1:]} for d in data]
    if cfg.model.vision_depth:
        for b in out:
            add_images(b, g)
    if masked:  # rows keep 16, 1, 9, 0, 4, 16, 6, 11 tokens: a per-micro-batch or per-rank mean weights them wrongly
        keep = torch.tensor([16, 1, 9, 0, 4, 16, 6, 11])
        for b in out:
            b["loss_mask"] = torch.arange(SEQ)[None] < keep[:, None]
    return out


def add_images(batch: dict, g: torch.Generator) -> None:
    """The "vl" model's images (VL_GRIDS) in the rows of ``batch``: each image's tokens from position 1 on, one text
    token between two images, random patches (flat over the rows, as a loader gives them)."""
    tokens, grids = batch["tokens"].clone(), []
    tokens[tokens == VL_IMAGE] = 0
    for r in range(tokens.shape[0]):
        at = 1
        for t, h, w in VL_GRIDS[r % len(VL_GRIDS)]:
            tokens[r, at: at + t * h * w // 4] = VL_IMAGE
            at += t * h * w // 4 + 1
            grids.append((t, h, w))
    batch["tokens"] = tokens
    batch["image_grid_thw"] = torch.tensor(grids)
    batch["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 2 * 2, generator=g)


def micro(batch: dict, lo: int, hi: int, size: int) -> list[dict]:
    if "image_grid_thw" not in batch:
        return [{k: v[i:i + size] for k, v in batch.items()} for i in range(lo, hi, size)]
    from megapipe.models.vision import flat_images, rowwise_images

    rows = dict(batch)  # the images row by row, so that a slice of rows takes theirs
    rows["pixel_values"], rows["image_grid_thw"] = rowwise_images(batch["tokens"], batch["pixel_values"],
                                                                  batch["image_grid_thw"], VL_IMAGE, 2)
    out = []
    for i in range(lo, hi, size):
        mb = {k: v[i:i + size] for k, v in rows.items()}
        mb["pixel_values"], mb["image_grid_thw"] = flat_images(mb["pixel_values"], mb["image_grid_thw"])
        out.append(mb)
    return out


def sgd(model) -> torch.optim.Optimizer:
    """Plain SGD as the trainer builds it: fused on plain tensors, foreach once any parameter is a DTensor (which
    takes no mix of plain tensors and DTensors, so every layout must leave none)."""
    return build_optimizer(model, OptimConfig(optimizer="sgd", weight_decay=0.0), LR)


def muon(model) -> torch.optim.Optimizer:
    """Muon (whole matrices orthogonalised, experts one by one) + AdamW for the rest, as the trainer builds it."""
    return build_optimizer(model, OptimConfig(optimizer="muon", weight_decay=0.1), MUON_LR)


def optimizer(model, opts: dict) -> torch.optim.Optimizer:
    return muon(model) if opts.get("optim") == "muon" else sgd(model)


def num_steps(opts: dict) -> int:
    return MUON_STEPS if opts.get("optim") == "muon" else STEPS


_REFERENCE: dict = {}


def reference(cfg: Config, masked: bool = False, opts: dict | None = None) -> dict:
    """Single-process losses, step-1 gradients, clip norm and final weights (cached per model, masking and
    optimizer), the global batch in one micro-batch (an MoE model: in the layouts' micro-batches). With Muon on a
    model with hyper-connections, also "hc_order_abs": how far the hyper-connections' weights of one process drift
    from themselves when only the micro-batches (the order of the gradients' fp32 sums) change (see the top), and
    "param_order_abs": how far the other weights drift with them."""
    opts = opts or {}
    key = json.dumps(cfg.model.__dict__, sort_keys=True, default=str) + str(masked) + opts.get("optim", "sgd")
    if key not in _REFERENCE:
        out = _REFERENCE[key] = train_reference(cfg, masked, opts, MICRO if cfg.model.is_moe else GLOBAL_BATCH)
        if opts.get("optim") == "muon" and cfg.model.hc_mult:
            twin = train_reference(cfg, masked, opts, GLOBAL_BATCH // 2)["params"]
            hc = hyper_connection_params(build(cfg))
            out["hc_order_abs"] = max_diff(((n, twin[n]) for n in hc), out["params"])
            out["param_order_abs"] = max_diff(((n, twin[n]) for n in twin if n not in hc), out["params"])
    return _REFERENCE[key]


def train_reference(cfg: Config, masked: bool, opts: dict, size: int) -> dict:
    """reference() in micro-batches of ``size`` rows."""
    model = build(cfg)
    opt = optimizer(model, opts)
    trivial = ParallelDims()
    out = {"losses": [], "biases": [], "moe": [], "init": {n: p.detach().clone() for n, p in model.named_parameters()}}
    for i, batch in enumerate(batches(cfg, num_steps(opts), masked)):
        opt.zero_grad()
        mbs = [batch] if size == GLOBAL_BATCH else micro(batch, 0, GLOBAL_BATCH, size)
        result = train_step(model, mbs, trivial)
        out["losses"].append(result.item())
        out["moe"].append({k: v for k, v in result.metrics.items() if k.startswith("moe/")})
        if i == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        norm = clip_grad_norm_(model, CLIP, trivial)
        if i == 0:
            out["norm"] = norm.item()
        opt.step()
        update_expert_biases(model, result.expert_load)
        out["biases"].append(expert_biases(model))
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    last = batches(cfg, 1, masked)[0]
    out["eval"] = eval_step(model, micro(last, 0, GLOBAL_BATCH, MICRO) if cfg.model.is_moe else [last], trivial).item()
    return out


def hyper_connection_params(model) -> set[str]:
    """Names of the hyper-connections' parameters (DeepSeek-V4's ``fn``, ``base``, ``scale``; AdamW's under Muon)."""
    from megapipe.models.hyper_connections import HyperConnection, HyperHead

    kinds = (HyperConnection, HyperHead)
    return {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, kinds) for p, _ in mod.named_parameters()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def expert_biases(model) -> dict:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}


def moe_rel(got: dict, want: dict) -> float:
    """Largest relative difference of the MoE metrics (balancing losses, load, dropped fraction)."""
    if set(got) != set(want):
        raise AssertionError(f"MoE metrics differ: {sorted(set(got) ^ set(want))[:4]}")
    return max([abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in want], default=0.0)


def max_diff(named, ref: dict) -> float:
    worst = 0.0
    for name, t in named:
        if t is None:
            raise AssertionError(f"{name} has no gradient")
        worst = max(worst, (full(t).detach().float() - ref[name].float()).abs().max().item())
    return worst


def max_rel(named, ref: dict) -> float:
    """The largest ||t - ref|| / ||ref|| over tensors (whole-tensor norms, so tiny entries do not dominate)."""
    worst = 0.0
    for name, t in named:
        r = ref[name].float()
        worst = max(worst, ((t.float() - r).norm() / r.norm().clamp_min(1e-30)).item())
    return worst


def run_case(text: str) -> dict:
    from megapipe.parallel.parallelize import parallelize_model

    layout, opts = parse_case(text)
    cfg = make_config(layout, opts)
    masked = opts.get("mask") == "1"
    ref = reference(cfg, masked, opts)
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size(), cfg.train, cfg.model, SEQ)
    dims.build_mesh("cpu")
    fused = opts.get("fused") == "1"  # the fused output + cross-entropy (vs the reference's logits)
    model = parallelize_model(build(cfg), dims, cfg)
    opt = optimizer(model, opts)
    per_rank = GLOBAL_BATCH // dims.dp_size
    lo = dims.dp_rank * per_rank
    res = {"loss_rel": 0.0, "bias_abs": 0.0, "moe_rel": 0.0}
    init = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    for i, batch in enumerate(batches(cfg, num_steps(opts), masked)):
        opt.zero_grad()
        result = train_step(model, micro(batch, lo, lo + per_rank, MICRO), dims, fused=fused)
        loss = result.item()
        res["loss_rel"] = max(res["loss_rel"], abs(loss - ref["losses"][i]) / abs(ref["losses"][i]))
        res["moe_rel"] = max(res["moe_rel"], moe_rel({k: v for k, v in result.metrics.items() if k.startswith("moe/")},
                                                     ref["moe"][i]))
        if i == 0:  # each gathered once (a collective per tensor: most of a case's checking time)
            grads = {n: p.grad if p.grad is None else full(p.grad) for n, p in model.named_parameters()
                     if p.requires_grad}  # not a frozen indexer
            res["grad_abs"] = max_diff(grads.items(), ref["grads"])
            res["grad_rel"] = max_rel(grads.items(), ref["grads"])
        norm = clip_grad_norm_(model, CLIP, dims)
        if i == 0:
            res["norm_rel"] = abs(norm.item() - ref["norm"]) / ref["norm"]
        opt.step()
        update_expert_biases(model, result.expert_load)
        res["bias_abs"] = max([res["bias_abs"], *[(b - ref["biases"][i][n]).abs().max().item()
                                                  for n, b in expert_biases(model).items()]])
        if cfg.model.moe_router_enable_expert_bias:  # at some step: rate * sign steps can come back to 0
            moved = float(any(b.abs().max() > 0 for b in ref["biases"][i].values()))
            res["bias_moved"] = max(res.get("bias_moved", 0.0), moved)
        if i == 0 and cfg.model.moe_router_bias_update_rate == 0.0 and result.expert_load:
            # the skewed model: no token for experts 2 and 3, whose ep ranks got nothing to compute
            res["idle_experts"] = float(all(load[2:].sum() == 0 for load in result.expert_load.values()))
    # the hyper-connections' weights apart (see the top): "hc_abs", beside one process's own drift ("hc_order_abs")
    hc = hyper_connection_params(model)
    params = {n: full(p.detach()) for n, p in model.named_parameters()}
    res["param_abs"] = max_diff(((n, p) for n, p in params.items() if n not in hc), ref["params"])
    if hc:
        res["hc_abs"] = max_diff(((n, p) for n, p in params.items() if n in hc), ref["params"])
        res["hc_order_abs"] = ref.get("hc_order_abs", 0.0)
        res["param_order_abs"] = ref.get("param_order_abs", 0.0)
    # what the steps changed, against what they changed in the reference: 1.0 for a run that never updates
    updates = ((n, p - init[n]) for n, p in params.items() if n not in hc)
    res["update_rel"] = max_rel(updates, {n: ref["params"][n] - ref["init"][n] for n in ref["params"]})
    # master weights and their gradients stay fp32 whatever the compute precision
    res["not_fp32"] = float(any(p.dtype != torch.float32 or (p.requires_grad and p.grad.dtype != torch.float32)
                                for p in model.parameters()))
    last = micro(batches(cfg, 1, masked)[0], lo, lo + per_rank, MICRO)
    res["eval_rel"] = abs(eval_step(model, last, dims, fused=fused).item() - ref["eval"]) / ref["eval"]
    res["n_params_checked"] = len(list(model.parameters()))
    return res


def full_state(model, opt) -> dict:
    """name -> full tensor of every parameter and AdamW state of the whole model (gathered from all ranks)."""
    names = {id(p): n for n, p in model.named_parameters()}
    mine = {}
    for n, p in model.named_parameters():
        mine[f"model.{n}"] = full(p.detach()).clone()
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                mine[f"optim.{names[id(p)]}.{k}"] = full(v).clone()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


def run_checkpoint_case(text: str, root: str) -> dict:
    from megapipe.checkpoint import load_checkpoint, save_checkpoint
    from megapipe.parallel.parallelize import parallelize_model

    layout, opts = parse_case(text)
    cfg = make_config(layout, opts)
    dims = ParallelDims.from_config(cfg.parallel, dist.get_world_size(), cfg.train, cfg.model, SEQ)
    dims.build_mesh("cpu")
    model = parallelize_model(build_model(cfg.model, seed=cfg.train.seed), dims, cfg)
    if opts.get("optim") == "muon":
        opt = muon(model)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    per_rank = GLOBAL_BATCH // dims.dp_size
    lo = dims.dp_rank * per_rank
    data = batches(cfg, 3)

    def one_step(batch) -> float:
        opt.zero_grad()
        loss = train_step(model, micro(batch, lo, lo + per_rank, MICRO), dims).item()
        clip_grad_norm_(model, CLIP, dims)
        opt.step()
        return loss

    if "save" in opts:
        base = f"{root}/{opts['save']}"
        one_step(data[0])
        one_step(data[1])
        save_checkpoint(base, 2, model, opt)
        ref = full_state(model, opt)
        ref["loss3"] = torch.tensor(one_step(data[2]))
        if dist.get_rank() == 0:
            torch.save(ref, f"{base}.ref.pt")
        dist.barrier()
        return {"tensors": len(ref) - 1}
    base = f"{root}/{opts['load']}"
    load_checkpoint(f"{base}/step_00000002", model, opt)
    ref = torch.load(f"{base}.ref.pt")
    got = full_state(model, opt)
    res = {"tensors": len(got)}
    if set(got) != set(ref) - {"loss3"}:
        raise AssertionError(f"state names differ: {sorted(set(got) ^ (set(ref) - {'loss3'}))[:6]}")
    res["ckpt_model_abs"] = max((got[k] - ref[k]).abs().max().item() for k in got if k.startswith("model."))
    res["ckpt_optim_abs"] = max((got[k] - ref[k]).abs().max().item() for k in got if k.startswith("optim."))
    res["resume_loss_rel"] = abs(one_step(data[2]) - ref["loss3"].item()) / ref["loss3"].item()
    return res


def reduce_max(res: dict) -> dict:
    keys = [k for k in res if k not in ("n_params_checked", "tensors")]
    t = torch.tensor([res[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = dict(zip(keys, t.tolist(), strict=True))
    if "n_params_checked" in res:
        n = torch.tensor([res["n_params_checked"]])
        dist.all_reduce(n)
        out["n_params_checked"] = int(n.item())
    if "tensors" in res:
        out["tensors"] = res["tensors"]
    return out


def main() -> None:
    out_path, cases = sys.argv[1], sys.argv[2:]
    faulthandler.enable()  # an abort (gloo's, a kernel's) leaves the Python stacks in the failure message
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    torch.use_deterministic_algorithms(True)
    results = {}
    for case in cases:
        try:
            if ":save=" in case or ":load=" in case:
                results[case] = reduce_max(run_checkpoint_case(case, os.path.dirname(os.path.abspath(out_path))))
            else:
                results[case] = reduce_max(run_case(case))
        except Exception as e:  # report and go on: one broken case must not hide the others
            results[case] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            print(f"[rank {dist.get_rank()}] {case}: {results[case]['trace']}", file=sys.stderr, flush=True)
        dist.barrier()
        if dist.get_rank() == 0:
            print(case, results[case], flush=True)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
