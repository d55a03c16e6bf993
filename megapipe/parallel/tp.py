"""Tensor parallelism (Megatron-style) and sequence parallelism, as DTensor plans on the model's module names.

Per block: wq/wk/wv and w1/w3 are split by output features (heads / FFN columns), wo and w2 by input features,
so each block needs one reduction per sub-layer. With sequence parallelism the norms and residual stream are split
along the sequence between TP ranks (all-gather before attention/FFN, reduce-scatter after) instead of replicated.
The embedding is split by vocabulary (each rank looks up its vocabulary range, partial sums are reduced), and the
output projection by vocabulary too: logits stay vocabulary-sharded and the loss is computed by
``loss_parallel`` (parallel cross-entropy) without ever gathering [B, S, V].
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def _block_plan(block, sp: bool) -> dict:
    act = Shard(1) if sp else Replicate()
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(act, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=act),
        "feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=act),
    }
    if block.feed_forward.w3 is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    if block.attention.q_norm is not None:
        # q/k are [B, S, local heads, head_dim] here: treat the head dim as the sharded one so the (replicated)
        # norm weights get their gradients summed over TP ranks
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


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
    top = {}
    if model.tok_embeddings is not None:
        # learned positions are added to the full sequence, then the residual stream is split (first block)
        emb_out = Replicate() if learned_pos else act
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=emb_out)
    if model.norm is not None:
        if sp:
            top["norm"] = SequenceParallel()
        if model.output is not None:
            top["output"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, top)
    if model.norm is not None and model.output is None:
        if model.tok_embeddings is None:
            raise ValueError("tied output weights need tok_embeddings on the last stage")
        model.norm.register_forward_hook(_gather_for_tied_output(mesh, sp))
    if learned_pos and sp and "0" in model.layers:
        parallelize_module(
            model.layers["0"], mesh,
            PrepareModuleInput(input_layouts=(Replicate(), None, None), desired_input_layouts=(act, None, None),
                               use_local_output=True),
        )
    for block in model.layers.values():
        parallelize_module(block, mesh, _block_plan(block, sp))


def loss_parallel_context(enabled: bool):
    """Context for computing the loss (and running backward) on vocabulary-sharded DTensor logits."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean token cross-entropy; works on plain logits and on vocabulary-sharded DTensor logits (loss_parallel)."""
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=ignore_index
    )
