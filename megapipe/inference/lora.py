"""Many LoRA adapters on one base model, mixed in one batch (``megapipe serve --lora-modules name=PATH``).

Up to ``max_loras`` adapters are resident, each in a slot 1 .. max_loras (slot 0: the base model, no adapter); more
can be registered, and one is loaded into the least recently used slot that no running sequence holds when a request
for it is admitted (``acquire``). Every adapted linear layer of the base model keeps the resident adapters stacked: A
as [max_loras * R, in] and B (times alpha / rank) as [max_loras * R, out], R = ``max_rank`` per adapted weight (a
fused q/k/v matmul has three such bands side by side; a smaller rank and a weight an adapter leaves alone are zeros).
A step computes, on every row x of the flattened batch, y = base(x) + ((x A^T) * mask) B, the mask keeping the row's
own slot's band only (vLLM's punica idea, per-row gather, as two dense matmuls: rows of any adapter, or of none, batch
together, and the cost is one low-rank matmul pair per layer whatever the mix). Where the base layer runs on
megapipe's bf16 kernel, so do the two low-rank matmuls (aten's small bf16 matmuls take several times as long).

The layers stay the engine's (packed or not); their ``forward`` and ``times`` (PackedLinear's fused product) are
wrapped on the instance, so the runner's fast path and the model's own forward both take the adapters. The rows'
slots are set once per step (``set_rows``). Adapters apply to the decoder layers' linears (q, k, v, o, gate, up,
down and a shared expert's), not to MTP drafting, which only proposes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megapipe.errors import MegapipeError
from megapipe.inference.runner import PackedLinear, packed_parts


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    weights: dict  # megapipe weight name -> (A [rank, in], B * scale [out, rank])
    uid: bytes  # salts its sequences' prefix-cache hashes: KV computed under another adapter is never reused


class AdaptedLinear:
    """One linear layer of the base model (its fused weights ``names`` of ``rows`` output rows each) with the
    resident adapters' bands."""

    def __init__(self, linear: nn.Module, names: list[str], rows: list[int], slots: "AdapterSlots"):
        self.linear, self.names, self.slots = linear, names, slots
        self.offsets = list(itertools.accumulate([0] + rows))
        self.in_features, self.out_features = linear.in_features, self.offsets[-1]
        self.band = band = slots.max_rank * len(names)
        # bands of slots 1 .. max_loras (slot 0, the base model, needs none)
        self.a = torch.zeros(slots.max_loras * band, self.in_features, dtype=slots.dtype, device=slots.device)
        self.b = torch.zeros(slots.max_loras * band, self.out_features, dtype=slots.dtype, device=slots.device)
        # on megapipe's bf16 kernel where the base layer is: aten's small bf16 matmuls take several times as long
        self.own = getattr(linear, "own", False)
        self._pack()
        self.base_forward, self.base_times = linear.forward, getattr(linear, "times", None)
        linear.forward = self.forward  # the instance attribute wins over the class's method
        linear.adapted = True  # a fused SwiGLU (PackedSwiGLU) calls it on its own again
        if self.base_times is not None:
            linear.times = self.times

    @torch.inference_mode()  # the bands may have been made in a step (inference tensors)
    def put(self, slot: int, adapter: Optional[Adapter]) -> None:
        """Write ``adapter``'s weights (or zeros) into ``slot``'s band."""
        rank = self.slots.max_rank
        start = (slot - 1) * self.band
        self.a[start:start + self.band].zero_()
        self.b[start:start + self.band].zero_()
        for j, name in enumerate(self.names):
            if adapter is not None and name in adapter.weights:
                a, b = adapter.weights[name]
                at = start + j * rank
                self.a[at:at + adapter.rank] = a
                self.b[at:at + adapter.rank, self.offsets[j]:self.offsets[j + 1]] = b.T
        self._pack()

    def _pack(self) -> None:
        self.packed = (PackedLinear(self.a, own=True), PackedLinear(self.b.T.contiguous(), own=True)) if self.own \
            else None

    def forward(self, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
        mask = self.slots.mask(self.band)
        if mask is None:
            return self.base_forward(x) if activation == "none" else self.base_forward(x, activation)
        if activation not in ("none", "swish"):
            raise ValueError(f"an adapted linear fuses no {activation!r} (only 'none' and 'swish')")
        y = self.base_forward(x)
        rows = x.reshape(-1, self.in_features)
        if self.packed is not None:  # the mask in the first matmul's epilogue, the sum (and SiLU) in the second's
            self.packed[1].add_to(self.packed[0].times(rows, mask), y.view(-1, self.out_features),
                                  swish=activation == "swish")
            return y
        low = torch.matmul(rows, self.a.T).mul_(mask)
        y.view(-1, self.out_features).addmm_(low, self.b)
        return F.silu(y) if activation == "swish" else y

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if self.slots.mask(self.band) is None:
            return self.base_times(x, other)
        return self.forward(x).mul_(other)


class AdapterSlots:
    """The registered adapters, the resident ones in slots (LRU), and the per-row masks of the current step."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int):
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.max_loras, self.max_rank, self.num_slots = max_loras, max_rank, max_loras + 1
        self.registered: dict[str, Adapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.free = list(range(1, self.num_slots))
        self.layers: dict[str, AdaptedLinear] = {}  # by each fused weight name
        self._linears = linear_parts(model)
        self._ids = itertools.count(1)
        self._onehot: Optional[torch.Tensor] = None
        self._masks: dict[int, torch.Tensor] = {}
        self.num_loads = 0

    def register(self, name: str, path: str, rank: int, scale: float, weights: dict) -> None:
        """Add an adapter (its weights fp32 as read; kept in the model's dtype, B scaled); not resident yet."""
        if rank > self.max_rank:
            raise MegapipeError(f"LoRA adapter {name!r} ({path}) has rank {rank}, more than --max-lora-rank "
                                f"{self.max_rank}")
        kept = {}
        for weight, (a, b) in weights.items():
            where = self._linears.get(weight)
            if where is None:
                raise MegapipeError(f"LoRA adapter {name!r} ({path}) adapts {weight}, which this model's engine has "
                                    f"no linear layer for")
            linear, j, rows = where
            if tuple(a.shape) != (rank, linear.in_features) or tuple(b.shape) != (rows[j], rank):
                raise MegapipeError(f"LoRA adapter {name!r} ({path}): {weight} has A {tuple(a.shape)} and B "
                                    f"{tuple(b.shape)}, but this model's layer takes {linear.in_features} -> "
                                    f"{rows[j]} at rank {rank}: the adapter is for another base model")
            kept[weight] = (a.to(self.device, self.dtype), (b.float() * scale).to(self.device, self.dtype))
        self.registered[name] = Adapter(name, str(path), rank, kept, next(self._ids).to_bytes(8, "little"))

    def unregister(self, name: str) -> None:
        self.registered.pop(name)
        slot = self.resident.pop(name, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.put(slot, None)
            self.free.append(slot)

    def acquire(self, name: str, in_use: set) -> bool:
        """Make adapter ``name`` resident (loading it over the least recently used one no sequence in ``in_use``
        holds); False when every slot is held."""
        if name in self.resident:
            self.resident.move_to_end(name)
            return True
        if not self.free:
            victim = next((n for n in self.resident if n not in in_use), None)
            if victim is None:
                return False
            self.free.append(self.resident.pop(victim))
        slot = self.free.pop(0)
        adapter = self.registered[name]
        for weight in adapter.weights:
            self._adapt(weight)
        for layer in set(self.layers.values()):
            layer.put(slot, adapter)
        self.resident[name] = slot
        self.num_loads += 1
        return True

    def _adapt(self, weight: str) -> None:
        if weight in self.layers:
            return
        linear, _, rows = self._linears[weight]
        names = [n for n, (m, _, _) in self._linears.items() if m is linear]
        layer = AdaptedLinear(linear, names, rows, self)
        for slot_name, slot in self.resident.items():  # the resident adapters' weights of this layer too
            layer.put(slot, self.registered[slot_name])
        for n in names:
            self.layers[n] = layer

    def slot(self, name: Optional[str]) -> int:
        return 0 if name is None else self.resident[name]

    def set_rows(self, slots: Optional[Sequence[int]]) -> None:
        """The slot of every row of the next forward (None or all 0: no adapter runs)."""
        self._masks = {}
        if not slots or not any(slots):
            self._onehot = None
            return
        ids = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._onehot = F.one_hot(ids, self.num_slots)[:, 1:].to(self.dtype)  # slot 0 has no band

    def mask(self, band: int) -> Optional[torch.Tensor]:
        """[rows, max_loras * band]: 1 on each row's own slot's band (none for slot 0)."""
        if self._onehot is None:
            return None
        mask = self._masks.get(band)
        if mask is None:
            mask = self._onehot.repeat_interleave(band, dim=1)
            self._masks[band] = mask
        return mask


def linear_parts(model: nn.Module) -> dict[str, tuple[nn.Module, int, list[int]]]:
    """Every linear layer of the decoder layers by the weight names it holds: name -> (layer, its index among the
    layer's fused weights, the fused weights' row counts). Packed layers (megapipe.inference.runner) by the names of
    the weights they fuse, plain nn.Linear by their own."""
    out = {}
    for linear, weights, _, rows in packed_parts(model):
        if isinstance(linear, PackedLinear) and all(w.startswith("layers.") for w in weights) and len(weights) == len(rows):
            for j, w in enumerate(weights):
                out[w] = (linear, j, rows)
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name.startswith("layers."):
            out[f"{name}.weight"] = (module, 0, [module.out_features])
    return out
