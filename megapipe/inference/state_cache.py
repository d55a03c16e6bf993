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

from typing import Optional

import torch

from megapipe.models.mamba import Mamba2Mixer


class StatePool:
    def __init__(self, model, slots: int, dtype: torch.dtype, device):
        """Slots for the Mamba mixers of ``model`` (none: an empty pool that costs nothing)."""
        mixers = {m.layer_id: m for m in model.modules() if isinstance(m, Mamba2Mixer)}
        self.num_slots = slots
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for layer_id, mixer in mixers.items():
            weight, _ = mixer.conv_params()
            inner = weight.shape[0] - 2 * mixer.in_B.out_features  # x's channels: heads * head_dim
            self.conv[layer_id] = torch.zeros(slots, weight.shape[0], weight.shape[1] - 1, dtype=dtype, device=device)
            self.ssm[layer_id] = torch.zeros(slots, inner // mixer.head_dim, mixer.head_dim, mixer.state_dim,
                                             dtype=torch.float32, device=device)
        self.free = list(range(slots - 1, -1, -1)) if mixers else []

    def __bool__(self) -> bool:
        return bool(self.conv)

    def bytes_per_sequence(self) -> int:
        """Bytes one sequence's state takes over all Mamba layers (conv windows and SSM states)."""
        return sum((t[0].numel() * t.element_size() for t in (*self.conv.values(), *self.ssm.values())), 0)

    def allocate(self) -> int:
        """A slot with zero state (the scheduler admits no more than ``slots`` sequences at once)."""
        slot = self.free.pop()
        for t in (*self.conv.values(), *self.ssm.values()):
            t[slot].zero_()
        return slot

    def release(self, slot: Optional[int]) -> None:
        if slot is not None:
            self.free.append(slot)

    def num_free(self) -> int:
        return len(self.free)
