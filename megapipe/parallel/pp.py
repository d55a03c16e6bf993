"""Pipeline parallelism: cut the model into stages and run them with a torch.distributed.pipelining schedule.

A stage is the model itself with the layers of other stages deleted (layer keys keep their global numbers, so
checkpoints stay layout-free), ``tok_embeddings``/``pos_embeddings`` only on the first stage and ``norm``/``output``
only on the last (the model's forward accepts hidden states and returns them when those are None), a
vision-language model's tower on the first (megapipe.models.vision takes its inputs batch-first). Multi-token
prediction modules run on the last stage, after the output head as Megatron places them; they embed the tokens
ahead, so that stage keeps a replica of the embedding table, summed with the first stage's like a tied output's.
Stage placement: one stage per rank for GPipe/1F1B; "loop" (stages r, r+P, ...) for Interleaved1F1B; "V" (stages r
and 2P-1-r) for ZBVZeroBubble and DualPipeV. ``PipelineModel`` gathers this rank's stages under the model's own
attribute names, so ``model.parameters()``/``state_dict()`` look like a (partial) Transformer to the optimizer and
the checkpoint code.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from megapipe.models.moe import moe_layers
from megapipe.models.objective import ModelOutput
from megapipe.models.vision import mrope_positions, rowwise_images

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def layer_split(num_layers: int, num_stages: int, split: list[int] | None = None,
                costs: list[int] | None = None) -> list[int]:
    """Layers per stage: the given split; else, when the layers cost the same (or ``costs`` is None), as even as
    possible with the extra layers on middle stages first (the first and last stages also carry the embedding and
    the output head); else, layers of different ``costs`` (a hybrid model's Mamba, attention and MLP layers, dense
    layers among MoE ones), the contiguous split whose costliest stage costs least, of those the one that leaves the
    first and last stages the least (each stage gets at least one layer)."""
    if split is not None:
        return list(split)
    if costs is not None and len(set(costs)) > 1:
        return _balanced_split(costs, num_stages)
    base, rest = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1] if num_stages > 2 else list(range(num_stages))
    for i in order[:rest]:
        counts[i] += 1
    return counts


def _balanced_split(costs: list[int], num_stages: int) -> list[int]:
    n, k = len(costs), num_stages
    if n < k:
        raise ValueError(f"{n} layers cannot fill {k} pipeline stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> int:  # layers i..j-1
        return prefix[j] - prefix[i]

    # best[s][j]: the least costliest-stage cost of layers 0..j-1 in s stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for s in range(1, k + 1):
        for j in range(s, n - (k - s) + 1):
            best[s][j] = min(max(best[s - 1][i], cost(i, j)) for i in range(s - 1, j))
    bound = best[k][n]
    # of the splits whose stages all cost <= bound: the least first + last stage cost
    first = [[None] * (n + 1) for _ in range(k + 1)]  # s stages over layers 0..j-1 within bound: least first stage
    for j in range(1, n + 1):
        if cost(0, j) <= bound:
            first[1][j] = (cost(0, j), [j])
    for s in range(2, k):
        for j in range(s, n + 1):
            options = [(first[s - 1][i][0], first[s - 1][i][1] + [j - i]) for i in range(s - 1, j)
                       if first[s - 1][i] is not None and cost(i, j) <= bound]
            first[s][j] = min(options) if options else None
    if k == 1:
        return [n]
    ends = [(first[k - 1][i][0] + cost(i, n), -first[k - 1][i][1][0], first[k - 1][i][1] + [n - i])
            for i in range(k - 1, n) if first[k - 1][i] is not None and cost(i, n) <= bound]
    return min(ends)[2]


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


def split_stage(model: nn.Module, stage: int, counts: list[int]) -> nn.Module:
    """Stage ``stage`` of ``model`` (modified in place: pass a copy when this rank holds several stages)."""
    first, last = stage == 0, stage == len(counts) - 1
    start = sum(counts[:stage])
    keep = {str(i) for i in range(start, start + counts[stage])}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    mtp = getattr(model, "mtp", None) is not None
    if last and not first and model.output is None and not mtp:
        # tied output on a stage without the embedding: a replica of the embedding table, kept equal to it by
        # summing the two gradients after each backward (Megatron's embedding group; see sync_tied_grads)
        weight = model.tok_embeddings.weight
        model.output = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                                 dtype=weight.dtype)
        with torch.no_grad():
            model.output.weight.copy_(weight)
    if not first:
        if getattr(model, "visual", None) is not None:  # a vision-language model's tower feeds the first stage
            model.visual = None
        if not (last and mtp):  # the MTP modules' (and a tied output's) replica of the embedding stays
            model.tok_embeddings = None
        if getattr(model, "pos_embeddings", None) is not None:
            model.pos_embeddings = None
    if not last:
        model.norm = None
        model.output = None
        if getattr(model, "hc_head", None) is not None:  # DeepSeek-V4: the streams pass between stages whole
            model.hc_head = None
        if mtp:
            model.mtp = None
    elif mtp:  # a stage's outputs are tensors: (logits, [depth 1, ...]) becomes (logits, depth 1, ...)
        model.register_forward_hook(lambda _m, _args, out: (out[0], *out[1]) if isinstance(out, tuple) else out)
    return model


def needs_embedding_replica(cfg) -> bool:
    """Whether the last pipeline stage holds a replica of the embedding table (a tied output, MTP modules)."""
    return cfg.tie_embeddings or bool(cfg.mtp_depth)


class _WeightHolder(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight


def tied_groups(dims) -> dict:
    """For every (dp_replicate, dp_shard, cp, tp) coordinate, the group of its first and last pipeline ranks."""
    import torch.distributed as dist

    mesh = dims.world_mesh.mesh  # [pp, dp_replicate, dp_shard, cp, tp] of global ranks
    mine = None
    for coord in torch.cartesian_prod(*[torch.arange(n) for n in mesh.shape[1:]]).view(-1, mesh.dim() - 1):
        ranks = [int(mesh[(0, *coord.tolist())]), int(mesh[(-1, *coord.tolist())])]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def sync_tied_grads(model, dims) -> None:
    """Sum the gradients of a tied embedding and of its replica on the last stage, so both get the same update."""
    import torch.distributed as dist

    group = getattr(model, "tied_group", None)
    if group is None:
        return
    weight = model.tok_embeddings.weight
    grad = weight.grad
    if grad is None:
        grad = weight.grad = torch.zeros_like(weight)
    if hasattr(grad, "placements") and tuple(grad.placements) != tuple(weight.placements):
        grad = weight.grad = grad.redistribute(weight.device_mesh, weight.placements)  # same layout on both ends
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    dist.all_reduce(local, group=group)


class _MoEStatsGuard:
    """Keeps torch's pipeline metadata inference out of a stage's MoE statistics. On the first step, and on the first
    training step after an evaluation, torch runs each stage once on inferred (uninitialised, for later stages)
    inputs, forward and backward, before the step's micro-batches; it is then called once more than there are
    micro-batches. The statistics gathered before its second call are set aside, and dropped at the end of the step
    when that extra call happened (kept otherwise)."""

    def __init__(self, part: nn.Module):
        self.layers = [m for _, m in moe_layers(part)]
        self.calls, self.aside = 0, None
        part.register_forward_pre_hook(self._pre_forward)

    def begin(self) -> None:
        self.calls, self.aside = 0, None

    def _pre_forward(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return
        self.calls += 1
        if self.calls == 2:
            self.aside = [(m.tokens_per_expert.clone(), m.stats.clone()) for m in self.layers]
            for m in self.layers:
                m.reset_stats()

    def end(self, n_microbatches: int) -> None:
        if self.aside is not None and self.calls == n_microbatches:  # no inference ran: the first call was real
            with torch.no_grad():
                for m, (tokens, stats) in zip(self.layers, self.aside, strict=True):
                    m.tokens_per_expert += tokens
                    m.stats += stats
        self.calls, self.aside = 0, None


class PipelineModel(nn.Module):
    """This rank's pipeline stages seen as one (partial) model: same attribute and parameter names as the full
    model. Run it with ``schedule`` (see megapipe.parallel.step), not by calling it."""

    def __init__(self, parts: list[nn.Module], stage_indices: list[int], num_stages: int, tied: bool = False):
        super().__init__()
        self.tok_embeddings = self.pos_embeddings = self.norm = self.output = self.mtp = None
        self.hc_head = self.visual = None
        self.layers = nn.ModuleDict()
        for part in parts:
            for name in ("tok_embeddings", "pos_embeddings", "norm", "output", "mtp", "hc_head", "visual"):
                if getattr(part, name, None) is not None:
                    setattr(self, name, getattr(part, name))
            for key, block in part.layers.items():
                self.layers[key] = block
        if tied and self.output is not None and self.tok_embeddings is None:
            # the replica of a tied embedding is saved/loaded under the embedding's own name, and its gradient
            # counts once in the global norm
            self.output.weight.tied_replica = True
            self.tok_embeddings, self.output = _WeightHolder(self.output.weight), None
        if self.tok_embeddings is not None and 0 not in stage_indices:  # the MTP modules' replica
            self.tok_embeddings.weight.tied_replica = True
        self.layers = nn.ModuleDict(dict(sorted(self.layers.items(), key=lambda kv: int(kv[0]))))
        object.__setattr__(self, "parts", parts)
        self.stage_indices = stage_indices
        self.num_stages = num_stages
        self.schedule = None
        self.n_microbatches = 1  # what the schedule cuts a step's batch into (set with the schedule)
        self.cfg = getattr(parts[0], "cfg", None)
        self._step = None  # (loss, batch, factor, scale_loss, mtp_weight) of the step being run, see begin_step
        self._moe = [_MoEStatsGuard(part) for part in parts if moe_layers(part)]

    def begin_step(self, loss, batch: dict, factor: float, scale_loss=None, mtp_weight=None) -> None:
        """Before a schedule step: the recipe's loss, the step's whole (local) batch, the normalising factor, each
        MTP depth's loss weight when the last stage runs the MTP modules."""
        self._step, self._results = (loss, batch, factor, scale_loss, mtp_weight), {}
        for guard in self._moe:
            guard.begin()

    def schedule_loss(self, output, rows):
        """The schedule's loss for one pipeline micro-batch: ``rows`` (its target) are the micro-batch's rows of the
        step's batch, so the loss sees every batch key. Keyed by the first row: torch may run the first micro-batch
        once more while it infers shapes, and that result then replaces itself instead of counting twice."""
        loss, batch, factor, scale_loss, mtp_weight = self._step
        rows = rows.to(torch.long)
        mb = {k: v.index_select(0, rows.to(v.device)) for k, v in batch.items()}
        if mtp_weight is None:
            result = loss(ModelOutput(logits=output), mb)
        else:  # (logits, each MTP depth's logits)
            result = loss(ModelOutput(logits=output[0], mtp=list(output[1:]), mtp_weight=mtp_weight), mb)
        self._results[int(rows[0])] = result
        objective = result.objective(factor)
        return scale_loss(objective) if scale_loss is not None else objective

    def end_step(self) -> list:
        """The loss results of the step's micro-batches (on the last stage; empty elsewhere)."""
        results = [self._results[k] for k in sorted(self._results)]
        self._step, self._results = None, {}
        for guard in self._moe:
            guard.end(self.n_microbatches)
        return results

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline-parallel model runs through its schedule: use megapipe.parallel.step")


IMAGE_INPUTS = ("pixel_values", "image_grid_thw")  # a micro-batch's images: flat over its rows


def image_inputs(model: PipelineModel, microbatches: list[dict], tokens: torch.Tensor) -> dict:
    """A vision-language model's keyword inputs to this rank's stages for a step's micro-batches (``tokens``: all
    their rows), batch-first as the schedule cuts them (megapipe.models.vision): M-RoPE positions for every stage,
    the images row by row for the first stage's tower. Empty when no micro-batch holds an image."""
    with_images = [mb for mb in microbatches if "image_grid_thw" in mb]
    if not with_images:
        return {}
    cfg = model.cfg
    grids = torch.cat([mb["image_grid_thw"] for mb in with_images])
    merge = cfg.vision_spatial_merge_size
    out = {"mrope_position_ids": mrope_positions(tokens, grids, cfg.image_token_id, merge)[0].movedim(0, 1)}
    if model.visual is not None:
        pixels = torch.cat([mb["pixel_values"] for mb in with_images])
        out["pixel_values"], out["image_grid_thw"] = rowwise_images(tokens, pixels, grids, cfg.image_token_id, merge)
    return out


def split_model(model: nn.Module, dims, costs: list[int] | None = None) -> tuple[list[nn.Module], list[int], int]:
    """This rank's stage modules, their stage indices and the total number of stages; ``costs``: each layer's (see
    ``layer_split``)."""
    num_stages = dims.pp * dims.pp_virtual_stages
    counts = layer_split(len(model.layers), num_stages, dims.pp_layer_split, costs)
    ids = stage_ids(dims.local_rank("pp"), dims.pp, dims.pp_virtual_stages, dims.pp_schedule)
    parts = [split_stage(model if i == len(ids) - 1 else copy.deepcopy(model), s, counts) for i, s in enumerate(ids)]
    return parts, ids, num_stages


def build_schedule(parts, ids, num_stages, dims, n_microbatches: int, loss_fn, device) -> object:
    """The schedule; gradients are not scaled by it (scale_grads=False): the loss is already normalised by the
    global number of loss units (megapipe.parallel.step)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    group = dims.group("pp")
    stages = [PipelineStage(p, s, num_stages, torch.device(device), group=group) for p, s in zip(parts, ids, strict=True)]
    cls = get_schedule_class(dims.pp_schedule)
    if len(stages) == 1 and dims.pp_schedule in ("GPipe", "1F1B"):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
