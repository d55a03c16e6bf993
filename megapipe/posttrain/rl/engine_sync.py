"""The rollout engine next to the trainer: built from the trainer's model config, given the trainer's weights before
every rollout batch, and checked to hold exactly those weights.

Weight sync: the trainer's full, unsharded state dict (under FSDP gathered with DCP's ``get_model_state_dict(...,
full_state_dict=True)`` on every rank, since every rank samples its share) goes through the engine's
``load_weights``, which casts it to the engine's dtype and rebuilds its pre-packed layers.

Weight check (``check_engine_weights``): every tensor the engine computes with (its plain parameters, the oneDNN
pre-packed linears read back with ``to_dense()``, split where several were fused, and the output head it keeps
apart) is compared, bit for bit, with the trainer's tensor cast to the engine's dtype, and every tensor of the
trainer must have its counterpart. It reads what the engine uses, not what was handed to it, so a sync that
silently did nothing, a stale or partial copy, a wrong name or a broken re-packing all fail it, naming the tensor.
Cost: one pass over the weights (cheaper than the load itself). The numerical side of the agreement is measured
on the sampled tokens of every batch (the mismatch figures, megapipe.posttrain.rl.rollout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megapipe.errors import MegapipeError
from megapipe.inference.engine import EngineConfig, LLMEngine, plain_attention
from megapipe.inference.runner import packed_parts
from megapipe.models import build_model


class WeightSyncError(MegapipeError):
    """The engine does not hold the trainer's weights."""


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's full state dict (plain tensors, DDP/FSDP/compile wrappers' names removed). Collective under FSDP."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in state.items()}


def build_engine(model_cfg, tokenizer, eos_token_ids, dtype: torch.dtype, device, max_num_seqs: int,
                 max_model_len: int, state: dict):
    """An LLMEngine for ``model_cfg`` holding ``state`` (through load_weights, as every later sync)."""
    model = build_model(model_cfg, device="meta").to_empty(device=device).to(dtype)
    model.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, strict=True)
    bs = EngineConfig().kv_block_size(device, plain_attention(model))
    blocks = max_num_seqs * -(-max_model_len // bs) + 1
    config = EngineConfig(block_size=bs, num_blocks=blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max(2048, max_model_len))
    return LLMEngine(model, tokenizer, config, eos_token_ids)


def engine_weights(engine):
    """What the engine computes with, one tensor at a time, under the model's state-dict names (``<head>`` for its
    output projection): (name, tensor) pairs; a packed matmul is read back (``dense``) only when reached, an MoE
    layer's experts as the one [E * rows, in] matrix they are packed as."""
    runner = engine.runner
    yield from runner.model.state_dict().items()
    for linear, weights, biases, sizes in packed_parts(runner.model):
        yield from zip(weights, linear.dense().split(sizes, dim=0), strict=True)
        if linear.bias is not None:
            yield from zip(biases, linear.bias.split(sizes), strict=True)
    yield "<head>", (runner.head.dense() if runner.head is not None else runner.head_weight)


@dataclass
class WeightCheck:
    tensors: int
    elements: int


def check_engine_weights(engine, state: dict[str, torch.Tensor]) -> WeightCheck:
    """Raise WeightSyncError unless every tensor of ``state`` (cast to the engine's dtype) equals the engine's."""
    dtype = engine.runner.dtype
    expected = dict(state)
    expected["<head>"] = state["output.weight"] if "output.weight" in state else state["tok_embeddings.weight"]
    bad: list[str] = []
    elements = 0
    seen = set()
    for name, mine in engine_weights(engine):  # streamed: one read-back tensor alive at a time
        ref = expected.get(name)
        if ref is None:
            continue
        seen.add(name)
        want = ref.to(engine.device, dtype)
        if mine.dim() == 2 and want.dim() == 3 and mine.shape == (want.shape[0] * want.shape[1], want.shape[2]):
            want = want.flatten(0, 1)  # experts [E, rows, in], packed as one matrix
        if mine.shape != want.shape:
            bad.append(f"{name} (shape {tuple(mine.shape)} vs {tuple(want.shape)})")
        elif not torch.equal(mine, want):
            diff = (mine.float() - want.float()).abs()
            bad.append(f"{name} ({int((diff > 0).sum())} of {want.numel()} values differ, by up to {float(diff.max()):.3g})")
        elements += want.numel()
    bad += [f"{name} (missing in the engine)" for name in expected if name not in seen]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise WeightSyncError(
            f"the rollout engine's weights are not the trainer's after the weight sync: {len(bad)} of "
            f"{len(expected)} tensors differ ({'; '.join(bad[:3])}{more})")
    return WeightCheck(len(expected), elements)


def sync_engine(engine, state: dict[str, torch.Tensor], check: bool) -> Optional[WeightCheck]:
    engine.load_weights(state)
    return check_engine_weights(engine, state) if check else None
