"""One training step over a list of micro-batches, for any layout; gradient clipping across sharded gradients.

``train_step(model, microbatches, dims)`` runs forward + backward with gradient accumulation (the loss of each
micro-batch is divided by their number, so gradients are those of the global-batch mean; DDP, and FSDP in its
distributed-optimizer mode, skip the gradient reduction until the last micro-batch) and returns the global-batch
mean loss, identical on every rank. With pp > 1 it concatenates the micro-batches and lets the pipeline schedule
cut them into its own micro-batches. With cp > 1 each rank keeps its zig-zag chunks of tokens and labels. With
tp > 1 the loss runs under ``loss_parallel`` on vocabulary-sharded logits. The optimizer step is the caller's.

``context``: a factory of a context manager wrapped around each forward (e.g. autocast); ``scale_loss``: fp16
loss scaling applied to what is backpropagated (the returned loss is unscaled).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megapipe.parallel.cp import shard_sequence
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.dp import set_gradient_sync
from megapipe.parallel.pp import V_SCHEDULES, PipelineModel, sync_tied_grads
from megapipe.parallel.tp import cross_entropy, loss_parallel_context

_null = contextlib.nullcontext


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _inputs(mb: dict, dims: ParallelDims):
    tokens, labels = mb["tokens"], mb["labels"]
    if dims.cp > 1:
        r = dims.local_rank("cp")
        tokens, labels = shard_sequence(tokens, dims.cp, r), shard_sequence(labels, dims.cp, r)
    return tokens, labels


def _mean_over(value: torch.Tensor, dims: ParallelDims, names: tuple[str, ...]) -> torch.Tensor:
    """Sum over 'pp' (only the last stage holds the loss), average over the others (gloo has no AVG)."""
    for name in names:
        size = dims.pp if name == "pp" else dims.dp_size * dims.cp
        if dims.world_mesh is None or size == 1:
            continue
        dist.all_reduce(value, group=dims.group(name))
        if name != "pp":
            value /= size
    return value


def _device(model) -> torch.device:
    p = next(model.parameters(), None)
    if p is None:
        return torch.device("cpu")
    return p.to_local().device if hasattr(p, "to_local") else p.device


def train_step(model, microbatches: list[dict], dims: ParallelDims, loss_fn=cross_entropy, context=None,
               scale_loss=None) -> torch.Tensor:
    context = context or contextlib.nullcontext
    if isinstance(model, PipelineModel):
        return _pipeline_step(model, microbatches, dims, loss_fn, context, scale_loss)
    n = len(microbatches)
    device = _device(model)
    total = torch.zeros((), dtype=torch.float32, device=device)
    skip_sync = dims.dp_mode == "ddp" or not dims.fsdp_reshard_after_forward
    for i, mb in enumerate(microbatches):
        tokens, labels = _inputs(mb, dims)
        if n > 1 and skip_sync:
            set_gradient_sync(model, i == n - 1)
        with loss_parallel_context(dims.loss_parallel):
            with context():
                loss = loss_fn(model(tokens), labels) / n
            (scale_loss(loss) if scale_loss is not None else loss).backward()
        total += _full(loss.detach()).float()
    return _mean_over(total, dims, ("dp_cp",))


def _pipeline_step(model: PipelineModel, microbatches, dims, loss_fn, context, scale_loss, eval_only=False):
    parts = [_inputs(mb, dims) for mb in microbatches]
    tokens = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    model.loss_fn, model.scale_loss, model.unscaled_losses = loss_fn, scale_loss, []
    run = model.schedule.eval if eval_only else model.schedule.step
    saved_grads = None
    if eval_only and dims.pp_schedule in V_SCHEDULES:
        # torch 2.13's V schedules hang when run forward-only: run the full step and put the gradients back
        run, saved_grads = model.schedule.step, [(p, p.grad) for p in model.parameters()]
    with loss_parallel_context(dims.loss_parallel), context(), torch.enable_grad() if saved_grads else _null():
        args = (tokens,) if model.has_first_stage else ()
        # return_outputs=False: the last stage does not keep every micro-batch's logits until the step ends
        run(*args, target=labels if model.has_last_stage else None, losses=[], return_outputs=False)
    for p, g in saved_grads or []:
        p.grad = g
    if not eval_only:
        sync_tied_grads(model, dims)
    device = _device(model)
    if model.has_last_stage:
        # the schedule may call the loss once more while it infers shapes on its first step: keep the real ones
        real = model.unscaled_losses[-model.schedule._n_microbatches:]
        loss = torch.stack([_full(x).float() for x in real]).mean().to(device)
    else:
        loss = torch.zeros((), device=device)
    return _mean_over(loss, dims, ("pp", "dp_cp"))


@torch.no_grad()
def eval_step(model, microbatches: list[dict], dims: ParallelDims, loss_fn=cross_entropy, context=None):
    """Mean loss over the micro-batches without gradients (all layouts, incl. pipeline schedules)."""
    context = context or contextlib.nullcontext
    if isinstance(model, PipelineModel):
        return _pipeline_step(model, microbatches, dims, loss_fn, context, None, eval_only=True)
    total = torch.zeros((), dtype=torch.float32, device=_device(model))
    for mb in microbatches:
        tokens, labels = _inputs(mb, dims)
        with loss_parallel_context(dims.loss_parallel), context():
            total += _full(loss_fn(model(tokens), labels)).float() / len(microbatches)
    return _mean_over(total, dims, ("dp_cp",))


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
