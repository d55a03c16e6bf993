"""Optimizer construction with Megatron's weight-decay groups (clipping: megapipe.parallel.step.clip_grad_norm_).

``--optimizer muon``: Muon for the blocks' weight matrices (every nn.Linear weight but the output layer's and the
MoE routers', and the experts' 3-D weights, one matrix per expert), AdamW for the rest (embeddings, output layer,
norms, biases, routers, Mamba's 1-D parameters and conv weights), in one optimizer so that checkpoints save and
reshard its state as AdamW's (``momentum_buffer`` beside ``exp_avg``: sharded like its parameter).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megapipe.models.moe import GroupedExperts, MoE


def param_groups(model: nn.Module, weight_decay: float, exclude: frozenset = frozenset()) -> list[dict]:
    """Megatron's rule: biases and 1-D weights (norm scales) get no weight decay; matrices (embeddings too) do.
    Parameters whose id is in ``exclude`` are left out (Muon's)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in exclude:
            continue
        (no_decay if name.endswith(".bias") or p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon orthogonalises: the blocks' nn.Linear weights (not the output layer, which shares the
    embedding's role, nor MoE routers) and GroupedExperts' 3-D weights."""
    outside = {id(m.weight) for name, m in model.named_modules()
               if isinstance(m, nn.Embedding) or (isinstance(m, nn.Linear) and name.split(".")[-1] == "output")}
    for m in model.modules():
        if isinstance(m, MoE):
            outside |= {id(r.weight) for r in (m.gate, m.shared_gate) if r is not None}
    found, seen = [], set()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            candidates = [m.weight]
        elif isinstance(m, GroupedExperts):
            candidates = [p for p in m.parameters(recurse=False) if p.ndim == 3]
        else:
            continue
        for p in candidates:
            if p.requires_grad and id(p) not in outside and id(p) not in seen:
                seen.add(id(p))
                found.append(p)
    return found


def _is_dtensor(p: torch.Tensor) -> bool:
    return type(p).__name__ == "DTensor"


def build_optimizer(model: nn.Module, optim_cfg, lr: float) -> torch.optim.Optimizer:
    o = optim_cfg
    matrices = muon_matrices(model) if o.optimizer == "muon" else []
    groups = param_groups(model, o.weight_decay, frozenset(id(p) for p in matrices))
    params = [p for g in groups for p in g["params"]] + matrices
    # The fused kernels do one pass over each tensor (CPU and CUDA); DTensor shards take the foreach path.
    impl = {"foreach": True} if any(_is_dtensor(p) for p in params) else {"fused": True}
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.0, **impl)
    if o.optimizer == "muon":
        muon_lr = lr if o.muon_lr is None else o.muon_lr
        groups.insert(0, {
            "params": matrices, "muon": True, "lr": muon_lr, "lr_scale": muon_lr / lr if lr > 0 else 1.0,
            "weight_decay": o.weight_decay if o.muon_weight_decay is None else o.muon_weight_decay,
            "momentum": o.muon_momentum, "nesterov": o.muon_nesterov, "ns_steps": o.muon_ns_steps,
            "ns_coefficients": tuple(o.muon_ns_coefficients), "scale": o.muon_scale,
            "extra_scale": o.muon_extra_scale_factor,
        })
        return Muon([g for g in groups if g["params"]], lr=lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                    **impl)
    return torch.optim.AdamW(groups, lr=lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, **impl)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr for every group (Muon's scaled by its --muon-lr / --lr)."""
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


def describe_optimizer(optimizer: torch.optim.Optimizer) -> list[str]:
    """One line per parameter group: what it optimizes and with which settings (the run's summary)."""
    lines = []
    for g in optimizer.param_groups:
        n = sum(p.numel() for p in g["params"])
        what = f"{len(g['params'])} tensors, {n:,} parameters"
        if g.get("muon"):
            a, b, c = g["ns_coefficients"]
            lines.append(f"muon: {what}, lr {g['lr_scale']:g} x --lr, weight decay {g['weight_decay']:g}, momentum "
                         f"{g['momentum']:g}{' nesterov' if g['nesterov'] else ''}, {g['ns_steps']} Newton-Schulz "
                         f"steps ({a:g}, {b:g}, {c:g}), scale {g['scale']}{_times(g.get('extra_scale', 1.0))}")
        else:
            name = type(optimizer).__name__.lower() if not isinstance(optimizer, Muon) else "adamw"
            lines.append(f"{name}: {what}, weight decay {g['weight_decay']:g}")
    return lines


def _times(factor: float) -> str:
    return "" if factor == 1 else f" x {factor:g}"


# --------------------------------------------------------------------------------------------------- Muon


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float = 1e-7) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz orthogonalisation of each matrix in g's last two dims (as
    torch.optim.Muon's, but in fp32 rather than bf16, so that every parallel layout gives one process's update)."""
    a, b, c = coefficients
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(g.dtype)


def update_scale(rule: str, shape: torch.Size) -> float:
    """The factor on Muon's lr for matrices of ``shape`` [..., A, B] (torch.optim.Muon's adjust_lr_fn rules, and
    Megatron's --muon-scale-mode ones)."""
    rows, cols = shape[-2:]
    if rule == "match_rms_adamw":  # Moonlight: the update's RMS ~ 0.2, AdamW's typical one
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral":
        return math.sqrt(max(rows, cols))
    if rule == "unit_rms_norm":
        return math.sqrt(rows / cols)
    return math.sqrt(max(1.0, rows / cols))


def orthogonalize(update: torch.Tensor, coefficients, steps: int, index: int = 0) -> torch.Tensor:
    """newton_schulz on whole matrices. A DTensor's shards of one matrix (FSDP's, TP's mesh dims) are gathered; one
    rank of those that gathered it (chosen by ``index``, so the matrices of a group spread over them) iterates and
    broadcasts the result, and every rank keeps its part. Shards of a leading (expert) dim hold whole matrices and
    are orthogonalised where they are."""
    if not _is_dtensor(update):
        return newton_schulz(update, coefficients, steps)
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    mesh, placements = update.device_mesh, update.placements
    whole = [p if p.is_shard() and p.dim % update.ndim < update.ndim - 2 else Replicate() for p in placements]
    full = update.redistribute(mesh, whole).to_local().contiguous()
    gathered = [d for d, (p, w) in enumerate(zip(placements, whole, strict=True)) if p != w]
    owner, rest = {}, index
    for d in gathered:
        owner[d], rest = rest % mesh.size(d), rest // mesh.size(d)
    coordinate = mesh.get_coordinate()
    if all(coordinate[d] == o for d, o in owner.items()):
        full = newton_schulz(full, coefficients, steps).contiguous()
    for d, o in owner.items():  # along each gathered dim in turn: after the last, every rank holds the owner's
        dist.broadcast(full, group=mesh.get_group(d), group_src=o)
    return DTensor.from_local(full, mesh, whole, run_check=False).redistribute(mesh, placements)


class Muon(torch.optim.AdamW):
    """Muon on the groups marked ``muon`` (momentum, Nesterov, Newton-Schulz, the shape's update scale, decoupled
    weight decay: torch.optim.Muon's rule, experts one matrix each), AdamW on the others. One optimizer, so that its
    state_dict and the checkpoints' flattened optimizer state hold both."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            if g.get("muon"):
                self._muon_step(g)
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get("muon")]
        try:
            super().step()
        finally:
            self.param_groups = groups
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, mu = group["lr"], group["momentum"]
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # and a step count, as AdamW's __setstate__ expects of every state
                state["momentum_buffer"], state["step"] = torch.zeros_like(p), torch.tensor(0.0)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)
            update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
            update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], index=i)
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr * update_scale(group["scale"], p.shape) * group.get("extra_scale", 1.0))
