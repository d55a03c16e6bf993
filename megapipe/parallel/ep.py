"""Expert parallelism and the MoE layers' distributed pieces.

``apply_moe(model, dims)`` prepares a model's MoE layers for a layout (after TP, before recompute and FSDP):
- ep > 1: each layer's 3-D expert weights become DTensors sharded by expert over the "ep" mesh (so checkpoints
  keep every expert under its global index and reshard to any ep size), and the layer's tokens, sorted by expert,
  travel to the rank holding their expert and back with ``all_to_all_single`` (uneven splits; a rank that sends
  or receives no token still joins every collective and gives every local expert a gradient). FSDP then shards
  the experts over "edp_cp" (``apply_fsdp``: the experts' gradients are divided by the whole data-parallel size,
  as the dense ones, not by edp's);
- cp > 1: the balancing losses' token counts are summed over the ranks a sequence is split over.

``moe_step_stats(model, dims)`` after a step's backward: every MoE layer's statistics (tokens per expert, aux / z
values, dropped assignments) summed over the data-parallel and context-parallel ranks and the pipeline stages, as
metrics plus the global tokens per expert; ``update_expert_biases`` applies the aux-loss-free bias update from those
counts after the optimizer step, once per global batch, identically on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megapipe.models.moe import STATS, local, moe_layers


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


class AllToAllDispatch:
    """Experts [r * E/ep, (r + 1) * E/ep) live on ep rank r. ``dispatch`` takes this rank's tokens sorted by global
    expert and returns the tokens for this rank's experts, sorted by local expert, with their counts."""

    def __init__(self, group, ep: int, num_experts: int):
        self.group, self.ep, self.local = group, ep, num_experts // ep

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor):
        counts = counts.to(torch.int64)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank, local expert]
        received = received.view(self.ep, self.local)
        send = counts.view(self.ep, self.local).sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()
        rows = _AllToAll.apply(tokens, recv, send, self.group)
        # rows come by source rank, then by local expert: put them in local-expert order
        expert_of = torch.arange(self.local, device=rows.device).repeat(self.ep)
        order = torch.argsort(expert_of.repeat_interleave(received.flatten().to(rows.device)), stable=True)
        return rows[order], received.sum(dim=0), (order, send, recv)

    def combine(self, out: torch.Tensor, state) -> torch.Tensor:
        order, send, recv = state
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=order.device)
        return _AllToAll.apply(out[back], send, recv, self.group)


def _sum_over(group):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, group=group)
        return t

    return reduce


def apply_moe(model: nn.Module, dims) -> None:
    """Expert parallelism over dims' "ep" mesh and the context-parallel token counts, in place (see module doc)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    layers = moe_layers(model)
    if not layers:
        return
    for _, moe in layers:
        if dims.cp > 1:
            moe.sum_over_sequence_shards = _sum_over(dims.group("cp"))
            moe.sequence_shards = dims.cp
        if dims.ep > 1:
            mesh = dims.mesh("ep")
            experts = moe.experts
            for name, full in list(experts.named_parameters(recurse=False)):  # weights and biases: [E, ...]
                # every rank built the same weights: each keeps its experts' slice (src_data_rank=None: no scatter);
                # under TP they are replicated DTensors over the TP ranks, whose local tensor is the whole weight
                shard = distribute_tensor(local(full.detach()), mesh, [Shard(0)], src_data_rank=None)
                setattr(experts, name, nn.Parameter(shard, requires_grad=full.requires_grad))
            moe.dispatcher = AllToAllDispatch(mesh.get_group(), dims.ep, moe.cfg.num_experts)


def reset_moe_stats(model: nn.Module) -> None:
    for _, moe in moe_layers(model):
        moe.reset_stats()


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The weight in backward of every auxiliary loss (MoE balancing losses, the DSA indexer's loss; see
    megapipe.parallel.step): every module with an ``aux_loss_scale``."""
    for module in model.modules():
        if hasattr(module, "aux_loss_scale"):
            module.aux_loss_scale = scale


# --------------------------------------------------------------------------------------------------- statistics


def _global_stats(model: nn.Module, dims) -> tuple[dict[int, torch.Tensor], list[int]]:
    """layer -> [tokens per expert..., *STATS] summed over dp x cp ranks and pipeline stages (all MoE layers of the
    model on every rank: stages fill in their own)."""
    cfg = model.cfg
    ids = cfg.moe_layers
    layers = dict(moe_layers(model))
    device = next(iter(layers.values())).stats.device if layers else torch.device("cpu")
    table = torch.zeros(len(ids), cfg.num_experts + len(STATS), dtype=torch.float64, device=device)
    for row, i in enumerate(ids):
        if i in layers:
            table[row, : cfg.num_experts] = layers[i].tokens_per_expert
            table[row, cfg.num_experts:] = layers[i].stats
    if dims is not None and dims.world_mesh is not None:
        if dims.dp_size * dims.cp > 1:
            dist.all_reduce(table, group=dims.group("dp_cp"))
        if dims.pp > 1:
            dist.all_reduce(table, group=dims.group("pp"))
    return {i: table[row] for row, i in enumerate(ids)}, ids


def moe_step_stats(model: nn.Module, dims) -> tuple[dict[str, float], dict[int, torch.Tensor]]:
    """(metrics ``moe/...``, per layer ``moe/L{i}/...``; layer -> global tokens per expert) of the step so far, then
    every layer's statistics are reset. Empty for a model without MoE layers."""
    if not getattr(getattr(model, "cfg", None), "is_moe", False):
        return {}, {}
    layers = dict(moe_layers(model))
    table, ids = _global_stats(model, dims)
    e = model.cfg.num_experts
    cp = dims.cp if dims is not None else 1
    out: dict[str, float] = {}
    sums = {"aux_loss": 0.0, "z_loss": 0.0, "load_max_over_mean": 0.0}
    dropped = assigned = 0.0
    loads = {}
    for i in ids:
        row = table[i]
        load, st = row[:e], dict(zip(STATS, row[e:].tolist(), strict=True))
        loads[i] = load
        calls = st["calls"] / cp  # every context-parallel rank counted the same micro-batch
        per_layer = {
            "aux_loss": st["aux"] / calls if calls else 0.0,
            "z_loss": st["z"] / calls if calls else 0.0,
            "load_max_over_mean": (load.max() / load.mean()).item() if load.sum() > 0 else 0.0,
        }
        for k, v in per_layer.items():
            out[f"moe/L{i}/{k}"] = v
            sums[k] += v
        dropped, assigned = dropped + st["dropped"], assigned + st["assigned"]
    for k, v in sums.items():
        out[f"moe/{k}"] = v / len(ids) if k == "load_max_over_mean" else v
    out["moe/dropped_fraction"] = dropped / assigned if assigned else 0.0
    for m in layers.values():
        m.reset_stats()
    return out, loads


def update_expert_biases(model: nn.Module, loads: dict[int, torch.Tensor]) -> None:
    """The aux-loss-free update of every expert bias this rank holds, from the global batch's tokens per expert."""
    for i, moe in moe_layers(model):
        if i in loads:
            moe.update_expert_bias(loads[i])
