"""The recurrent state of a hybrid model's Mamba layers (megapipe.models.mamba), per sequence, beside its paged KV.

A Mamba layer carries a sequence's past in two tensors of fixed size, whatever its length: the conv window (the
last K-1 inputs of its causal conv, [channels, K-1], in the model's dtype) and the SSM state ([heads, head_dim,
state_dim], float32 as the scan keeps it; transformers' mamba_ssm_cache_dtype default). :class:`StatePool` holds
``max_num_seqs`` slots of both for every Mamba layer, allocated at engine start. A sequence takes a slot when the
scheduler admits it (zeroed), keeps it across its chunked prefill and decoding (each step starts from the state
the previous one left), and gives it back when it finishes, is aborted or is preempted: a preempted sequence's
state is recomputed from its tokens, as its keys and values are, when it is admitted again.

The state at a position cannot be cut out of a later one, so a cached KV prefix would need a snapshot of the
state at that block boundary: snapshots are not cached, and prefix caching is off for models with Mamba layers
(capability table, megapipe.models.capabilities).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megapipe.inference.compressed_cache import compressed_bytes_per_sequence, compressed_states
from megapipe.models.attention import local
from megapipe.models.mamba import Mamba2Mixer


def state_shapes(model) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per Mamba layer of ``model``: the shape of one sequence's conv window and of its SSM state."""
    shapes = {}
    for mixer in model.modules():
        if isinstance(mixer, Mamba2Mixer):
            weight, _ = mixer.conv_params()
            inner = local(mixer.conv_x.weight).shape[0]  # x's channels: heads * head_dim
            shapes[mixer.layer_id] = ((weight.shape[0], weight.shape[1] - 1),
                                      (inner // mixer.head_dim, mixer.head_dim, mixer.state_dim))
    return shapes


def state_bytes_per_sequence(model, dtype: torch.dtype) -> int:
    """Bytes one sequence's state takes over all Mamba layers (conv windows in ``dtype``, SSM states in fp32) and
    DeepSeek-V4's compressed layers (the compressors' carry; their entries are paged:
    megapipe.inference.compressed_cache)."""
    return (sum(math.prod(conv) * dtype.itemsize + math.prod(ssm) * 4 for conv, ssm in state_shapes(model).values())
            + compressed_bytes_per_sequence(model, dtype))


class StatePool:
    def __init__(self, model, slots: int, dtype: torch.dtype, device):
        """Slots for the Mamba mixers of ``model`` and its DeepSeek-V4 compressed layers (their compressors' carry);
        none: an empty pool that costs nothing."""
        shapes = state_shapes(model)
        self.num_slots = slots
        self.conv = {i: torch.zeros(slots, *conv, dtype=dtype, device=device) for i, (conv, _) in shapes.items()}
        self.ssm = {i: torch.zeros(slots, *ssm, dtype=torch.float32, device=device) for i, (_, ssm) in shapes.items()}
        # per V4 compressed layer: its compressors' carry (CompressorStates)
        self.compressed = compressed_states(model, slots, dtype, device)
        self.free = list(range(slots - 1, -1, -1)) if shapes or self.compressed else []

    def __bool__(self) -> bool:
        return bool(self.conv or self.compressed)

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.conv.values(), *self.ssm.values(), *(t for states in self.compressed.values()
                                                          for state in states for t in state.tensors())]

    def bytes_per_sequence(self) -> int:
        """Bytes one sequence's state takes (Mamba layers' conv windows and SSM states, V4's compressed layers')."""
        return sum((t[0].numel() * t.element_size() for t in self._tensors()), 0)

    def allocate(self) -> int:
        """A slot with zero state (the scheduler admits no more than ``slots`` sequences at once)."""
        slot = self.free.pop()
        for t in (*self.conv.values(), *self.ssm.values()):
            t[slot].zero_()
        for states in self.compressed.values():
            for state in states:
                state.clear(slot)
        return slot

    def release(self, slot: Optional[int]) -> None:
        if slot is not None:
            self.free.append(slot)

    def num_free(self) -> int:
        return len(self.free)
