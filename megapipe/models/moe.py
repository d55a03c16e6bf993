"""The mixture-of-experts decoder block: attention as in the dense block, then a routed SwiGLU MoE layer (Mixtral,
Qwen2/3-MoE, DeepSeek-V3 shapes by ModelConfig), with its spec: TP plan and Hugging Face names.

Routing (``route``; the router runs in fp32): softmax or sigmoid scores, top-k of the logits with a softmax over
the k (Megatron's default) or top-k after a softmax over all experts (``moe_router_pre_softmax``, Qwen's way), the
k weights optionally normalised and scaled, group-limited selection (DeepSeek-V3: the best ``group_topk`` of
``num_groups`` expert groups), and an aux-loss-free per-expert bias that only changes which experts are chosen.

Balancing losses (Megatron's definitions, per MoE layer): the load-balancing loss per micro-batch
``coeff * E / (k T^2) * sum_e count_e * sum_t p_te`` or per sequence (``seq_aux_loss``), and the router z-loss
``coeff * mean_t logsumexp(logits_t)^2``. They reach backward through ``AuxLossBackward`` on the layer's output, as
Megatron's MoEAuxLossAutoScaler does, so they work on every layout (pipeline stages included) and never enter the
reported LM loss; ``aux_loss_scale`` (set by megapipe.parallel.step each step) weighs them as a mean over the
global batch's micro-batches.

Experts: 3-D weights ``w1``/``w3`` [E, F, H] and ``w2`` [E, H, F] (expert e's tensors are HF's per-expert linear
weights), optionally with biases and GPT-OSS's clamped SwiGLU (``moe_expert_bias``, ``moe_activation``), dropless by
default; one grouped GEMM for all experts (``torch._grouped_mm``) where torch has it for the
device and dtype, else a loop over experts. An optional capacity factor drops the assignments over capacity (by
lowest probability or latest position); shared experts (optionally behind a sigmoid gate) see every token.

The model holds no parallel code: the tokens sorted by expert go through ``dispatcher`` (``LocalDispatch`` here;
megapipe.parallel.ep installs an all-to-all one), and statistics that span a sequence split over context-parallel
ranks go through ``sum_over_sequence_shards`` (identity here). Per-step statistics (tokens per expert, aux/z values,
dropped assignments) accumulate in buffers while gradients are enabled; activation recompute runs a forward twice,
which scales every sum alike, so what is reported (ratios, means per call) and the sign-based bias update are the
same with and without it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megapipe import torch_compat
from megapipe.config import ModelConfig
from megapipe.models.attention import Attention, DocumentMask, local
from megapipe.models.dense import DENSE, FeedForward, attention_tp_plan
from megapipe.models.norms import build_norm
from megapipe.models.spec import BlockSpec, register_block, replicated_style

STATS = ("aux", "z", "dropped", "assigned", "calls")  # MoE.stats entries


# --------------------------------------------------------------------------------------------------- routing


def group_limited(scores: torch.Tensor, k: int, groups: int, group_topk: int) -> torch.Tensor:
    """``scores`` [T, E] with every expert outside each token's best ``group_topk`` groups set to -inf; a group's
    score is the sum of its best k // group_topk expert scores (Megatron; DeepSeek-V3's top-2 sum at k = 8, 4 groups)."""
    t, e = scores.shape
    per_group = scores.view(t, groups, e // groups)
    group_scores = per_group.topk(k // group_topk, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(group_topk, dim=-1).indices, True)
    return per_group.masked_fill(~keep[..., None], float("-inf")).view(t, e)


def route(logits: torch.Tensor, cfg: ModelConfig, bias: Optional[torch.Tensor] = None,
          fixed: Optional[torch.Tensor] = None):
    """Router logits [T, E] (fp32) -> (expert indices [T, k], routing weights [T, k], scores for the aux loss [T, E]).
    ``fixed`` [T, k]: the experts, chosen already (hash routing); the router only weighs them."""
    k = cfg.moe_router_topk
    sigmoid = cfg.moe_router_score_function != "softmax"  # sigmoid or sqrt(softplus): per-expert scores
    if sigmoid:
        if cfg.moe_router_score_function == "sqrtsoftplus":
            scores = torch.sqrt(F.softplus(logits))
        else:
            scores = torch.sigmoid(logits)
        aux_scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = aux_scores = torch.softmax(logits, dim=-1)
    # what the selection ranks: the scores (sigmoid / pre-softmax) or the logits (top-k before the softmax)
    basis = scores if (sigmoid or cfg.moe_router_pre_softmax) else logits
    select = basis if bias is None else basis + bias
    if cfg.moe_router_num_groups:
        select = group_limited(select, k, cfg.moe_router_num_groups, cfg.moe_router_group_topk)
    idx = select.topk(k, dim=-1).indices if fixed is None else fixed
    if sigmoid or cfg.moe_router_pre_softmax:
        weights = scores.gather(1, idx)
        if cfg.moe_router_norm_topk_prob and k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
    else:
        weights = torch.softmax(logits.gather(1, idx), dim=-1)
    if cfg.moe_router_topk_scaling_factor is not None:
        weights = weights * cfg.moe_router_topk_scaling_factor
    return idx, weights, aux_scores


def capacity_keep(idx: torch.Tensor, weights: torch.Tensor, num_experts: int, factor: float,
                  policy: str) -> torch.Tensor:
    """[T, k] bool: which assignments fit in their expert's capacity ceil(T * k / E * factor) (Megatron), keeping the
    highest routing weights (``probs``) or the earliest tokens (``position``)."""
    t, k = idx.shape
    capacity = math.ceil(t * k / num_experts * factor)
    routed = torch.zeros(t, num_experts, dtype=torch.bool, device=idx.device).scatter_(1, idx, True)
    if policy == "position":
        fits = routed & (routed.cumsum(dim=0) <= capacity)
    else:
        probs = torch.full((t, num_experts), -1.0, device=idx.device).scatter_(1, idx, weights.detach().float())
        best = probs.topk(min(capacity, t), dim=0).indices
        fits = routed & torch.zeros_like(routed).scatter_(0, best, True)
    return fits.gather(1, idx)


# --------------------------------------------------------------------------------------------------- experts


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (torch._grouped_mm's backward rejects expanded ones)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs here: CPU (torch >= 2.9: a per-group fallback) for fp32/bf16/fp16, CUDA for
    bf16 on sm90+; every row stride a multiple of 16 bytes; at least one token (torch 2.13 on CPU: no tokens at all
    fails in backward, as does an expanded output gradient, hence _ContiguousGrad)."""
    if not torch_compat.has_grouped_mm() or x.shape[0] == 0:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # its fake-tensor rule (torch 2.13) accepts bf16 only
    dev, dt = x.device, x.dtype
    if dev.type == "cpu":
        ok = dt in (torch.float32, torch.bfloat16, torch.float16)
    elif dev.type == "cuda":
        ok = dt == torch.bfloat16 and torch.cuda.get_device_capability(dev) >= (9, 0)
    else:
        ok = False
    return ok and all(w.dtype == dt and (w.shape[-1] * w.element_size()) % 16 == 0
                      and (w.shape[-2] * w.element_size()) % 16 == 0 for w in weights)


class GroupedExperts(nn.Module):
    """E experts as 3-D weights; ``forward(x, counts)``: x [N, H] sorted by expert, counts [E_local]. ``bias``: each
    expert's gate / up / down projections have biases ``w1_bias``/``w3_bias`` [E, F] and ``w2_bias`` [E, H];
    ``activation``: SwiGLU or GPT-OSS's clamped one (``expert_activation``)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, grouped_gemm: bool = True, bias: bool = False,
                 activation: tuple = ("swiglu",)):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))  # gate_proj per expert
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))  # down_proj
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))  # up_proj
        if bias:
            self.w1_bias = nn.Parameter(torch.empty(num_experts, ffn))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden))
            self.w3_bias = nn.Parameter(torch.empty(num_experts, ffn))
        else:
            self.w1_bias = self.w2_bias = self.w3_bias = None
        self.grouped_gemm, self.activation = grouped_gemm, activation

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = local(self.w1), local(self.w2), local(self.w3)
        biases = None if self.w1_bias is None else [local(b) for b in (self.w1_bias, self.w2_bias, self.w3_bias)]
        if torch.is_autocast_enabled(x.device.type):  # explicit: torch._grouped_mm has no autocast rule
            dt = torch.get_autocast_dtype(x.device.type)
            x, w1, w2, w3 = x.to(dt), w1.to(dt), w2.to(dt), w3.to(dt)
            biases = None if biases is None else [b.to(dt) for b in biases]
        elif w1.dtype != x.dtype:
            x = x.to(w1.dtype)
        if self.grouped_gemm and grouped_mm_ok(x, w1, w2, w3):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            # each row's expert's bias (dropless: counts cover every row)
            rows = None if biases is None else [b.repeat_interleave(counts, dim=0) for b in biases]

            def gmm(a, w, i):
                out = _ContiguousGrad.apply(torch_compat.grouped_mm(a, w.transpose(-2, -1), offs))
                return out if rows is None else out + rows[i]

            return gmm(expert_activation(gmm(x, w1, 0), gmm(x, w3, 2), self.activation), w2, 1)
        return expert_loop(x, counts, w1, w2, w3, biases, self.activation)


def expert_activation(gate: torch.Tensor, up: torch.Tensor, activation: tuple = ("swiglu",)) -> torch.Tensor:
    """("swiglu",): silu(gate) * up; ("clamped_swiglu", alpha, limit), GPT-OSS's: gate clamped above at limit, up to
    [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1); ("clamped_silu", alpha, limit), DeepSeek-V4's:
    the same clamps, then silu(gate) * up."""
    if activation[0] == "swiglu":
        return F.silu(gate) * up
    kind, alpha, limit = activation
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    if kind == "clamped_silu":
        return F.silu(gate) * up
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def expert_loop(x, counts, w1, w2, w3, biases=None, activation: tuple = ("swiglu",)) -> torch.Tensor:
    """The reference path: one expert MLP per expert on its rows (empty experts included, so every weight gets a
    gradient even when a rank received no token); ``biases``: [w1's, w2's, w3's] or None."""
    b1, b2, b3 = biases if biases is not None else (None, None, None)

    def lin(a, w, b, e):
        return F.linear(a, w[e], None if b is None else b[e])

    outs = []
    for e, part in enumerate(torch.split(x, counts.tolist())):
        hidden = expert_activation(lin(part, w1, b1, e), lin(part, w3, b3, e), activation)
        outs.append(lin(hidden, w2, b2, e))
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class LocalDispatch:
    """Tokens sorted by expert go straight to this rank's experts (no expert parallelism)."""

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor):
        return tokens, counts, None

    def combine(self, out: torch.Tensor, state) -> torch.Tensor:
        return out


class AuxLossBackward(torch.autograd.Function):
    """Identity on ``out``; in backward also gives ``aux`` the gradient ``scale`` (Megatron's MoEAuxLossAutoScaler):
    the balancing losses enter backward wherever the layer's output goes, and are never added to the LM loss."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


# --------------------------------------------------------------------------------------------------- the layer


class MoE(nn.Module):
    plain_linears = ("gate",)  # the router is read as an fp32 weight: the engine's packing leaves it alone

    def __init__(self, cfg: ModelConfig, hash_routed: bool = False):
        super().__init__()
        self.cfg = cfg
        e, h = cfg.num_experts, cfg.hidden_size
        self.gate = nn.Linear(h, e, bias=cfg.moe_router_bias)  # the router
        activation = ("swiglu",) if cfg.moe_activation == "swiglu" else (
            cfg.moe_activation, cfg.moe_swiglu_alpha, cfg.moe_swiglu_limit)
        self.experts = GroupedExperts(e, h, cfg.expert_ffn, cfg.moe_grouped_gemm, cfg.moe_expert_bias, activation)
        self.shared_experts = None
        self.shared_gate = None
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = FeedForward(
                dataclasses.replace(cfg, intermediate_size=cfg.moe_shared_expert_intermediate_size, mlp_bias=False))
            if cfg.moe_shared_expert_gate:
                self.shared_gate = nn.Linear(h, 1, bias=False)
        if cfg.moe_router_enable_expert_bias and not hash_routed:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        else:
            self.expert_bias = None
        # hash routing (DeepSeek-V4's first layers): token id -> its k experts, fixed (init_weights: a round robin)
        table = torch.zeros(cfg.vocab_size, cfg.moe_router_topk, dtype=torch.long) if hash_routed else None
        self.register_buffer("tid2eid", table)
        self.register_buffer("tokens_per_expert", torch.zeros(e, dtype=torch.float64), persistent=False)
        self.register_buffer("stats", torch.zeros(len(STATS), dtype=torch.float64), persistent=False)
        self.dispatcher = LocalDispatch()
        self.sum_over_sequence_shards: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self.sequence_shards = 1  # ranks a sequence is split over (context parallelism)
        self.aux_loss_scale = 1.0

    def forward(self, x: torch.Tensor, token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., H]; ``token_ids`` [...] (the tokens of x's positions): what a hash-routed layer routes by."""
        cfg = self.cfg
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.gate.bias is None else local(self.gate.bias).float()
            logits = F.linear(x.float(), local(self.gate.weight).float(), bias)
        bias = None if self.expert_bias is None else self.expert_bias.detach()
        fixed = None
        if self.tid2eid is not None:
            if token_ids is None:
                raise ValueError("a hash-routed MoE layer needs the token ids (it routes by them)")
            fixed = self.tid2eid[token_ids.reshape(-1)]
        idx, weights, aux_scores = route(logits, cfg, bias, fixed)
        t, k = idx.shape
        counts = torch.bincount(idx.flatten(), minlength=cfg.num_experts)
        keep = None
        if cfg.moe_expert_capacity_factor is not None:
            keep = capacity_keep(idx, weights, cfg.num_experts, cfg.moe_expert_capacity_factor,
                                 cfg.moe_token_drop_policy)
        aux = self._balancing_losses(logits, aux_scores, idx, counts, shape) if torch.is_grad_enabled() else None

        # assignments (token, slot) flattened; the kept ones sorted by expert, then by position
        expert_of = idx.flatten()
        slots = torch.arange(t * k, device=x.device)
        if keep is not None:
            slots = slots[keep.flatten()]
        order = slots[torch.argsort(expert_of[slots], stable=True)]
        sent = torch.bincount(expert_of[order], minlength=cfg.num_experts)
        tokens, local_counts, state = self.dispatcher.dispatch(x[order // k], sent)
        y = self.dispatcher.combine(self.experts(tokens, local_counts), state)
        # back to (token, slot) order, a zero row for each dropped slot; weighted sum over the k slots (in fp32)
        where = torch.full((t * k,), len(order), dtype=torch.long, device=x.device)
        where[order] = torch.arange(len(order), device=x.device)
        y = torch.cat([y, y.new_zeros(1, y.shape[1])])[where]
        out = (y.float() * weights.reshape(-1, 1)).view(t, k, -1).sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        out = out.view(shape)
        if torch.is_grad_enabled():
            self._record(counts, aux, t * k - len(order), t * k)
            if aux is not None:
                out = AuxLossBackward.apply(out, aux.sum(), self.aux_loss_scale)
        return out

    def _balancing_losses(self, logits, scores, idx, counts, shape) -> Optional[torch.Tensor]:
        """[aux, z] (this rank's part of the micro-batch's values: parts add up over context-parallel ranks)."""
        cfg = self.cfg
        e, k = cfg.num_experts, cfg.moe_router_topk
        kind, coeff = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff
        aux = logits.new_zeros(())
        tokens = float(logits.shape[0] * self.sequence_shards)
        if kind == "aux_loss" and coeff > 0:
            total = self.sum_over_sequence_shards(counts.to(logits.dtype))
            aux = coeff * e / (k * tokens * tokens) * (total * scores.sum(dim=0)).sum()
        elif kind == "seq_aux_loss" and coeff > 0:
            b, s = shape[0], shape[1] * self.sequence_shards
            per_seq = torch.zeros(b, e, device=logits.device, dtype=logits.dtype)
            per_seq.scatter_add_(1, idx.view(b, -1), torch.ones_like(idx.view(b, -1), dtype=logits.dtype))
            per_seq = self.sum_over_sequence_shards(per_seq)
            aux = coeff / b * (per_seq * e / (s * k) * scores.view(b, -1, e).sum(dim=1) / s).sum()
        z = logits.new_zeros(())
        if cfg.moe_z_loss_coeff:
            z = cfg.moe_z_loss_coeff * torch.logsumexp(logits, dim=-1).square().sum() / tokens
        if not (aux.requires_grad or z.requires_grad):
            return None
        return torch.stack([aux, z])

    @torch.no_grad()
    def _record(self, counts, aux, dropped: int, assigned: int) -> None:
        self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        a, z = (aux.detach().double().tolist() if aux is not None else (0.0, 0.0))
        self.stats += torch.tensor([a, z, dropped, assigned, 1.0], dtype=torch.float64, device=self.stats.device)

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing: bias += rate * sign(mean load - load) (``load``: tokens per expert in the global
        batch)."""
        if self.expert_bias is not None:
            load = load.to(self.expert_bias.device, torch.float32)
            self.expert_bias += self.cfg.moe_router_bias_update_rate * torch.sign(load.mean() - load)

    @torch.no_grad()
    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.stats.zero_()

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.experts.w1, 0.0, std)
        nn.init.normal_(self.experts.w3, 0.0, std)
        nn.init.normal_(self.experts.w2, 0.0, out_std)
        for bias in (self.experts.w1_bias, self.experts.w2_bias, self.experts.w3_bias):
            if bias is not None:
                nn.init.zeros_(bias)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        if self.tid2eid is not None:  # token t -> experts t k, t k + 1, ... (mod E): k distinct ones when k <= E
            rows, k = self.tid2eid.shape
            ids = torch.arange(rows * k, device=self.tid2eid.device).view(rows, k)
            self.tid2eid.copy_(ids % self.cfg.num_experts)
        self.reset_stats()


class MoEBlock(nn.Module):
    attention_class: type = Attention  # a block kind with other attention (megapipe.models.mla) sets its own

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.attention_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.attention = self.attention_class(cfg, layer_id)
        self.ffn_norm = build_norm(cfg.norm_type, cfg.hidden_size, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None, cache=None,
                mask: Optional[DocumentMask] = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache, mask)
        return h + self.moe(self.ffn_norm(h))


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(global layer index, MoE layer) of every MoE block this model (or pipeline stage) holds, the multi-token
    prediction modules' blocks included (index num_layers + depth - 1)."""
    layers = getattr(model, "layers", None) or {}
    blocks = [(int(key), block) for key, block in layers.items()]
    blocks += [(m.layer_id, m.block) for m in getattr(model, "mtp", None) or []]
    return [(i, block.moe) for i, block in blocks if isinstance(getattr(block, "moe", None), MoE)]


def moe_tp_plan(block: MoEBlock, sp: bool) -> dict:
    """Attention as in the dense block; the MoE layer is not split by TP (expert tensor parallelism is 1): it runs
    on the TP group's whole (all-gathered) sequence on every TP rank, and each keeps its part of the output. Its
    parameters are replicated DTensors (``replicated_style``): the router and experts compute with their local
    tensors, the shared experts on the local input; their gradients come out whole on every TP rank."""
    return {**attention_tp_plan(block, sp), **moe_layer_tp_plan(block, sp)}


def moe_layer_tp_plan(block: nn.Module, sp: bool) -> dict:
    """``moe_tp_plan``'s entries for the block's ``moe`` layer (no norms)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    plan = {}
    act = Shard(1) if sp else Replicate()
    plan["moe"] = PrepareModuleInputOutput(
        input_layouts=(act,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(act,), use_local_output=True,
    )
    plan["moe.gate"] = replicated_style(hooks=False)
    plan["moe.experts"] = replicated_style(hooks=False)
    for name in ("shared_experts", "shared_gate"):
        if getattr(block.moe, name) is not None:
            plan[f"moe.{name}"] = replicated_style()
    return plan


_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _hf_names(moe: dict[str, str]) -> dict[str, str]:
    """Attention as in the dense Llama-shaped block, plus the MoE layer's names; an ``experts.wN`` tensor [E, ...] is E
    HF tensors, ``{e}`` standing for the expert index (megapipe.checkpoint.hf.moe)."""
    attention = {k: v for k, v in DENSE.hf_names["llama"].items() if not k.startswith("feed_forward")}
    return {**attention, **moe}


MOE = register_block(BlockSpec(
    name="moe",
    module=MoEBlock,
    tp_plan=moe_tp_plan,
    hf_names={
        "qwen_moe": _hf_names({  # Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
            "moe.gate": "mlp.gate",
            **{f"moe.experts.{w}": f"mlp.experts.{{e}}.{hf}.weight" for w, hf in _EXPERTS.items()},
            **{f"moe.shared_experts.{w}": f"mlp.shared_expert.{hf}" for w, hf in _EXPERTS.items()},
            "moe.shared_gate": "mlp.shared_expert_gate",
        }),
        # MixtralForCausalLM: the Hub's block_sparse_moe names (transformers 5 fuses them when it loads, and writes
        # them back when it saves)
        # GptOssForCausalLM: the router with its bias, the attention's sinks; the fused experts are converted apart
        # (megapipe.checkpoint.hf.gpt_oss)
        "gpt_oss": _hf_names({"moe.gate": "mlp.router", "attention.sinks": "self_attn.sinks"}),
        "mixtral": _hf_names({
            "moe.gate": "block_sparse_moe.gate",
            **{f"moe.experts.{w}": f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in _EXPERTS},
        }),
    },
))
