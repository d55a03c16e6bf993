"""Block specs: each kind of decoder block declares, in the file that defines its module, how tensor parallelism
shards it and what its tensors are called in Hugging Face checkpoints. The model builds its layers from the spec
megapipe.models.blocks chooses for each layer; megapipe.parallel.tp applies ``tp_plan``; the HF bridge renames
with ``hf_names``; ``megapipe plan`` counts parameters from the module built on the meta device, split by
``tp_plan``. A new block kind (an MoE block, another family) is one module with its spec, registered here and
chosen in blocks.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class BlockSpec:
    name: str
    module: type  # nn.Module class, built as module(cfg, layer_id)
    # (block, sequence_parallel) -> {submodule name: torch.distributed.tensor.parallel style}; applied from outside
    tp_plan: Callable[[nn.Module, bool], dict]
    # naming family ("llama": Llama / Mistral / Qwen2 / Qwen3 checkpoints) -> {submodule: HF submodule in a layer}
    hf_names: dict[str, dict[str, str]] = field(default_factory=dict)


_BY_MODULE: dict[type, BlockSpec] = {}


def register_block(spec: BlockSpec) -> BlockSpec:
    _BY_MODULE[spec.module] = spec
    return spec


def spec_for(block: nn.Module) -> BlockSpec:
    """The spec of a built block (also after FSDP/compile wrapped its class)."""
    for cls in type(block).__mro__:
        if cls in _BY_MODULE:
            return _BY_MODULE[cls]
    raise TypeError(f"{type(block).__name__} has no registered BlockSpec")


def replicated_style(hooks: bool = True, summed: bool = False):
    """A tensor-parallel style for a layer every TP rank computes whole on the whole input (MLA's latent down
    projections and norms, MTP's projection, norms without sequence parallelism, MoE layers): its parameters (those
    of its submodules too) become replicated DTensors like the sharded layers' (one optimizer and clipping group; the
    optimizer's foreach path takes no mix of plain tensors and DTensors), its input and output stay local tensors.
    Its gradient reaches it whole on every rank, so nothing is reduced. ``hooks=False``: the parameters only, for a
    module whose forward computes with their local tensors (the MoE router and experts). ``summed``: its output's
    gradient is summed over the TP group first (``sum_gradient_style``), for a layer whose output every rank reads
    with only its own heads (DeepSeek-V4's one key/value head and compressed entries)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import SequenceParallel

    class Replicated(SequenceParallel):
        def _replicate_module_fn(self, name, module, device_mesh):  # called for every submodule: its own parameters
            for p_name, param in module.named_parameters(recurse=False):
                dt = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
                module.register_parameter(p_name, nn.Parameter(dt, requires_grad=param.requires_grad))

        def _apply(self, module, device_mesh):
            if hooks:
                module = super()._apply(module, device_mesh)
            else:
                module = distribute_module(module, device_mesh, self._replicate_module_fn)
            return sum_gradient_style()._apply(module, device_mesh) if summed else module

    style = Replicated(use_local_output=True)
    style.sequence_sharding = (Replicate(),)  # the layouts its input is taken in and its output given back in
    return style


def sum_gradient_style():
    """A ParallelStyle: the module's output is unchanged, its gradient summed over the TP group (Megatron's
    copy_to_tensor_model_parallel_region)."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ParallelStyle

    class _SumGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class SumGradient(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            group = device_mesh.get_group()
            module.register_forward_hook(lambda _m, _inputs, out: _SumGradient.apply(out, group))
            return module

    return SumGradient()


def sharded_style(prepare=None):
    """A tensor-parallel style for a module that computes with the local parts of its own parameters (not those of
    its submodules): each becomes a DTensor sharded along dim 0 over the TP ranks (a Mamba mixer's per-head A_log /
    D / dt_bias, its convs' channels, its gated norm's groups). Its input comes already split the same way (by the
    column-parallel projections before it), so every rank's gradient is whole for its shard and nothing is reduced.
    ``prepare``: a style applied to the module too (a PrepareModuleInput for its input)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class Sharded(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            for name, param in module.named_parameters(recurse=False):
                dt = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
            return module if prepare is None else prepare._apply(module, device_mesh)

    style = Sharded()
    style.shards_parameters = True  # for tp_split_numel
    return style


def tp_split_numel(block: nn.Module, sequence_parallel: bool = True) -> tuple[int, int]:
    """(parameters split over TP ranks, parameters replicated on every TP rank) of one block, by its tp_plan:
    column-parallel layers split weight and bias, row-parallel ones split the weight and replicate the bias,
    ``sharded_style`` splits the module's own parameters."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    split = set()
    for name, style in spec_for(block).tp_plan(block, sequence_parallel).items():
        module = block.get_submodule(name)
        if getattr(style, "shards_parameters", False):
            split.update(id(p) for p in module.parameters(recurse=False))
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        split.add(id(module.weight))
        if isinstance(style, ColwiseParallel) and getattr(module, "bias", None) is not None:
            split.add(id(module.bias))
    params = list(block.parameters())
    n_split = sum(p.numel() for p in params if id(p) in split)
    return n_split, sum(p.numel() for p in params) - n_split
