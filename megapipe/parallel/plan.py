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
  the last stage until the step ends; megapipe.parallel.step tells it not to (``PP_KEEPS_OUTPUTS`` = False).
- not modelled: qk_norm's extra saved tensors (~8 B per q/kv element), context parallelism's ring-attention K/V
  buffers, the optimizer step's temporaries, NCCL buckets (in the fixed overhead).
- a fixed overhead (CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation): OVERHEAD_BYTES.

Step time: model FLOPs ``flops_per_token * tokens`` (x4/3 hardware FLOPs under full recompute; selective
recomputes element-wise ops only, ~0 FLOPs) at MFU ``mfu`` times an efficiency for the layout (``efficiency``):
pipeline bubble (p-1)/(v*m+p-1), and per doubling of tp/cp an exposed-communication loss, a small loss when the
data-parallel group leaves the node. These factors are rough, stated assumptions for ranking, not measurements.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from megapipe.errors import ConfigError

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
# torch.distributed.pipelining keeps the last stage's output (the logits) of every micro-batch until the step ends
# unless schedule.step(..., return_outputs=False), which megapipe.parallel.step passes (torch 2.13).
PP_KEEPS_OUTPUTS = False
RECOMPUTE_MODES = ("none", "selective", "full")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def gpu_spec(name: str) -> GpuSpec:
    key = name.lower()
    if key not in GPUS:
        raise ConfigError(f"--gpu-type {name!r} is not known (allowed: {', '.join(sorted(GPUS))})")
    return GPUS[key]


# --------------------------------------------------------------------------------------------------- parameters


@dataclass
class ParamCounts:
    """Parameters by part; ``*_tp`` is split by tensor parallelism, ``*_rep`` is replicated on TP ranks."""

    embedding_tp: int  # token embedding (vocabulary-parallel)
    embedding_rep: int  # learned position embedding
    layer_tp: int
    layer_rep: int
    head_tp: int  # output projection (0 when tied)
    head_rep: int  # final norm
    num_layers: int
    tied: bool

    @property
    def embedding(self) -> int:
        return self.embedding_tp + self.embedding_rep

    @property
    def layer(self) -> int:
        return self.layer_tp + self.layer_rep

    @property
    def head(self) -> int:
        return self.head_tp + self.head_rep

    @property
    def total(self) -> int:
        return self.embedding + self.num_layers * self.layer + self.head


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
    from megapipe.models import build_model
    from megapipe.models.spec import tp_split_numel

    model = build_model(m, device="meta")
    layers = {tp_split_numel(block) for block in model.layers.values()}
    if len(layers) != 1:
        raise ConfigError("the planner models identical layers; this model mixes block kinds")
    (layer_tp, layer_rep), = layers

    def numel(module) -> int:
        return 0 if module is None else sum(p.numel() for p in module.parameters())

    return ParamCounts(
        embedding_tp=numel(model.tok_embeddings), embedding_rep=numel(model.pos_embeddings),
        layer_tp=layer_tp, layer_rep=layer_rep,
        head_tp=numel(model.output), head_rep=numel(model.norm),
        num_layers=m.num_layers, tied=m.tie_embeddings,
    )


# --------------------------------------------------------------------------------------------------- activations


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
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"train.recompute = {recompute!r} is not valid (allowed: {', '.join(RECOMPUTE_MODES)})")
    h, hd, f = m.hidden_size, m.dim_per_head, m.intermediate_size
    q, kv, a = m.num_heads * hd, m.kv_heads * hd, m.num_heads
    e = DTYPE_BYTES[precision]
    t_sp = tp if (tp > 1 and sp) else 1
    swiglu = m.activation == "swiglu"
    if recompute == "full":
        return 4 * h / t_sp
    if recompute == "selective":
        # layer input (fp32) + outputs of every matmul (wq, wk, wv, w1, [w3] split by tp; wo, w2 full-sequence
        # partial sums under TP) and of the attention kernel (output + logsumexp)
        return 4 * h / t_sp + (e * (2 * q + 2 * kv + (2 if swiglu else 1) * f) + 4 * a) / tp + e * 2 * h
    rms = m.norm_type == "rmsnorm"
    residual = (8 * h + (8 * h if rms else 0) + 8) / t_sp
    linear_in = 8 * h if e == 4 else 2 * h * (3 + (2 if swiglu else 1))
    attention = (e * (2 * q + 2 * kv) + 4 * a) / tp
    mlp = e * (4 if swiglu else 2) * f / tp
    return residual + linear_in + attention + mlp


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

    def total(self, recompute: str) -> float:
        """Peak bytes. Gradients are set to None after each step and backward frees activations as it creates
        gradients, so with one micro-batch per step the peak holds max(gradients, activations), not both."""
        acts = self.activations[recompute]
        live = self.grads + acts if self.grads_persist else max(self.grads, acts)
        return self.weights + self.optimizer + self.compute_copies + live + self.overhead


def rank_memory(cfg, dims, seq_length: int, overhead: float = OVERHEAD_BYTES) -> list[RankMemory]:
    """Memory of one rank per pipeline position (ranks at the same pp position are alike)."""
    from megapipe.parallel.pp import layer_split, stage_ids

    m, t = cfg.model, cfg.train
    pc = param_counts(m)
    tp, pp, v = dims.tp, dims.pp, dims.pp_virtual_stages if dims.pp > 1 else 1
    if dims.pp > 1 and dims.pp_schedule in ("ZBVZeroBubble", "DualPipeV"):
        v = 2
    n_stages = pp * v
    counts = layer_split(m.num_layers, n_stages, dims.pp_layer_split)
    fsdp = dims.dp_shard * dims.cp if dims.dp_mode == "fsdp" else 1
    sp = dims.sequence_parallel
    tokens = t.micro_batch_size * seq_length // dims.cp  # tokens of one micro-batch on this rank
    n_micro = dims.num_pp_microbatches(t) if pp > 1 else 1
    layer_local = pc.layer_tp / tp + pc.layer_rep
    e = DTYPE_BYTES[t.precision]
    out = []
    for r in range(pp):
        ids = stage_ids(r, pp, v, dims.pp_schedule) if pp > 1 else [0]
        first, last = 0 in ids, n_stages - 1 in ids
        layers = sum(counts[i] for i in ids)
        params = layers * layer_local
        if first:
            params += pc.embedding_tp / tp + pc.embedding_rep
        if last:
            params += pc.head_rep + (pc.head_tp if not pc.tied else (0 if first else pc.embedding_tp)) / tp
        params = int(params)
        shard = math.ceil(params / fsdp)
        optim = 8 if cfg.optim.optimizer == "adamw" else 0
        acts = {}
        for mode in RECOMPUTE_MODES:
            per_mb = layers * layer_activation_bytes(m, t.precision, mode, tp, sp) * tokens
            transient = 0.0  # the loss backward and the re-run of a recomputed layer happen at different times
            if last:
                kept, tr = head_activation_bytes(m, t.precision, tp, sp)
                per_mb += kept * tokens
                transient = tr * tokens
            if mode != "none" and layers:
                transient = max(transient, layer_activation_bytes(m, t.precision, "none", tp, sp) * tokens)
            acts[mode] = per_mb * _in_flight(dims.pp_schedule, pp, v, n_micro, r) + transient
            if last and pp > 1 and PP_KEEPS_OUTPUTS:
                acts[mode] += n_micro * tokens * e * m.vocab_size / tp
        if fsdp > 1:  # FSDP2 all-gathers a module's parameters (in the compute dtype) and frees them after use
            gathered = max(2 * layer_local, params - layers * layer_local)  # two blocks, or the root (embedding/head)
            held = gathered if dims.fsdp_reshard_after_forward else params
            copies = e * held + e * 2 * layer_local  # + two blocks' unsharded gradients before their reduce-scatter
        elif e < 4:  # autocast casts every matmul weight (not the embedding lookup table) once per forward
            cast = params - (pc.embedding_tp / tp + pc.embedding_rep if first and not pc.tied else 0)
            copies = e * (cast if t.recompute == "none" else cast - (layers - 1) * layer_local)
        else:
            copies = 0.0
        out.append(RankMemory(
            pp_rank=r, stages=list(ids), layers=layers, params=params, params_sharded=shard,
            weights=4.0 * shard, grads=4.0 * shard, optimizer=float(optim * shard), compute_copies=float(copies),
            activations=acts, overhead=overhead, grads_persist=pp > 1 or dims.num_microbatches(t) > 1,
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
    from megapipe.models import flops_per_token

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
        return {n: getattr(self.dims, n) for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp")}


def evaluate(cfg, dims, gpu: GpuSpec, mfu: float = DEFAULT_MFU, overhead: float = OVERHEAD_BYTES) -> LayoutPlan:
    ranks = rank_memory(cfg, dims, cfg.data.seq_length, overhead)
    mode = cfg.train.recompute
    worst = max(r.total(mode) for r in ranks)
    n_micro = dims.num_pp_microbatches(cfg.train)
    eff = efficiency(dims, n_micro)
    fl = step_flops(cfg)
    time = fl["hardware_flops"] / (dims.world_size * gpu.peak_flops * mfu * eff["total"])
    return LayoutPlan(dims, ranks, mode, worst, worst <= gpu.memory_bytes, time, fl["tokens"] / time, eff)


def resolve_dims(cfg, gpus: int):
    """The config's own layout for ``gpus`` ranks, validated (ConfigError with the reason when impossible)."""
    from megapipe.parallel.dims import ParallelDims

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
    """Every valid (dp_replicate, dp_shard, cp, tp, pp) for ``gpus`` ranks: tp <= 8, ParallelDims' rules."""
    from megapipe.parallel.dims import ParallelDims

    p = cfg.parallel
    out = []
    for tp in [d for d in _divisors(gpus) if d <= GPUS_PER_NODE]:
        for pp in _divisors(gpus // tp):
            for cp in _divisors(gpus // (tp * pp)):
                rest = gpus // (tp * pp * cp)
                for rep in _divisors(rest):
                    pcfg = dataclasses.replace(
                        p, tp=tp, pp=pp, cp=cp, dp_replicate=rep, dp_shard=rest // rep,
                        pp_virtual_stages=p.pp_virtual_stages if pp > 1 else 1,
                        pp_layer_split=p.pp_layer_split if pp == p.pp else None,
                        pp_microbatches=p.pp_microbatches if pp > 1 else None,
                    )
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
    return all(getattr(a, n) == getattr(b, n) for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp"))


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
        "params": {"total": pc.total, "embedding": pc.embedding, "per_layer": pc.layer, "head": pc.head,
                   "layers": pc.num_layers, "tied": pc.tied},
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
    }


def _rank_dict(r: RankMemory) -> dict:
    d = dataclasses.asdict(r)
    d["total"] = {mode: r.total(mode) for mode in RECOMPUTE_MODES}
    return d
