"""Tensor parallelism (Megatron-style) and sequence parallelism, as DTensor plans on the model's module names.

Each block is sharded by the plan its kind declares (megapipe.models.spec; the dense block: megapipe.models.dense).
The embedding is split by vocabulary (each rank looks up its vocabulary range, partial sums are reduced), and the
output projection by vocabulary too: logits stay vocabulary-sharded and the loss is computed by
``loss_parallel`` (parallel cross-entropy) without ever gathering [B, S, V]. A vision-language model's tower is
replicated (its parameters replicated DTensors), its image embeddings scattered into the full sequence.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from megapipe.models.hyper_connections import hyper_tp_style
from megapipe.models.mtp import mtp_tp_plan
from megapipe.models.spec import replicated_style, spec_for


def _gather_for_tied_output(mesh, sp: bool):
    """Forward hook on the final norm when the output reuses the (vocab-sharded) embedding weight:
    hand a replicated DTensor to F.linear so the logits come out vocabulary-sharded (Shard(-1))."""

    def hook(module, args, out):
        if isinstance(out, DTensor):
            return out.redistribute(mesh, [Replicate()])
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False)

    return hook


def apply_tp(model, mesh, sequence_parallel: bool = True) -> None:
    """Shard ``model`` (a full model or one pipeline stage) over the 1-D TP mesh, in place."""
    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()
    learned_pos = getattr(model, "pos_embeddings", None) is not None
    visual = getattr(model, "visual", None)
    whole = learned_pos or visual is not None
    top = {}
    if model.tok_embeddings is not None:
        # learned positions are added to (a vision tower's images scattered into) the full sequence, then the
        # residual stream is split (first block)
        emb_out = Replicate() if whole else act
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=emb_out)
    if learned_pos:
        top["pos_embeddings"] = replicated_style()
    if getattr(model, "hc_head", None) is not None:  # DeepSeek-V4: the hyper-connection streams -> one
        top["hc_head"] = hyper_tp_style(sp)
    if model.norm is not None:
        top["norm"] = SequenceParallel() if sp else replicated_style()
        if model.output is not None:
            top["output"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, top)
    if model.norm is not None and model.output is None:
        if model.tok_embeddings is None:
            raise ValueError("tied output weights need tok_embeddings on the last stage")
        model.norm.register_forward_hook(_gather_for_tied_output(mesh, sp))
    if whole and sp and "0" in model.layers:
        parallelize_module(
            model.layers["0"], mesh,
            PrepareModuleInput(input_layouts=(Replicate(), None, None, None),
                               desired_input_layouts=(act, None, None, None), use_local_output=True),
        )
    for block in model.layers.values():
        parallelize_module(block, mesh, spec_for(block).tp_plan(block, sp))
    for module in visual.modules() if visual is not None else ():
        # the vision tower replicated: every rank runs it whole on all the images, layer by layer on local tensors
        if next(module.parameters(recurse=False), None) is not None:
            parallelize_module(module, mesh, replicated_style())
    for module in getattr(model, "mtp", None) or []:  # multi-token prediction: its block as the layers are
        parallelize_module(module.block, mesh, spec_for(module.block).tp_plan(module.block, sp))
        parallelize_module(module, mesh, mtp_tp_plan(module, sp))
        if model.output is None:
            module.norm.register_forward_hook(_gather_for_tied_output(mesh, sp))


def loss_parallel_context(enabled: bool):
    """Context for computing the loss (and running backward) on vocabulary-sharded DTensor logits."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
