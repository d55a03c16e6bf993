"""One training step over a list of micro-batches, for any layout; gradient clipping across sharded gradients.

``train_step(model, microbatches, dims, loss)`` runs forward + backward with gradient accumulation and returns the
global batch's loss. Every micro-batch is a dict of tensors (first dimension = rows; see
megapipe.models.objective). Normalisation is global and token-weighted: the units the loss counts (valid tokens)
are summed over every micro-batch and every data-parallel / context-parallel rank before the step, and each
micro-batch backpropagates ``its loss sum * dp_cp / global units`` (the gradient reduction then averages over the
dp_cp ranks), so a masked token never re-weights the others and 1, 2 or 4 micro-batches give the same gradients.

With pp > 1 the micro-batches are concatenated and the pipeline schedule cuts them again; its loss gets the rows
of its micro-batch as ``target`` and takes every batch key from them (PipelineModel.schedule_loss). With cp > 1
each rank keeps its zig-zag chunk of every per-token tensor. With tp > 1 the loss runs under ``loss_parallel`` on
vocabulary-sharded logits. DDP (and FSDP in its distributed-optimizer mode) skip the gradient reduction until the
last micro-batch. The optimizer step is the caller's.

``context``: a factory of a context manager wrapped around each forward (e.g. autocast); ``scale_loss``: fp16
loss scaling applied to what is backpropagated (reported values are unscaled); ``fused``: the loss takes the final
hidden states and applies the output projection itself (the fused output + cross-entropy; run_loss).

MoE layers add their balancing losses to backward themselves (megapipe.models.moe), weighted as a mean over the
global batch's micro-batches (``set_aux_loss_scale``); their statistics become ``moe/...`` metrics and the global
tokens per expert come back in ``StepResult.expert_load`` for the aux-loss-free bias update after the optimizer step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megapipe.models.objective import Loss, ModelOutput, TokenCrossEntropy, mtp_metric, with_mtp_streams
from megapipe.parallel.cp import shard_sequence
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.dp import set_gradient_sync
from megapipe.parallel.ep import moe_step_stats, reset_moe_stats, set_aux_loss_scale
from megapipe.parallel.pp import IMAGE_INPUTS, V_SCHEDULES, PipelineModel, image_inputs, sync_tied_grads
from megapipe.parallel.tp import loss_parallel_context

_null = contextlib.nullcontext


@dataclass
class StepResult:
    loss: torch.Tensor  # the global batch's loss: sum over all units / number of units (same on every rank)
    units: int  # loss units (valid tokens) in the global batch
    metrics: dict[str, float] = field(default_factory=dict)  # the loss's extra metrics, normalised the same way
    expert_load: dict = field(default_factory=dict)  # MoE layer -> tokens per expert in the global batch

    def item(self) -> float:
        return self.loss.item()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _device(model) -> torch.device:
    p = next(model.parameters(), None)
    if p is None:
        return torch.device("cpu")
    return p.to_local().device if hasattr(p, "to_local") else p.device


def local_batch(mb: dict, dims: ParallelDims) -> dict:
    """This rank's part of a micro-batch: with cp > 1, the zig-zag chunk of every tensor that runs along the
    sequence (dimension 1 as long as ``tokens``'), the rest as it is."""
    if dims.cp == 1:
        return mb
    seq, r = mb["tokens"].shape[1], dims.local_rank("cp")
    return {k: shard_sequence(v, dims.cp, r) if v.dim() > 1 and v.shape[1] == seq else v for k, v in mb.items()}


def local_batches(model, loss: Loss, microbatches: list[dict], dims: ParallelDims) -> list[dict]:
    """This rank's part of each micro-batch (``local_batch``); when the model's MTP modules run and the layout splits
    the sequence (cp) or the stages (pp: the last stage gets hidden states), their shifted token and label streams
    are made first, from the whole rows (``with_mtp_streams``)."""
    if mtp_weight(model, loss) is not None and (dims.cp > 1 or isinstance(model, PipelineModel)):
        microbatches = [with_mtp_streams(mb, model.cfg.mtp_depth) for mb in microbatches]
    return [local_batch(mb, dims) for mb in microbatches]


def _dp_cp_sum(value: torch.Tensor, dims: ParallelDims, with_pp: bool = False) -> torch.Tensor:
    """Sum over the ranks that see different data (dp x cp) and, with ``with_pp``, over pipeline ranks (only the
    last stage holds the loss)."""
    if dims.world_mesh is None:
        return value
    if with_pp and dims.pp > 1:
        dist.all_reduce(value, group=dims.group("pp"))
    if dims.dp_size * dims.cp > 1:
        dist.all_reduce(value, group=dims.group("dp_cp"))
    return value


def count_units(loss: Loss, microbatches: list[dict], dims: ParallelDims, device) -> int:
    local = sum(int(loss.units(mb)) for mb in microbatches)
    total = _dp_cp_sum(torch.tensor(float(local), dtype=torch.float64, device=device), dims)
    return int(total.item())


MODEL_INPUTS = (("position_ids", "positions"), ("document_ids", "document_ids"), ("prefix_ids", "prefix_ids"),
                ("pixel_values", "pixel_values"), ("image_grid_thw", "image_grid_thw"))


def model_kwargs(mb: dict) -> dict:
    """The model's keyword inputs a micro-batch carries besides its tokens (positions, packed documents)."""
    return {arg: mb[key] for key, arg in MODEL_INPUTS if key in mb}


def model_output(model, mb: dict) -> ModelOutput:
    """The model's logits on a micro-batch: positions and document ids go in when the batch carries them."""
    return ModelOutput(logits=model(mb["tokens"], **model_kwargs(mb)))


def mtp_weight(model, loss: Loss) -> Optional[float]:
    """Each MTP depth's loss weight when ``loss`` takes MTP outputs and ``model`` has MTP modules; None: MTP off."""
    if not loss.mtp or getattr(model, "mtp", None) is None:
        return None
    cfg = model.cfg
    return cfg.mtp_loss_scaling_factor / cfg.mtp_depth


def run_loss(model, loss: Loss, mb: dict, fused: bool = False):
    """The loss of one micro-batch. ``fused`` (the fused output + cross-entropy): the loss runs on the final hidden
    states inside the model's own forward, where FSDP holds the whole output weight (outside it is a shard). The
    model's MTP modules run when the loss takes their outputs."""
    weight = mtp_weight(model, loss)
    mtp = {} if weight is None else {"mtp": True, **{k: mb[k] for k in ("mtp_tokens",) if k in mb}}
    if fused:
        def head(hidden, output_weight, mtp_hidden=None):
            return loss(ModelOutput(hidden=hidden, output_weight=lambda: output_weight, mtp=mtp_hidden,
                                    mtp_weight=weight or 0.0), mb)

        return model(mb["tokens"], **model_kwargs(mb), head=head, **mtp)
    if weight is None:
        return loss(model_output(model, mb), mb)
    logits, mtp_logits = model(mb["tokens"], **model_kwargs(mb), **mtp)
    return loss(ModelOutput(logits=logits, mtp=mtp_logits, mtp_weight=weight), mb)


class _Totals:
    """Sums of a step's loss and metrics (this rank), reduced and normalised at the end."""

    def __init__(self, device):
        self.loss = torch.zeros((), dtype=torch.float32, device=device)
        self.metrics: dict[str, torch.Tensor] = {}

    def add(self, result) -> None:
        self.loss += _full(result.total.detach()).float()
        for k, v in result.metrics.items():
            self.metrics[k] = self.metrics.get(k, 0.0) + _full(v.detach()).float()

    def finish(self, dims: ParallelDims, units: int, with_pp: bool) -> StepResult:
        names = sorted(self.metrics)
        packed = torch.stack([self.loss, *[self.metrics[k] for k in names]]).to(torch.float64)
        packed = _dp_cp_sum(packed, dims, with_pp) / units if units else packed * float("nan")
        values = packed.tolist()
        return StepResult(packed[0].float(), units, dict(zip(names, values[1:], strict=True)))


def train_step(model, microbatches: list[dict], dims: ParallelDims, loss: Optional[Loss] = None,
               context: Optional[Callable] = None, scale_loss: Optional[Callable] = None,
               fused: bool = False) -> StepResult:
    loss = loss or TokenCrossEntropy()
    context = context or _null
    device = _device(model)
    microbatches = local_batches(model, loss, microbatches, dims)
    units = count_units(loss, microbatches, dims, device)
    # what each micro-batch backpropagates is its sum times this: the reduction over dp_cp ranks then averages
    factor = dims.dp_size * dims.cp / units if units else 0.0
    pipeline = isinstance(model, PipelineModel)
    n = model.n_microbatches if pipeline else len(microbatches)
    # balancing losses: a mean over the dp_size * n micro-batches, each counted once over its cp ranks
    loss_scale = float(scale_loss(torch.ones(()))) if scale_loss is not None else 1.0
    set_aux_loss_scale(model, loss_scale * dims.cp / n)
    if pipeline:
        return _with_moe(model, dims, _pipeline_step(model, microbatches, dims, loss, factor, units, context,
                                                     scale_loss))
    totals = _Totals(device)
    skip_sync = dims.dp_mode == "ddp" or not dims.fsdp_reshard_after_forward
    for i, mb in enumerate(microbatches):
        if n > 1 and skip_sync:
            set_gradient_sync(model, i == n - 1)
        with loss_parallel_context(dims.loss_parallel):
            with context():
                result = run_loss(model, loss, mb, fused)
                objective = result.objective(factor)
            (scale_loss(objective) if scale_loss is not None else objective).backward()
        totals.add(result)
    return _with_moe(model, dims, totals.finish(dims, units, with_pp=False))


def _with_moe(model, dims: ParallelDims, result: StepResult) -> StepResult:
    metrics, load = moe_step_stats(model, dims)
    result.metrics.update(metrics)
    result.expert_load = load
    return result


def _pipeline_step(model: PipelineModel, microbatches, dims, loss, factor, units, context, scale_loss,
                   eval_only=False) -> StepResult:
    batch = {k: torch.cat([mb[k] for mb in microbatches]) for k in microbatches[0] if k not in IMAGE_INPUTS}
    images = image_inputs(model, microbatches, batch["tokens"])
    rows = torch.arange(batch["tokens"].shape[0], device=batch["tokens"].device)
    totals = _Totals(_device(model))
    if loss.mtp and getattr(model.cfg, "mtp_depth", 0):  # every stage reduces the last stage's MTP metrics with it
        totals.metrics = {mtp_metric(k): torch.zeros((), device=totals.loss.device)
                          for k in range(1, model.cfg.mtp_depth + 1)}
    model.begin_step(loss, batch, factor, scale_loss, mtp_weight(model, loss))
    run = model.schedule.eval if eval_only else model.schedule.step
    saved_grads = None
    if eval_only and dims.pp_schedule in V_SCHEDULES:
        # torch 2.13's V schedules hang when run forward-only: run the full step and put the gradients back
        run, saved_grads = model.schedule.step, [(p, p.grad) for p in model.parameters()]
    with loss_parallel_context(dims.loss_parallel), context(), torch.enable_grad() if saved_grads else _null():
        args = (batch["tokens"],) if model.has_first_stage else ()
        # the MTP modules (last stage) embed the tokens ahead: the schedule cuts them into its micro-batches
        mtp = {"mtp": True, "mtp_tokens": batch["mtp_tokens"]} if "mtp_tokens" in batch else {}
        # return_outputs=False: the last stage does not keep every micro-batch's logits until the step ends
        run(*args, target=rows if model.has_last_stage else None, losses=[], return_outputs=False, **mtp, **images)
    for p, g in saved_grads or []:
        p.grad = g
    if not eval_only:
        sync_tied_grads(model, dims)
    for result in model.end_step():
        totals.add(result)
    return totals.finish(dims, units, with_pp=True)


@torch.no_grad()
def eval_step(model, microbatches: list[dict], dims: ParallelDims, loss: Optional[Loss] = None,
              context: Optional[Callable] = None, fused: bool = False) -> StepResult:
    """The loss over the micro-batches without gradients (all layouts, incl. pipeline schedules)."""
    loss = loss or TokenCrossEntropy()
    context = context or _null
    device = _device(model)
    microbatches = local_batches(model, loss, microbatches, dims)
    units = count_units(loss, microbatches, dims, device)
    if isinstance(model, PipelineModel):
        result = _pipeline_step(model, microbatches, dims, loss, 0.0, units, context, None, eval_only=True)
        reset_moe_stats(model)  # a V schedule evaluates through a training step (see _pipeline_step)
        return result
    totals = _Totals(device)
    for mb in microbatches:
        with loss_parallel_context(dims.loss_parallel), context():
            totals.add(run_loss(model, loss, mb, fused))
    return totals.finish(dims, units, with_pp=False)


def clip_grad_norm_(model, max_norm: float, dims: ParallelDims | None = None, norm_type: float = 2.0) -> torch.Tensor:
    """Global gradient norm over every shard (DTensor meshes, pipeline stages), clipped to max_norm when > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    if dims is None or dims.world_mesh is None:
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, foreach=True)
    groups: dict = {}
    for p in params:  # grads on different meshes/placements (or plain) cannot go through one foreach call
        g = p.grad
        key = (id(g.device_mesh), tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(p)
    sq = torch.zeros((), device=_device(model))
    for group in groups.values():
        counted = [p.grad for p in group if not getattr(p, "tied_replica", False)]  # the tied copy counts once
        if counted:
            sq = sq + _full(torch.nn.utils.get_total_norm(counted, norm_type, foreach=True)) ** norm_type
    if dims.pp > 1:
        dist.all_reduce(sq, group=dims.group("pp"))
    total = sq ** (1.0 / norm_type)
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
