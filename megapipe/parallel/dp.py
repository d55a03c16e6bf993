"""Data parallelism: FSDP2 (ZeRO-3), HSDP (2-D mesh), DDP, and Megatron's distributed optimizer.

Mapping to Megatron: Megatron's "distributed optimizer" (ZeRO-1/2: optimizer state and gradients sharded, full
parameters kept between forward and backward) = FSDP2 with ``reshard_after_forward=False``
(parallel.fsdp_reshard_after_forward=false); plain FSDP2 (the default) also frees parameters after forward (ZeRO-3).
DDP = every rank keeps everything; gradients are all-reduced (torch's composable ``replicate``).
bf16/fp16 training under FSDP: parameters are cast for compute (``param_dtype``), gradients are reduced in fp32
(``reduce_dtype``), master weights and optimizer state stay fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from megapipe import torch_compat
from megapipe.dtypes import PRECISION_DTYPES


def apply_fsdp(model, mesh, precision: str = "fp32", reshard_after_forward: bool = True, expert_mesh=None,
               dp_size: int = 1) -> None:
    """Shard each block (a vision tower's too), then the root (embeddings, final norm, output, the tower's patch
    embedding and merger). ``mesh`` is 1-D (FSDP) or 2-D (HSDP).
    Multi-token prediction modules come after the layers, as they run: their block one unit, the module
    (norms, projection) around it another.

    ``expert_mesh``: expert-parallel MoE layers' experts (DTensors over the ep mesh) get their own FSDP unit over it,
    sharded along their second dimension (the first is the expert one ep already splits), and their gradients are
    divided by the whole data-parallel size ``dp_size`` like every other gradient: each rank's experts already summed
    the contributions of its ep group's tokens, so edp's own average would count them ep times."""
    from torch.distributed.tensor import Shard

    mp = MixedPrecisionPolicy(param_dtype=PRECISION_DTYPES[precision], reduce_dtype=torch.float32)
    mtp = list(getattr(model, "mtp", None) or [])
    visual = getattr(model, "visual", None)  # a vision-language model's tower: its blocks run first
    if visual is not None:
        visual.every_batch = True  # on every rank, images or not (megapipe.models.vision)
    blocks = [*(visual.blocks if visual is not None else ()), *model.layers.values(), *(m.block for m in mtp)]
    for i, block in enumerate(blocks):
        keep = reshard_after_forward and i < len(blocks) - 1
        moe = getattr(block, "moe", None)
        if expert_mesh is not None and moe is not None:
            fully_shard(moe.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=keep,
                        shard_placement_fn=lambda p: Shard(1))
            moe.experts.set_gradient_divide_factor(float(dp_size))
            shard_ranks = expert_mesh.size(expert_mesh.ndim - 1)
            if shard_ranks > 1 and dist.get_backend() != "nccl":
                # gloo has no PREMUL_SUM: sum, then divide (not with one shard rank: torch 2.13 would divide twice)
                moe.experts.set_force_sum_reduction_for_comms(True)
        # the last block's parameters are needed first by backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=keep)
    for i, module in enumerate(mtp):
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(mtp) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)


def apply_ddp(model, mesh) -> None:
    if getattr(model, "visual", None) is not None:
        model.visual.every_batch = True  # every rank's tower has gradients to reduce (megapipe.models.vision)
    torch_compat.replicate(model, device_mesh=mesh, bucket_cap_mb=100)


def set_gradient_sync(model, enabled: bool) -> None:
    """Skip (False) or do (True) the gradient reduction in the next backward (gradient accumulation)."""
    fn = getattr(model, "set_requires_gradient_sync", None)
    if fn is not None:
        fn(enabled)
