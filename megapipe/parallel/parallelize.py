"""Apply a layout to a model, torchtitan order: (PP split) -> TP/SP -> CP -> EP -> activation recompute -> compile ->
FSDP/DDP.

``setup_parallel(cfg)`` joins the process group and builds the validated ParallelDims with its mesh;
``parallelize_model(model, dims, cfg)`` returns the model to train (a ``PipelineModel`` holding this rank's stages
and their schedule when pp > 1). For one process it applies only recompute and compile.
"""

from __future__ import annotations

import torch

from megapipe.config import Config
from megapipe.errors import ConfigError
from megapipe.models.transformer import layer_flops_per_token
from megapipe.parallel.cp import apply_cp, zigzag_indices
from megapipe.parallel.dims import ParallelDims
from megapipe.parallel.distributed import DistInfo, init_distributed
from megapipe.parallel.dp import apply_ddp, apply_fsdp
from megapipe.parallel.ep import apply_moe
from megapipe.parallel.pp import PipelineModel, build_schedule, needs_embedding_replica, split_model, tied_groups
from megapipe.parallel.recompute import apply_compile, apply_recompute
from megapipe.parallel.tp import apply_tp


def setup_parallel(cfg: Config, device_type: str | None = None, packed: bool = False) -> tuple[DistInfo, ParallelDims]:
    info = init_distributed(cfg)
    dims = ParallelDims.from_config(cfg.parallel, info.world_size, cfg.train, cfg.model, cfg.data.seq_length, packed)
    dims.build_mesh(device_type or info.device.split(":")[0])
    return info, dims


def _positions_hook(tp_factor: int, cp: int, cp_rank: int):
    """Give the model the global positions of this rank's tokens (zig-zag CP chunks; full sequence on pipeline
    stages that receive sequence-parallel hidden states [B, S/tp, H])."""

    def hook(module, args, kwargs):
        if kwargs.get("positions") is not None or not args:
            return None
        x = args[0]
        local = x.shape[1] * (tp_factor if x.is_floating_point() else 1)
        pos = zigzag_indices(local * cp, cp, cp_rank) if cp > 1 else torch.arange(local)
        return args, {**kwargs, "positions": pos.to(x.device)}

    return hook


def _parallelize_part(model: torch.nn.Module, dims: ParallelDims, cfg: Config) -> torch.nn.Module:
    if dims.tp > 1:
        apply_tp(model, dims.mesh("tp"), dims.sequence_parallel)
    if dims.cp > 1 or dims.pp > 1:
        tp_factor = dims.tp if (dims.tp > 1 and dims.sequence_parallel) else 1
        model.register_forward_pre_hook(
            _positions_hook(tp_factor, dims.cp, dims.local_rank("cp")), with_kwargs=True
        )
    if dims.cp > 1:
        apply_cp(model, dims.mesh("cp"))
    apply_moe(model, dims)
    apply_recompute(model, cfg.train.recompute)
    if cfg.train.compile:
        apply_compile(model)
    if dims.dp_mode == "fsdp" and (dims.dp_shard * dims.cp > 1 or dims.dp_replicate > 1):
        mesh = dims.mesh("hsdp" if dims.dp_replicate > 1 else "dp_shard_cp")
        experts = dims.mesh("ehsdp" if dims.dp_replicate > 1 else "edp_cp") if dims.ep > 1 else None
        apply_fsdp(model, mesh, cfg.train.precision, dims.fsdp_reshard_after_forward, experts, dims.dp_size * dims.cp)
    elif dims.dp_mode == "ddp" and dims.dp_replicate * dims.cp > 1:
        apply_ddp(model, dims.mesh("dp_cp"))
    return model


def parallelize_model(model: torch.nn.Module, dims: ParallelDims, cfg: Config, device=None) -> torch.nn.Module:
    """Apply the layout of ``dims`` to ``model`` (built identically on every rank) and return what to train."""
    if dims.trivial:
        apply_recompute(model, cfg.train.recompute)
        if cfg.train.compile:
            apply_compile(model)
        return model
    if dims.world_mesh is None:
        raise ConfigError("parallelize_model needs dims.build_mesh() first (or use setup_parallel)")
    if dims.pp == 1:
        return _parallelize_part(model, dims, cfg)
    if device is None:
        device = next(model.parameters()).device
    parts, ids, num_stages = split_model(model, dims, layer_flops_per_token(cfg.model, cfg.data.seq_length))
    parts = [_parallelize_part(p, dims, cfg) for p in parts]
    pipe = PipelineModel(parts, ids, num_stages, tied=cfg.model.tie_embeddings)
    if needs_embedding_replica(cfg.model):
        pipe.tied_group = tied_groups(dims)
    n_mb = dims.num_pp_microbatches(cfg.train)
    pipe.n_microbatches = n_mb
    pipe.schedule = build_schedule(parts, ids, num_stages, dims, n_mb, pipe.schedule_loss, device)
    return pipe
