"""Layout planner: memory and FLOPs per rank (owned by the planning engineer).

``plan(cfg, gpus, gpu_type)`` estimates, for a config and a GPU count, the parameters and memory of every rank of
the config's layout, the step FLOPs and time, and ranks every valid dp_replicate x dp_shard x cp x tp x pp layout.
Layouts are validated by ``ParallelDims.from_config`` (the rules the trainer applies), never re-implemented here.

Memory model (bytes per rank; megapipe keeps parameters in fp32 in every precision: autocast computes in bf16/fp16,
so the fp32 parameters ARE the master weights, there is no separate master copy):
- weights 4 B/param, gradients 4 B/param (fp32), AdamW moments 8 B/param (SGD: 0), all divided by the FSDP
  group dp_shard*cp when parameters are sharded (ZeRO-3); per-rank parameters: layer matmuls / tp, norms and
  row-parallel biases replicated, embedding and output split by vocabulary; embedding on the first pipeline stage,
  final norm + output on the last (a tied output keeps a copy of the embedding there, as Megatron does).
- compute copies: bf16/fp16 without FSDP: autocast's 2 B/param copies of the matmul weights, saved for backward
  (one layer's when blocks are recomputed); with FSDP: the unsharded parameters (compute dtype) of two blocks
  (current + prefetch) or of the root module (embedding + head) whichever is larger, plus two blocks' unsharded
  gradients before their reduce-scatter; all parameters when fsdp_reshard_after_forward=false.
- gradients and activations: zero_grad(set_to_none) frees gradients after each step and backward frees
  activations while it creates gradients, so with one micro-batch per step the peak holds the larger of the two;
  with gradient accumulation or pipelining they coexist (``RankMemory.total``).
- activations per layer and token (``layer_activation_bytes``): counted from what autograd saves in our block
  (measured with saved-tensor hooks, see tools/check_plan_memory.py), Korthikanti et al. 2022's method adapted:
  no dropout masks; RMSNorm/LayerNorm and the residual stream stay fp32 under autocast; the column-parallel
  linears' inputs are saved all-gathered (DTensor SP does not re-gather in backward like Megatron does); the
  fused SDPA kernels keep q, k, v, the output and a logsumexp, not the a*s*s score matrix, so the paper's
  5as/h term becomes 4 bytes per head and token; GQA k/v count kv_heads*head_dim; SwiGLU keeps 4 f-wide tensors
  (w1 out, w3 out, silu out, product), GeLU 2. Selective recompute (megapipe's op-level policy: matmul and
  attention outputs saved, element-wise ops recomputed) keeps the layer input + those outputs; full recompute only
  the fp32 layer input; both add one layer's full activations while that layer is recomputed in backward.
- the head: final norm + its linear input + the fp32 log-softmax over the vocabulary (held), plus two more
  vocabulary-wide fp32 buffers while the loss is differentiated (transient; three under TP's loss_parallel).
- pipeline: stage i of a 1F1B pipeline holds min(pp - i, m) micro-batches in flight (the first stage pp), GPipe
  all m; interleaved and V schedules: the first rank pp*(1 + (pp-1)/(pp*v)) micro-batches of all its layers
  (Korthikanti et al.'s interleaved formula, v = 2 for V schedules), later ranks min(m, pp - i + 1).
- pipeline outputs: torch.distributed.pipelining would keep every micro-batch's logits (e*V/tp bytes per token) on
  the last stage until the step ends; megapipe.parallel.step tells it not to (``PP_KEEPS_OUTPUTS`` = False). It does
  keep each in-flight micro-batch's stage output until that micro-batch's backward (its forward cache): on the last
  stage the logits (e*V/tp per token, which a single process frees once the loss has its log-softmax), elsewhere
  the last block's output (4h, split by tp under SP). Leaving these out made the last stage ~17% low.
- MoE layers (megapipe.models.moe): attention as dense; the routed experts are split by ep (never by tp: the MoE
  layer runs on the TP group's whole sequence) and FSDP-sharded over dp_shard*cp/ep; router and shared experts
  like the other replicated weights. Their activations (``moe_layer_activation_bytes``) are counted per token of the
  whole sequence (not split by TP), from what autograd saves; the token all-to-all moves 4 x tokens x k x h x
  (ep-1)/ep activations per MoE layer and micro-batch (dispatch and combine, forward and backward).
- hybrid Transformer-Mamba layers (megapipe.models.hybrid, parallel_hybrid): each kind counts its own sub-layers
  (``block_activation_bytes``): a single-mixer layer (M Mamba-2, * attention, - MLP, E MoE) one norm's residual
  terms + its mixer's; Falcon-H1's P layer two norms + the Mamba mixer, attention and MLP. The Mamba mixer
  (``mamba_mixer_activation_bytes``) is counted from what autograd saves in our PyTorch scan: per token, the
  in-projection output, the conv and SiLU, and the chunked scan's inputs (x*dt, the log-decays, B and C; it
  recomputes the rest in backward) + the states entering each chunk (H*P*N per chunk, so H*P*N/Q per token);
  heads and groups split by tp. Outside TP a mixer also saves its in-projection weights concatenated (one matmul):
  a compute copy per Mamba layer under fp32 or FSDP (autocast's cast of it is the copy counted above otherwise).
- not modelled: qk_norm's extra saved tensors (~8 B per q/kv element), context parallelism's ring-attention K/V
  buffers, the optimizer step's temporaries, NCCL buckets (in the fixed overhead).
- a fixed overhead (CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation): OVERHEAD_BYTES.

Step time: model FLOPs ``flops_per_token * tokens`` (x4/3 hardware FLOPs under full recompute; selective
recomputes element-wise ops only, ~0 FLOPs; an MoE model's FLOPs count its active parameters) at MFU ``mfu`` times
an efficiency for the layout (``efficiency``): pipeline bubble (p-1)/(v*m+p-1), and per doubling of tp/cp an
exposed-communication loss, a small loss when the data-parallel group leaves the node. An MoE model adds its token
all-to-all and what of its experts' FSDP traffic compute does not hide, timed from their volumes at NVLink or
network bandwidth (``moe_comm_seconds``): that is what tells ep sizes apart. These factors are rough, stated
assumptions for ranking, not measurements.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from megapipe.errors import ConfigError
from megapipe.models import build_model, flops_per_token
from megapipe.models.spec import spec_for, tp_split_numel
from megapipe.models.transformer import attention_dims, kv_cache_values_per_token, layer_flops_per_token
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.pp import layer_split, stage_ids

GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16 tensor-core peak per GPU


GPUS = {
    "h100": GpuSpec("H100 80GB", 80 * GB, 989e12),
    "h200": GpuSpec("H200 141GB", 141 * GB, 989e12),
    "a100": GpuSpec("A100 80GB", 80 * GB, 312e12),
}
GPUS_PER_NODE = 8
OVERHEAD_BYTES = 2.0 * GB  # CUDA context ~0.5-1 GB, NCCL + cuBLAS workspaces, caching-allocator fragmentation
DEFAULT_MFU = 0.40
TP_LOSS_PER_DOUBLING = 0.05  # exposed TP all-gather/reduce-scatter per doubling of tp (NVLink, within a node)
CP_LOSS_PER_DOUBLING = 0.05  # exposed ring-attention K/V exchange per doubling of cp
DP_OFF_NODE_LOSS = 0.03  # gradient reduce-scatter/all-gather over the network when the FSDP/DP group spans nodes
# MoE communication is timed from its volume (it decides between ep sizes): per-GPU bandwidth within a node
# (NVLink, H100/H200 ~450 GB/s per direction) and across nodes (one 400 Gb/s NIC per GPU ~50 GB/s)
NVLINK_BYTES_PER_S = 450e9
NETWORK_BYTES_PER_S = 50e9
# torch.distributed.pipelining keeps the last stage's output (the logits) of every micro-batch until the step ends
# unless schedule.step(..., return_outputs=False), which megapipe.parallel.step passes (torch 2.13).
PP_KEEPS_OUTPUTS = False
RECOMPUTE_MODES = ("none", "selective", "full")
LAYOUT_DIMS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def gpu_spec(name: str) -> GpuSpec:
    key = name.lower()
    if key not in GPUS:
        raise ConfigError(f"--gpu-type {name!r} is not known (allowed: {', '.join(sorted(GPUS))})")
    return GPUS[key]


# --------------------------------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class LayerCounts:
    """One block's parameters: ``tp`` split by tensor parallelism, ``rep`` replicated on TP ranks (norms, row-parallel
    biases, an MoE layer's router and shared experts), ``experts`` the routed experts (split by ep)."""

    kind: str
    tp: int
    rep: int
    experts: int = 0

    @property
    def total(self) -> int:
        return self.tp + self.rep + self.experts


@dataclass
class ParamCounts:
    """Parameters by part; ``*_tp`` is split by tensor parallelism, ``*_rep`` is replicated on TP ranks."""

    embedding_tp: int  # token embedding (vocabulary-parallel)
    embedding_rep: int  # learned position embedding
    layers: list[LayerCounts]
    head_tp: int  # output projection (0 when tied)
    head_rep: int  # final norm
    tied: bool
    active_fraction: float = 1.0  # of the routed experts, what one token uses (k / E)
    # multi-token prediction modules (embedding and head shared, not counted again): apart from ``total`` and
    # ``active``, which count the main model as published figures do (DeepSeek-V3: 671B / 37B without MTP)
    mtp: int = 0
    mtp_experts: int = 0
    mtp_tp: int = 0  # of ``mtp``, what the blocks' TP plans split
    vision: int = 0  # a vision-language model's vision tower and patch merger: replicated, on the first stage

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _uniform(self) -> LayerCounts:
        kinds = set(self.layers)
        if len(kinds) != 1:
            raise ValueError("layers differ (an MoE model): use ParamCounts.layers")
        return self.layers[0]

    @property
    def layer_tp(self) -> int:
        return self._uniform().tp

    @property
    def layer_rep(self) -> int:
        return self._uniform().rep

    @property
    def layer(self) -> int:
        return self._uniform().total

    @property
    def embedding(self) -> int:
        return self.embedding_tp + self.embedding_rep

    @property
    def head(self) -> int:
        return self.head_tp + self.head_rep

    @property
    def experts(self) -> int:
        return sum(lc.experts for lc in self.layers)

    @property
    def total(self) -> int:
        return self.embedding + sum(lc.total for lc in self.layers) + self.head + self.vision

    @property
    def active(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        return self.total - round(self.experts * (1 - self.active_fraction))

    @property
    def mtp_active(self) -> int:
        return self.mtp - round(self.mtp_experts * (1 - self.active_fraction))

    def by_kind(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for lc in self.layers:
            d = out.setdefault(lc.kind, {"layers": 0, "params": lc.total, "experts": lc.experts})
            d["layers"] += 1
        return out


def param_counts(m) -> ParamCounts:
    """Parameter counts of ``Transformer(m)`` by part, taken from the model built on the meta device; a block's
    TP-split share comes from its kind's tensor-parallel plan (megapipe.models.spec)."""
    if m.vocab_size is None:
        raise ConfigError("model.vocab_size is not set: the planner needs it (e.g. --set model.vocab_size=32000)")
    import json

    key = json.dumps(dataclasses.asdict(m), sort_keys=True)
    if key not in _PARAM_COUNTS:
        _PARAM_COUNTS[key] = _count(m)
    return _PARAM_COUNTS[key]


_PARAM_COUNTS: dict[str, ParamCounts] = {}


def _count(m) -> ParamCounts:
    model = build_model(m, device="meta")

    def numel(module) -> int:
        return 0 if module is None else sum(p.numel() for p in module.parameters())

    layers = []
    for block in model.layers.values():
        split, rest = tp_split_numel(block)
        experts = numel(block.moe.experts) if hasattr(block, "moe") else 0
        layers.append(LayerCounts(spec_for(block).name, split, rest - experts, experts))
    mtp = list(model.mtp or [])
    return ParamCounts(
        mtp_tp=sum(tp_split_numel(module.block)[0] for module in mtp),
        mtp=sum(numel(module) for module in mtp),
        mtp_experts=sum(numel(module.block.moe.experts) for module in mtp if hasattr(module.block, "moe")),
        embedding_tp=numel(model.tok_embeddings), embedding_rep=numel(model.pos_embeddings), layers=layers,
        head_tp=numel(model.output), head_rep=numel(model.norm), tied=m.tie_embeddings,
        active_fraction=m.moe_router_topk / m.num_experts if m.is_moe else 1.0,
        vision=numel(getattr(model, "visual", None)),
    )


# --------------------------------------------------------------------------------------------------- activations


def _norm_bytes(m, tp: int, sp: bool) -> float:
    """One pre-norm sub-layer's fp32 residual terms: its input 4h and, for RMSNorm, the normalised tensor 4h and the
    rsqrt (LayerNorm: mean and rstd, 8); split by tp under sequence parallelism."""
    h = m.hidden_size
    return (4 * h + (4 * h + 4 if m.norm_type == "rmsnorm" else 8)) / (tp if (tp > 1 and sp) else 1)


def _attention_bytes(m, precision: str, recompute: str, tp: int) -> float:
    """The attention sub-layer past its norm. none: the linear inputs (fp32 one shared 4h, autocast one 2h cast per
    q/k/v linear) + q and k after RoPE, v, the output (e each) and the fp32 logsumexp, split by tp; selective: the
    q/k/v/output and logsumexp, split by tp, + wo's full-sequence output e*h."""
    h, hd = m.hidden_size, m.dim_per_head
    q, kv, a = m.num_heads * hd, m.kv_heads * hd, m.num_heads
    if m.multi_latent_attention:  # MLA: per head q/k qk wide, v v wide (its small latents are not modelled)
        qk, v = attention_dims(m)
        q, kv = m.num_heads * qk, m.num_heads * (qk + v) // 2
    e = DTYPE_BYTES[precision]
    if recompute == "selective":
        return (e * (2 * q + 2 * kv) + 4 * a) / tp + e * h
    return (4 * h if e == 4 else 2 * h * 3) + (e * (2 * q + 2 * kv) + 4 * a) / tp


def _mlp_bytes(m, precision: str, recompute: str, tp: int) -> float:
    """The MLP sub-layer past its norm. none: the linear inputs (fp32 4h, autocast a 2h cast per w1 [, w3]) + 4
    f-wide tensors for SwiGLU (w1 out, w3 out, silu out, product), 2 for GeLU / squared ReLU, split by tp;
    selective: the w1 [, w3] outputs, split by tp, + w2's full-sequence output e*h."""
    h, f, e = m.hidden_size, m.intermediate_size, DTYPE_BYTES[precision]
    swiglu = m.activation == "swiglu"
    if recompute == "selective":
        return e * (2 if swiglu else 1) * f / tp + e * h
    return (4 * h if e == 4 else 2 * h * (2 if swiglu else 1)) + e * (4 if swiglu else 2) * f / tp


def layer_activation_bytes(m, precision: str, recompute: str, tp: int = 1, sp: bool = True) -> float:
    """Bytes one transformer block keeps for backward, per token of the micro-batch (sequence = what this rank holds).

    Terms (h hidden, q = heads*head_dim, kv = kv_heads*head_dim, f ffn, a heads, e = 2 in bf16/fp16 else 4):
      residual + norm (fp32 even under autocast): layer input 4h, attention-sublayer output 4h, and per RMSNorm
      its normalised fp32 tensor 4h (LayerNorm keeps only mean/rstd); split by tp under sequence parallelism;
      linear inputs (all-gathered under SP, so not split): fp32 one shared 4h per sub-layer, under autocast one
      2h cast per linear (q, k, v; w1 [, w3]);
      attention (split by tp): q and k after RoPE, v, the output (e each) and the fp32 logsumexp (4 per head);
      MLP (split by tp): 4 f-wide tensors for SwiGLU, 2 for GeLU.
    """
    base = _block_base(m, recompute, tp, sp, norms=2)
    if recompute == "full":
        return base
    return base + _attention_bytes(m, precision, recompute, tp) + _mlp_bytes(m, precision, recompute, tp)


def _block_base(m, recompute: str, tp: int, sp: bool, norms: int) -> float:
    """What every block keeps besides its sub-layers: without recompute its norms' residual terms; with selective or
    full recompute only its fp32 input (4h, split by tp under sequence parallelism)."""
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"train.recompute = {recompute!r} is not valid (allowed: {', '.join(RECOMPUTE_MODES)})")
    if recompute == "none":
        return norms * _norm_bytes(m, tp, sp)
    return 4 * m.hidden_size / (tp if (tp > 1 and sp) else 1)


def mamba_mixer_activation_bytes(m, precision: str, recompute: str, tp: int = 1) -> float:
    """Bytes a Mamba-2 mixer (megapipe.models.mamba + ssd) keeps for backward per token, from its in-projection's
    input to its out-projection's input, as autograd saves them (measured with saved-tensor hooks). Heads H, head
    dim P, groups G, state N, d_inner I = H*P, conv channels C = I + 2GN, chunk Q (all but h split by tp: TP
    splits heads and groups); e = 2 under autocast (matmul operands are cast to it) else 4:
      in-projection: its input (fp32 4h; autocast a 2h cast, five under TP where the projections run one by one)
      and output z|x|B|C|dt (e*(2I + 2GN + H), one storage that the conv, the gate and dt keep alive);
      conv: its output e*C (its input is the projection's); fp32: the SiLU output 4C, autocast: the scan's fp32
      copy of x 4I; dt before and after softplus 8H (+4H after dt limits);
      chunked SSD scan (fp32 whatever the autocast): x*dt 4HP, the log-decays 4H, B and C 8GN (their chunked
      copies), the states entering each chunk (HPN each) 4HPN/Q per token;
      gated RMSNorm (Nemotron-H's, norm of y*silu(z)): y, silu(z), their product, the normalised tensor (fp32 each,
      autocast also z's fp32 copy and the normalised cast: 20I either way) + the out-projection input (4I; autocast
      2I) and the per-group rsqrt 4G; norm before the gate (Falcon-H1's): 20I (autocast 22I) + 4G; no norm:
      y, silu(z) and their product 3eI.
    Selective recompute keeps the matmul outputs: the in-projection's, the scan's (fp32: the log-decays' segment
    sums 4HQ, C.B^T 4GQ, two 4HP, the chunk states 4HPN/Q), split by tp, and the out-projection's full-sequence
    output e*h; full recompute is counted by the block (its input only)."""
    h, e = m.hidden_size, DTYPE_BYTES[precision]
    H, P, N, Q = m.mamba_heads / tp, m.mamba_head_dim, m.mamba_state_dim, m.mamba_chunk_size
    G = m.mamba_num_groups / tp
    inner, gn = H * P, G * N
    proj = 2 * inner + 2 * gn + H
    states = H * P * N / Q
    if recompute == "selective":
        return e * proj + 4 * (H * Q + G * Q + 2 * H * P + states) + e * h
    proj_in = 4 * h if e == 4 else 2 * h * (1 if tp == 1 else 5)
    conv = e * (inner + 2 * gn) + 4 * (inner + 2 * gn if e == 4 else inner)
    lo, hi = m.mamba_dt_limit
    dt = 8 * H + (4 * H if lo > 0 or hi != math.inf else 0)
    scan = 4 * H * P + 4 * H + 8 * gn + 4 * states
    if not m.mamba_gated_norm:
        gate = 3 * e * inner
    elif m.mamba_norm_before_gate:
        gate = (20 if e == 4 else 22) * inner + 4 * G
    else:
        gate = 20 * inner + 4 * G
    return proj_in + e * proj + conv + dt + scan + gate


SINGLE_MIXER_KINDS = ("mamba", "attention", "mlp", "moe_mlp")  # a hybrid model's layers: x + mixer(norm(x))


def single_mixer_activation_bytes(m, kind: str, precision: str, recompute: str, tp: int = 1,
                                  sp: bool = True) -> float:
    """Bytes a single-mixer block (megapipe.models.hybrid: Mamba-2, attention, MLP or MoE alone) keeps for backward
    per token of this rank's sequence: one norm's residual terms (``_norm_bytes``) + the mixer's; selective
    recompute: the fp32 layer input + the mixer's matmul outputs; full: the fp32 layer input."""
    base = _block_base(m, recompute, tp, sp, norms=1)
    if recompute == "full":
        return base
    if kind == "mamba":
        return base + mamba_mixer_activation_bytes(m, precision, recompute, tp)
    if kind == "attention":
        return base + _attention_bytes(m, precision, recompute, tp)
    if kind == "mlp":
        return base + _mlp_bytes(m, precision, recompute, tp)
    if kind == "moe_mlp":
        return base + _moe_mlp_bytes(m, precision, recompute)
    raise ValueError(f"block kind {kind!r} is not a single-mixer kind ({', '.join(SINGLE_MIXER_KINDS)})")


def parallel_hybrid_activation_bytes(m, precision: str, recompute: str, tp: int = 1, sp: bool = True) -> float:
    """Falcon-H1's layer (megapipe.models.parallel_hybrid): Mamba-2 and attention side by side on one normed input,
    then the MLP: two norms' residual terms, the attention and MLP sub-layers and the Mamba mixer as counted for
    their own blocks, where the mixers share their input: under fp32 one 4h for both unless an input muP multiplier
    != 1 gives a mixer its own copy; selective and full recompute as the other blocks."""
    base = _block_base(m, recompute, tp, sp, norms=2)
    if recompute == "full":
        return base
    out = base + _attention_bytes(m, precision, recompute, tp) + _mlp_bytes(m, precision, recompute, tp)
    out += mamba_mixer_activation_bytes(m, precision, recompute, tp)
    if recompute == "none" and DTYPE_BYTES[precision] == 4:  # both mixers counted a 4h input: the distinct ones
        scaled = (m.mamba_in_multiplier != 1) + (m.attention_in_multiplier != 1)
        out += 4 * m.hidden_size * (scaled + (scaled < 2) - 2)
    return out


def _moe_mlp_bytes(m, precision: str, recompute: str) -> float:
    """An MoE layer past its norm, on the TP group's whole (all-gathered) sequence, so not split by tp:
      router (fp32): its input 4h, the logits and the softmax scores 8E, the k weights 8k;
      routed experts, per token k times: the dispatched row (e*h), SwiGLU's 4 F-wide tensors (e*4F) and the expert
      output kept fp32 for the weighting (4h);
      shared experts: SwiGLU's 4 tensors (e*4Fs), under autocast a cast of the input per linear (2h each), and with
      the sigmoid gate its output and the gated product's input (e*(h + 1)).
    Selective recompute: the full-sequence output e*h, the router logits and the shared-expert linear outputs."""
    h, e, k, n_e = m.hidden_size, DTYPE_BYTES[precision], m.moe_router_topk, m.num_experts
    f_exp, f_sh = m.expert_ffn, m.moe_shared_expert_intermediate_size or 0
    if recompute == "selective":
        return e * h + 4 * n_e + (e * 2 * f_sh + (e if m.moe_shared_expert_gate else 0) if f_sh else 0)
    router = 4 * h + 8 * n_e + 8 * k
    experts = k * (e * h + e * 4 * f_exp + 4 * h)
    shared = 0.0
    if f_sh:
        casts = 0 if e == 4 else 2 * h * (3 if m.moe_shared_expert_gate else 2)
        shared = e * 4 * f_sh + casts + (e * (h + 1) if m.moe_shared_expert_gate else 0)
    return router + experts + shared


def moe_layer_activation_bytes(m, precision: str, recompute: str, tp: int = 1, sp: bool = True) -> float:
    """Bytes an MoE block keeps for backward per token of this rank's sequence: the dense block's residual, norm and
    attention terms, then the MoE layer (``_moe_mlp_bytes``). Selective recompute keeps the layer input and the
    outputs of the attention matmuls and kernel plus the MoE layer's; full recompute the layer input only."""
    base = _block_base(m, recompute, tp, sp, norms=2)
    if recompute == "full":
        return base
    return base + _attention_bytes(m, precision, recompute, tp) + _moe_mlp_bytes(m, precision, recompute)


def mamba_in_projection_params(m) -> int:
    """Weights of a Mamba-2 mixer's in-projections (z, x, B, C, dt), which it concatenates for one matmul when they
    are plain local linears (megapipe.models.mamba.fused_linear: not under TP)."""
    return m.hidden_size * (2 * m.mamba_inner + 2 * m.mamba_num_groups * m.mamba_state_dim + m.mamba_heads)


MAMBA_KINDS = ("mamba", "parallel_hybrid")  # block kinds with a Mamba-2 mixer
MOE_KINDS = ("moe", "mla_moe", "moe_mlp")  # block kinds (megapipe.models.spec) with routed experts


def block_activation_bytes(m, kind: str, precision: str, recompute: str, tp: int = 1, sp: bool = True) -> float:
    """``layer_activation_bytes`` for the block kind ``kind`` (megapipe.models.spec names)."""
    if kind in SINGLE_MIXER_KINDS:
        return single_mixer_activation_bytes(m, kind, precision, recompute, tp, sp)
    if kind == "parallel_hybrid":
        return parallel_hybrid_activation_bytes(m, precision, recompute, tp, sp)
    if kind in MOE_KINDS:
        return moe_layer_activation_bytes(m, precision, recompute, tp, sp)
    return layer_activation_bytes(m, precision, recompute, tp, sp)


def head_activation_bytes(m, precision: str, tp: int = 1, sp: bool = True) -> tuple[float, float]:
    """(kept, transient) bytes per token of the final norm + output + loss: the kept part lives from forward to
    backward, the transient part only while the loss is differentiated: two more fp32 vocabulary-wide buffers, three
    with tp > 1 (DTensor's vocabulary-parallel cross-entropy; measured with tools/check_plan_memory.py)."""
    h, v = m.hidden_size, m.vocab_size
    t_sp = tp if (tp > 1 and sp) else 1
    e = DTYPE_BYTES[precision]
    norm = (4 * h + (4 * h + 4 if m.norm_type == "rmsnorm" else 0)) / t_sp
    return norm + e * h + 4 * v / tp, (12 if tp > 1 else 8) * v / tp


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:
    """Korthikanti et al. 2022 (Table 2) per-layer activation bytes of a GPT layer (fp16, dropout, 4h MLP):
    sbh(34 + 5as/h) without parallelism; sbh(10 + 24/t + 5as/(ht)) with TP; sbh/t(34 + 5as/h) with TP+SP;
    selective recompute drops the 5as/h term; full recompute keeps 2sbh (the layer input; /t under SP).
    For comparison with ``layer_activation_bytes`` (our model differs: see the module doc)."""
    score = 0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if sp or t == 1:
        return s * b * h / t * (34 + score)
    return s * b * h * (10 + (24 + score) / t)


# --------------------------------------------------------------------------------------------------- ranks


def _in_flight(schedule: str, pp: int, v: int, m: int, stage_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of 'all its stages once'."""
    if pp == 1:
        return 1
    if schedule == "GPipe":
        return m
    if v > 1 or schedule in ("ZBVZeroBubble", "DualPipeV"):
        v = max(v, 2)
        return min(m, pp) * (1 + (pp - 1) / (pp * v)) if stage_rank == 0 else min(m, pp - stage_rank + 1)
    return min(m, pp - stage_rank)


@dataclass
class RankMemory:
    pp_rank: int
    stages: list[int]
    layers: int
    params: int  # held by this rank before FSDP sharding (after TP/PP)
    params_sharded: float
    weights: float
    grads: float
    optimizer: float
    compute_copies: float
    activations: dict = field(default_factory=dict)  # recompute mode -> bytes (held + transient)
    overhead: float = OVERHEAD_BYTES

    grads_persist: bool = True  # gradients live across micro-batches (accumulation, pipelining)
    expert_params: int = 0  # routed experts held (after ep, before FSDP)
    expert_bytes: float = 0.0  # their weights + gradients + optimizer state on this rank (after FSDP)
    all_to_all_bytes: float = 0.0  # MoE token all-to-all per step, sent by this rank (forward + backward)

    def total(self, recompute: str) -> float:
        """Peak bytes. Gradients are set to None after each step and backward frees activations as it creates
        gradients, so with one micro-batch per step the peak holds max(gradients, activations), not both."""
        acts = self.activations[recompute]
        live = self.grads + acts if self.grads_persist else max(self.grads, acts)
        return self.weights + self.optimizer + self.compute_copies + live + self.overhead


def rank_memory(cfg, dims, seq_length: int, overhead: float = OVERHEAD_BYTES) -> list[RankMemory]:
    """Memory of one rank per pipeline position (ranks at the same pp position are alike)."""
    m, t = cfg.model, cfg.train
    pc = param_counts(m)
    tp, pp, v = dims.tp, dims.pp, dims.pp_virtual_stages if dims.pp > 1 else 1
    if dims.pp > 1 and dims.pp_schedule in ("ZBVZeroBubble", "DualPipeV"):
        v = 2
    n_stages = pp * v
    counts = layer_split(m.num_layers, n_stages, dims.pp_layer_split, layer_flops_per_token(m, seq_length))
    starts = [sum(counts[:i]) for i in range(n_stages)]
    fsdp = dims.dp_shard * dims.cp if dims.dp_mode == "fsdp" else 1
    ep = getattr(dims, "ep", 1)
    efsdp = max(fsdp // ep, 1)  # the experts' FSDP group: edp x cp
    sp = dims.sequence_parallel
    tokens = t.micro_batch_size * seq_length // dims.cp  # tokens of one micro-batch on this rank
    n_micro = dims.num_pp_microbatches(t) if pp > 1 else 1
    e = DTYPE_BYTES[t.precision]

    def local(lc: LayerCounts) -> float:  # one block's parameters on this rank, experts included
        return lc.tp / tp + lc.rep + lc.experts / ep

    out = []
    for r in range(pp):
        ids = stage_ids(r, pp, v, dims.pp_schedule) if pp > 1 else [0]
        first, last = 0 in ids, n_stages - 1 in ids
        mine = [pc.layers[j] for i in ids for j in range(starts[i], starts[i] + counts[i])]
        layers = len(mine)
        expert_params = int(sum(lc.experts / ep for lc in mine))
        params = sum(lc.tp / tp + lc.rep for lc in mine)
        if first:
            params += pc.embedding_tp / tp + pc.embedding_rep + pc.vision
        if last:
            params += pc.head_rep + (pc.head_tp if not pc.tied else (0 if first else pc.embedding_tp)) / tp
            # the MTP modules (their blocks split as layers are) and, off the first stage, their embedding replica
            params += pc.mtp - pc.mtp_experts - pc.mtp_tp + pc.mtp_tp / tp
            expert_params += int(pc.mtp_experts / ep)
            params += pc.embedding_tp / tp if pc.mtp and not first and not pc.tied else 0
        dense_params = int(params)
        params = dense_params + expert_params
        shard = math.ceil(dense_params / fsdp) + math.ceil(expert_params / efsdp)
        # bytes per parameter: AdamW's two moments; Muon's momentum, and AdamW's second moment on the embedding and
        # output layer (norms, biases and routers are too small to count)
        optim = {"adamw": 8, "muon": 4}.get(cfg.optim.optimizer, 0)
        if cfg.optim.optimizer == "muon":
            outer = (pc.embedding_tp / tp + pc.embedding_rep if first else 0) + (pc.head_tp / tp if last else 0)
            optim_extra = 4.0 * math.ceil(outer / fsdp)
        else:
            optim_extra = 0.0
        acts = {}
        for mode in RECOMPUTE_MODES:
            per_mb = sum(block_activation_bytes(m, lc.kind, t.precision, mode, tp, sp) for lc in mine) * tokens
            transient = 0.0  # the loss backward and the re-run of a recomputed layer happen at different times
            if last:
                kept, tr = head_activation_bytes(m, t.precision, tp, sp)
                per_mb += kept * tokens
                transient = tr * tokens
            if pp > 1:  # the schedule's forward cache: each in-flight micro-batch's stage output, until its backward
                per_mb += (e * m.vocab_size / tp if last else 4 * m.hidden_size / (tp if sp and tp > 1 else 1)) * tokens
            if mode != "none" and layers:
                full = max(block_activation_bytes(m, lc.kind, t.precision, "none", tp, sp) for lc in mine)
                transient = max(transient, full * tokens)
            acts[mode] = per_mb * _in_flight(dims.pp_schedule, pp, v, n_micro, r) + transient
            if last and pp > 1 and PP_KEEPS_OUTPUTS:
                acts[mode] += n_micro * tokens * e * m.vocab_size / tp
        biggest = max((local(lc) for lc in mine), default=0.0)
        if fsdp > 1:  # FSDP2 all-gathers a module's parameters (in the compute dtype) and frees them after use
            root = dense_params - sum(lc.tp / tp + lc.rep for lc in mine)
            gathered = max(2 * biggest, root)  # two blocks, or the root (embedding/head)
            held = gathered if dims.fsdp_reshard_after_forward else params
            copies = e * held + e * 2 * biggest  # + two blocks' unsharded gradients before their reduce-scatter
        elif e < 4:  # autocast casts every matmul weight (not the embedding lookup table) once per forward
            cast = params - (pc.embedding_tp / tp + pc.embedding_rep if first and not pc.tied else 0)
            copies = e * (cast if t.recompute == "none" else cast - (layers - 1) * biggest)
        else:
            copies = 0.0
        n_mamba = sum(lc.kind in MAMBA_KINDS for lc in mine)
        if n_mamba and tp == 1 and t.recompute == "none" and (fsdp > 1 or e == 4):
            # each Mamba mixer saves its in-projections' weights concatenated for their one matmul (in the compute
            # dtype: autocast's cast of it is the copy counted above), per layer and in-flight micro-batch
            in_flight = _in_flight(dims.pp_schedule, pp, v, n_micro, r)
            copies += e * n_mamba * mamba_in_projection_params(m) * in_flight
        n_moe = sum(lc.kind in MOE_KINDS for lc in mine)
        mb_per_step = n_micro if pp > 1 else dims.num_microbatches(t)
        a2a = 0.0
        if n_moe and ep > 1:  # dispatch + combine, forward + backward; activations fp32 unless FSDP casts to bf16
            act = e if fsdp > 1 else 4
            a2a = 4 * n_moe * mb_per_step * tokens * m.moe_router_topk * m.hidden_size * act * (ep - 1) / ep
        out.append(RankMemory(
            pp_rank=r, stages=list(ids), layers=layers, params=params, params_sharded=shard,
            weights=4.0 * shard, grads=4.0 * shard, optimizer=float(optim * shard) + optim_extra, compute_copies=float(copies),
            activations=acts, overhead=overhead, grads_persist=pp > 1 or dims.num_microbatches(t) > 1,
            expert_params=expert_params, expert_bytes=(4.0 + 4.0 + optim) * math.ceil(expert_params / efsdp),
            all_to_all_bytes=a2a,
        ))
    return out


# --------------------------------------------------------------------------------------------------- time


def efficiency(dims, n_micro: int) -> dict:
    """Factors (each <= 1) multiplying the assumed MFU for this layout; see the module doc."""
    bubble = 0.0
    if dims.pp > 1:
        v = 2 if dims.pp_schedule in ("ZBVZeroBubble", "DualPipeV") else dims.pp_virtual_stages
        bubble = (dims.pp - 1) / (v * n_micro + dims.pp - 1)
    dp_group = dims.dp_size * dims.cp * dims.tp  # ranks spanned by one gradient reduction (pp outermost)
    f = {
        "pp_bubble": 1 - bubble,
        "tp": 1 - TP_LOSS_PER_DOUBLING * math.log2(dims.tp),
        "cp": 1 - CP_LOSS_PER_DOUBLING * math.log2(dims.cp),
        "dp": 1 - DP_OFF_NODE_LOSS if (dims.dp_size > 1 and dp_group > GPUS_PER_NODE) else 1.0,
    }
    f["total"] = math.prod(f.values())
    return f


def step_flops(cfg, recompute: Optional[str] = None) -> dict:
    t, s = cfg.train, cfg.data.seq_length
    tokens = t.global_batch_size * s
    model = flops_per_token(cfg.model, s) * tokens
    factor = 4 / 3 if (recompute or t.recompute) == "full" else 1.0
    return {"tokens": tokens, "model_flops": model, "hardware_flops": model * factor,
            "flops_per_token": model / tokens}


# --------------------------------------------------------------------------------------------------- layouts


@dataclass
class LayoutPlan:
    dims: object
    ranks: list[RankMemory]
    recompute: str
    memory_bytes: float  # the worst rank's total
    fits: bool
    step_time_s: float
    tokens_per_s: float
    efficiency: dict

    @property
    def layout(self) -> dict:
        return {n: getattr(self.dims, n) for n in LAYOUT_DIMS}


def moe_comm_seconds(cfg, dims, ranks: list[RankMemory]) -> dict:
    """Per step, on the slowest pipeline rank: the MoE token all-to-all (on the critical path: the experts wait for
    their tokens) and the routed experts' FSDP traffic (all-gather in forward and backward, reduce-scatter of fp32
    gradients, per micro-batch; overlapped with compute, so only what exceeds it shows). A group inside one node
    of 8 GPUs uses NVLink, a wider one the network; ranks are laid out tp fastest, then ep, cp, edp (ParallelDims)."""
    ep, tp = getattr(dims, "ep", 1), dims.tp
    fsdp = dims.dp_shard * dims.cp if dims.dp_mode == "fsdp" else 1
    efsdp = max(fsdp // ep, 1)
    e = DTYPE_BYTES[cfg.train.precision]
    n_micro = dims.num_pp_microbatches(cfg.train) if dims.pp > 1 else dims.num_microbatches(cfg.train)

    def bandwidth(span: int) -> float:
        return NVLINK_BYTES_PER_S if span <= GPUS_PER_NODE else NETWORK_BYTES_PER_S

    a2a = max(r.all_to_all_bytes for r in ranks) / bandwidth(ep * tp)
    moved = max(r.expert_params for r in ranks) * (efsdp - 1) / efsdp
    passes = (2 if dims.fsdp_reshard_after_forward else 1) * e + 4
    gather = moved * passes * n_micro / bandwidth(fsdp * tp) if efsdp > 1 else 0.0
    return {"all_to_all_s": a2a, "expert_fsdp_s": gather}


def evaluate(cfg, dims, gpu: GpuSpec, mfu: float = DEFAULT_MFU, overhead: float = OVERHEAD_BYTES) -> LayoutPlan:
    ranks = rank_memory(cfg, dims, cfg.data.seq_length, overhead)
    mode = cfg.train.recompute
    worst = max(r.total(mode) for r in ranks)
    n_micro = dims.num_pp_microbatches(cfg.train)
    eff = efficiency(dims, n_micro)
    fl = step_flops(cfg)
    time = fl["hardware_flops"] / (dims.world_size * gpu.peak_flops * mfu * eff["total"])
    if cfg.model.is_moe:
        comm = moe_comm_seconds(cfg, dims, ranks)
        eff = {**eff, **comm}
        time += comm["all_to_all_s"] + max(0.0, comm["expert_fsdp_s"] - time)
    return LayoutPlan(dims, ranks, mode, worst, worst <= gpu.memory_bytes, time, fl["tokens"] / time, eff)


def resolve_dims(cfg, gpus: int):
    """The config's own layout for ``gpus`` ranks, validated (ConfigError with the reason when impossible)."""
    if gpus < 1:
        raise ConfigError(f"--gpus = {gpus} must be >= 1")
    if cfg.parallel.tp > GPUS_PER_NODE:
        raise ConfigError(
            f"parallel.tp = {cfg.parallel.tp} spans more than one node of {GPUS_PER_NODE} GPUs: tensor parallelism "
            "needs NVLink, keep tp <= 8 and use pp or cp across nodes"
        )
    return ParallelDims.from_config(cfg.parallel, gpus, cfg.train, cfg.model, cfg.data.seq_length)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg, gpus: int):
    """Every valid (dp_replicate, dp_shard, cp, tp, pp, ep) for ``gpus`` ranks: tp <= 8, ParallelDims' rules, the
    layouts the architecture declares (megapipe.models.capabilities: no cp for Mamba layers); ep over the divisors
    of dp_shard (and of the expert count) for an MoE model."""
    from megapipe.models.capabilities import capabilities, requested_layouts

    declared = capabilities(cfg.model).layouts
    p = cfg.parallel
    out = []
    for tp in [d for d in _divisors(gpus) if d <= GPUS_PER_NODE]:
        for pp in _divisors(gpus // tp):
            for cp in _divisors(gpus // (tp * pp)):
                rest = gpus // (tp * pp * cp)
                for rep in _divisors(rest):
                    shard = rest // rep
                    eps = [d for d in _divisors(shard) if cfg.model.num_experts % d == 0] if cfg.model.is_moe else [1]
                    for ep in eps:
                        pcfg = dataclasses.replace(
                            p, tp=tp, pp=pp, cp=cp, dp_replicate=rep, dp_shard=shard, ep=ep,
                            pp_virtual_stages=p.pp_virtual_stages if pp > 1 else 1,
                            pp_layer_split=p.pp_layer_split if pp == p.pp else None,
                            pp_microbatches=p.pp_microbatches if pp > 1 else None,
                        )
                        if not set(requested_layouts(pcfg)) <= declared:
                            continue
                        if pp > 1 and p.pp == 1 and pcfg.pp_schedule != "1F1B" and pcfg.pp_virtual_stages == 1:
                            pcfg = dataclasses.replace(pcfg, pp_schedule="1F1B")
                        try:
                            dims = ParallelDims.from_config(pcfg, gpus, cfg.train, cfg.model, cfg.data.seq_length)
                        except ConfigError:
                            continue
                        if not any(d.world_size == dims.world_size and _same(d, dims) for d in out):
                            out.append(dims)
    return out


def _same(a, b) -> bool:
    return all(getattr(a, n) == getattr(b, n) for n in LAYOUT_DIMS)


def rank_layouts(cfg, gpus: int, gpu: GpuSpec, mfu: float = DEFAULT_MFU, top: int = 5) -> tuple[list, int, int]:
    """(best fitting layouts by estimated tokens/s, number of valid layouts, number that fit in memory)."""
    plans = [evaluate(cfg, d, gpu, mfu) for d in candidate_layouts(cfg, gpus)]
    fitting = [pl for pl in plans if pl.fits]
    fitting.sort(key=lambda pl: (-pl.tokens_per_s, pl.memory_bytes))
    return fitting[:top], len(plans), len(fitting)


def plan(cfg, gpus: int, gpu_type: str = "h100", mfu: float = DEFAULT_MFU, top: int = 5) -> dict:
    """Everything ``megapipe plan`` prints, as plain data (bytes, FLOPs, seconds)."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu = {mfu} must be within (0, 1]")
    gpu = gpu_spec(gpu_type)
    pc = param_counts(cfg.model)
    dims = resolve_dims(cfg, gpus)
    this = evaluate(cfg, dims, gpu, mfu)
    best, n_valid, n_fit = rank_layouts(cfg, gpus, gpu, mfu, top)
    fl = {mode: step_flops(cfg, mode) for mode in RECOMPUTE_MODES}
    return {
        "gpu": {"type": gpu_type.lower(), "name": gpu.name, "memory_bytes": gpu.memory_bytes,
                "peak_flops": gpu.peak_flops, "count": gpus},
        "mfu_assumed": mfu,
        "params": {"total": pc.total, "active": pc.active, "experts": pc.experts, "embedding": pc.embedding,
                   "per_layer": {kind: d["params"] for kind, d in pc.by_kind().items()},
                   "layers_by_kind": {kind: d["layers"] for kind, d in pc.by_kind().items()},
                   "head": pc.head, "layers": pc.num_layers, "tied": pc.tied,
                   "mtp": pc.mtp, "total_with_mtp": pc.total + pc.mtp, "active_with_mtp": pc.active + pc.mtp_active},
        "layout": {**this.layout, "dp_mode": dims.dp_mode, "pp_schedule": dims.pp_schedule,
                   "microbatches": dims.num_microbatches(cfg.train) if dims.pp == 1
                   else dims.num_pp_microbatches(cfg.train)},
        "recompute": cfg.train.recompute,
        "ranks": [_rank_dict(r) for r in this.ranks],
        "memory_bytes": this.memory_bytes,
        "fits": this.fits,
        "flops": fl,
        "efficiency": this.efficiency,
        "step_time_s": this.step_time_s,
        "tokens_per_s": this.tokens_per_s,
        "best_layouts": [
            {**pl.layout, "memory_bytes": pl.memory_bytes, "step_time_s": pl.step_time_s,
             "tokens_per_s": pl.tokens_per_s, "efficiency": pl.efficiency["total"],
             "pp_bubble": 1 - pl.efficiency["pp_bubble"]}
            for pl in best
        ],
        "layouts_valid": n_valid,
        "layouts_fit": n_fit,
        "kv_cache": kv_cache_bytes(cfg.model),
        "vision": vision_share(cfg, pc, this.ranks[0], dims.dp_shard * dims.cp if dims.dp_mode == "fsdp" else 1),
    }


VISION_IMAGE = (448, 448)  # the image (height, width in pixels) the vision tower's FLOPs are given for


def vision_flops_per_image(m, height: int = VISION_IMAGE[0], width: int = VISION_IMAGE[1]) -> float:
    """Training FLOPs (forward + backward, 6 per multiply-add) of the vision tower on one image: the patch
    embedding, each block's matmuls and its attention scores and values over the patches it sees (a window, or the
    whole image in the full-attention blocks), the patch merger's MLP per merged token. Equal to what torch's
    FlopCounterMode counts for transformers' tower with eager attention (tests/parallel/test_plan.py); megapipe's own
    tower attends over the whole image with a window mask, which computes more than these window FLOPs."""
    d, p, merge = m.vision_hidden_size, m.vision_patch_size, m.vision_spatial_merge_size
    patches = (height // p) * (width // p)
    window = min((m.vision_window_size // p) ** 2, patches)
    block = 4 * d * d + 3 * d * m.vision_intermediate_size
    seen = sum(patches if i in m.vision_fullatt_block_indexes else window for i in range(m.vision_depth))
    embed = m.vision_in_channels * m.vision_temporal_patch_size * p * p * d
    wide = d * merge ** 2
    merger = (wide * wide + wide * m.hidden_size) * patches // merge ** 2
    return 6.0 * (patches * (embed + m.vision_depth * block) + merger) + 6.0 * 2 * d * patches * seen


def vision_share(cfg, pc: ParamCounts, first_rank: RankMemory, fsdp: int) -> Optional[dict]:
    """The vision tower's share of the parameters, of the first pipeline rank's memory (its weights, gradients and
    optimizer state; its activations are not modelled) and of a sample's FLOPs with one VISION_IMAGE image."""
    m = cfg.model
    if not pc.vision:
        return None
    optim = {"adamw": 8, "muon": 4}.get(cfg.optim.optimizer, 0)
    memory = (8.0 + optim) * math.ceil(pc.vision / fsdp)
    image = vision_flops_per_image(m)
    text = flops_per_token(m, cfg.data.seq_length) * cfg.data.seq_length
    merge = m.vision_spatial_merge_size * m.vision_patch_size
    return {"params": pc.vision, "params_share": pc.vision / pc.total, "memory_bytes": memory,
            "memory_share": memory / first_rank.total(cfg.train.recompute), "image": list(VISION_IMAGE),
            "image_tokens": (VISION_IMAGE[0] // merge) * (VISION_IMAGE[1] // merge), "flops_per_image": image,
            "flops_share": image / (image + text)}


KV_CONTEXTS = (8192, 131072)  # where a cache whose size per token depends on the context (DeepSeek-V4's) is shown


def kv_cache_bytes(m, bytes_per_value: int = 2) -> dict:
    """KV cache bytes per token (bf16): what the model's cache stores, and the per-head keys and values of the same
    attention (multi-latent attention's decompressed form, its GQA equivalent); DeepSeek-V4's compressed cache at
    each of ``KV_CONTEXTS`` tokens of context too (``bytes_per_token`` at the longest)."""
    stored, per_head = kv_cache_values_per_token(m, KV_CONTEXTS[-1] if m.attention_layer_types else None)
    out = {"bytes_per_token": stored * bytes_per_value, "gqa_equivalent_bytes_per_token": per_head * bytes_per_value}
    if m.attention_layer_types is not None:
        out["bytes_per_token_at"] = {n: kv_cache_values_per_token(m, n)[0] * bytes_per_value for n in KV_CONTEXTS}
    return out


def _rank_dict(r: RankMemory) -> dict:
    d = dataclasses.asdict(r)
    d["total"] = {mode: r.total(mode) for mode in RECOMPUTE_MODES}
    return d
