"""Many LoRA adapters on one base model, mixed in one batch (``megapipe serve --lora-modules name=PATH``).

Up to ``max_loras`` adapters are resident, each in a slot 1 .. max_loras (slot 0: the base model, no adapter); more
can be registered, and one is loaded into the least recently used slot that no running sequence holds when a request
for it is admitted (``acquire``). The linear layers that read one input (a fused q/k/v matmul, a SwiGLU's gate and
up projections, any other alone) keep the resident adapters stacked: A as [max_loras * R, in] and each layer's B
(times alpha / rank) as [max_loras * R, out], R = ``max_rank`` per adapted weight (a fused q/k/v matmul has three
such bands side by side; a smaller rank and a weight an adapter leaves alone are zeros). A step computes, on every
row x of the flattened batch, y = base(x) + ((x A^T) * mask) B, the mask keeping the row's own slot's band only
(vLLM's punica idea, per-row gather, as dense matmuls: rows of any adapter, or of none, batch together). On
megapipe's kernels B is a band of extra input columns of the base layer's packed weight, so the low-rank sums enter
the base matmul as more inputs (one pass: no matmul or elementwise pass for the sum, and a SwiGLU keeps its fused
gate-and-up kernel), and each row's products are taken over its own adapter's band alone, in A and in B (RowBands:
punica's SGMV grouping inside the one matmul; the runner puts a step's decode rows in adapter order so that the
kernel's blocks of rows share a band); see AdaptedInput.

The layers stay the engine's (packed or not); their ``forward`` (a SwiGLU's: PackedSwiGLU's) is wrapped on the
instance, so the runner's fast path and the model's own forward both take the adapters. The rows' slots are set
once per step (``set_rows``). Adapters apply to the decoder layers' linears (q, k, v, o, gate, up, down and a shared
expert's), not to MTP drafting, which only proposes.
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
from megapipe.inference.runner import ExtraInputs, PackedLinear, PackedSwiGLU, RowBands, packed_parts


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    weights: dict  # megapipe weight name -> (A [rank, in], B * scale [out, rank])
    uid: bytes  # salts its sequences' prefix-cache hashes: KV computed under another adapter is never reused


@dataclass
class Part:
    """A linear layer that adapters may change: its fused weights' names and their output rows."""
    linear: nn.Module
    names: list[str]
    rows: list[int]


class AdaptedInput:
    """Linear layers of the base model that read one input (``parts``: one layer, or a SwiGLU's gate and up
    projections, ``ff``), with the resident adapters' bands: A [width, in] for all of them, one B [width, out] per
    layer, width = max_loras * band (padded to whole AMX tiles), band = max_rank * the parts' weight names (rounded
    up to even).

    On megapipe's kernels each layer's packed weight is extended by ``width`` inputs holding its B columns
    (PackedLinear.extend): a step's low-rank sums, low = (x A^T) * mask (the mask in the A matmul's epilogue), are
    then the extra inputs' values, and the base matmul (a SwiGLU's fused glu_bf16 included) takes them in the same
    pass: y = [x | low] [W | B]^T, with no pass of its own for the sum; both matmuls told each row's band
    (AdapterSlots.bands) skip the other adapters' zeros. Elsewhere (oneDNN, plain nn.Linear, a call over the
    kernel's row limit) y = base(x) + low B, as aten matmuls."""

    def __init__(self, parts: list[Part], slots: "AdapterSlots", ff: Optional[nn.Module] = None):
        self.parts, self.slots, self.ff = parts, slots, ff
        self.names = [n for p in parts for n in p.names]
        self.in_features = parts[0].linear.in_features
        self.band = -(-slots.max_rank * len(self.names) // 2) * 2  # even: bf16 kernels read inputs in pairs
        self.width = -(-slots.max_loras * self.band // 32) * 32  # AMX tiles read 32 inputs at a time
        self.a = torch.zeros(self.width, self.in_features, dtype=slots.dtype, device=slots.device)
        self.b = [torch.zeros(self.width, p.linear.out_features, dtype=slots.dtype, device=slots.device)
                  for p in parts]
        self.holding: frozenset[int] = frozenset()  # the slots whose adapter has weights here (others: zeros)
        self.own = all(getattr(p.linear, "own", False) for p in parts)
        if self.own:
            for p in parts:
                p.linear.extend(self.width)
        self._pack()
        # the instance attribute wins over the class's method: the model's own forward now takes the adapters
        wrapped = ff if ff is not None else parts[0].linear
        self.base_forward = wrapped.forward
        wrapped.forward = self.forward_swiglu if ff is not None else self.forward
        wrapped.adapted = self  # what the runner's direct kernel calls ask for the extra inputs (DecoderLayer.direct)

    @torch.inference_mode()  # the bands may have been made in a step (inference tensors)
    def put(self, slot: int, adapter: Optional[Adapter]) -> None:
        """Write ``adapter``'s weights (or zeros) into ``slot``'s band."""
        rank = self.slots.max_rank
        start = (slot - 1) * self.band
        self.a[start:start + self.band].zero_()
        for b in self.b:
            b[start:start + self.band].zero_()
        j = 0
        for p, b in zip(self.parts, self.b, strict=True):
            offsets = list(itertools.accumulate([0] + p.rows))
            for i, name in enumerate(p.names):
                if adapter is not None and name in adapter.weights:
                    a_w, b_w = adapter.weights[name]
                    at = start + j * rank
                    self.a[at:at + adapter.rank] = a_w
                    b[at:at + adapter.rank, offsets[i]:offsets[i + 1]] = b_w.T
                j += 1
        holds = adapter is not None and any(name in adapter.weights for name in self.names)
        self.holding = self.holding | {slot} if holds else self.holding - {slot}
        self._pack()

    def _pack(self) -> None:
        if self.own:  # the A matmul on megapipe's kernel too: aten's small bf16 matmuls take several times as long
            self.a_packed = PackedLinear(self.a, own=True)
            for p, b in zip(self.parts, self.b, strict=True):
                p.linear.set_extra_inputs(b.T)

    def low(self, x: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[ExtraInputs]]:
        """The step's low-rank sums of x's rows, (x A^T) * mask [rows, width] (None when no row's adapter has
        weights here), and the same as the layers' extra inputs on megapipe's kernel, each row's band marked (None
        off that kernel)."""
        mask = self.slots.mask(self.band, self.width)
        if mask is None:
            return None, None
        bands = self.slots.bands(self.band, self.holding)  # each row's own adapter's columns: A's and B's
        if bands is None:
            return None, None
        rows = x.reshape(-1, self.in_features)
        if self.own and self.parts[0].linear._on_own(rows):
            low = self.a_packed.times(rows, mask, out_bands=bands)
            return low, ExtraInputs(low, bands)
        return torch.matmul(rows, self.a.T).mul_(mask), None

    def plain(self, i: int, x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        """Part i's output as aten computes it, base(x) + low B."""
        y = (self.base_forward if self.ff is None else self.parts[i].linear)(x)
        y.view(-1, y.shape[-1]).addmm_(low, self.b[i])
        return y

    def forward(self, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
        low, extra = self.low(x)
        if low is None:
            return self.base_forward(x) if activation == "none" else self.base_forward(x, activation)
        if activation not in ("none", "swish"):
            raise ValueError(f"an adapted linear fuses no {activation!r} (only 'none' and 'swish')")
        if extra is not None:
            return self.base_forward(x, activation, extra)
        y = self.plain(0, x, low)
        return F.silu(y) if activation == "swish" else y

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """A SwiGLU (PackedSwiGLU) whose gate and up projections are the parts."""
        low, extra = self.low(x)
        if low is None:
            return self.base_forward(x)
        if extra is not None:
            return self.base_forward(x, extra)
        return self.ff.w2(F.silu(self.plain(0, x, low)).mul_(self.plain(1, x, low)))


class AdapterSlots:
    """The registered adapters, the resident ones in slots (LRU), and the per-row masks of the current step."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int):
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.max_loras, self.max_rank, self.num_slots = max_loras, max_rank, max_loras + 1
        self.registered: dict[str, Adapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.free = list(range(1, self.num_slots))
        self.layers: dict[str, AdaptedInput] = {}  # by each weight name of its parts
        self._inputs = adaptable_inputs(model)
        self._ids = itertools.count(1)
        self._slots: Optional[torch.Tensor] = None  # each row's slot this step (None: no row has an adapter)
        self._onehot: Optional[torch.Tensor] = None
        self._masks: dict[tuple[int, int], torch.Tensor] = {}  # by (band, width)
        self._bands: dict[tuple[int, frozenset], Optional[RowBands]] = {}  # by band width and slots holding
        self.num_loads = 0

    def register(self, name: str, path: str, rank: int, scale: float, weights: dict) -> None:
        """Add an adapter (its weights fp32 as read; kept in the model's dtype, B scaled); not resident yet."""
        if rank > self.max_rank:
            raise MegapipeError(f"LoRA adapter {name!r} ({path}) has rank {rank}, more than --max-lora-rank "
                                f"{self.max_rank}")
        kept = {}
        for weight, (a, b) in weights.items():
            where = self._inputs.get(weight)
            if where is None:
                raise MegapipeError(f"LoRA adapter {name!r} ({path}) adapts {weight}, which this model's engine has "
                                    f"no linear layer for")
            part = next(p for p in where[1] if weight in p.names)
            inputs, rows = part.linear.in_features, part.rows[part.names.index(weight)]
            if tuple(a.shape) != (rank, inputs) or tuple(b.shape) != (rows, rank):
                raise MegapipeError(f"LoRA adapter {name!r} ({path}): {weight} has A {tuple(a.shape)} and B "
                                    f"{tuple(b.shape)}, but this model's layer takes {inputs} -> {rows} at rank "
                                    f"{rank}: the adapter is for another base model")
            kept[weight] = (a.to(self.device, self.dtype), (b.float() * scale).to(self.device, self.dtype))
        self.registered[name] = Adapter(name, str(path), rank, kept, next(self._ids).to_bytes(8, "little"))

    def replace(self, name: str, path: str, rank: int, scale: float, weights: dict) -> None:
        """Register new weights under ``name`` (vLLM's load_inplace); a resident adapter's slot takes them at once,
        so requests running with it go on with the new weights."""
        slot = self.resident.get(name)
        self.register(name, path, rank, scale, weights)
        if slot is not None:
            adapter = self.registered[name]
            for weight in adapter.weights:
                self._adapt(weight)
            for layer in set(self.layers.values()):
                layer.put(slot, adapter)

    def unregister(self, name: str) -> None:
        self.registered.pop(name)
        slot = self.resident.pop(name, None)
        if slot is not None:
            for layer in set(self.layers.values()):
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
        ff, parts = self._inputs[weight]
        layer = AdaptedInput(parts, self, ff)
        for slot_name, slot in self.resident.items():  # the resident adapters' weights of these layers too
            layer.put(slot, self.registered[slot_name])
        for n in layer.names:
            self.layers[n] = layer

    def slot(self, name: Optional[str]) -> int:
        return 0 if name is None else self.resident[name]

    def set_rows(self, slots: Optional[Sequence[int]]) -> None:
        """The slot of every row of the next forward (None or all 0: no adapter runs)."""
        self._masks, self._bands = {}, {}
        if not slots or not any(slots):
            self._slots = self._onehot = None
            return
        self._slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._onehot = F.one_hot(self._slots, self.num_slots)[:, 1:].to(self.dtype)  # slot 0 has no band

    def mask(self, band: int, width: int) -> Optional[torch.Tensor]:
        """[rows, width]: 1 on each row's own slot's band (none for slot 0; 0 past max_loras * band)."""
        if self._onehot is None:
            return None
        mask = self._masks.get((band, width))
        if mask is None:
            mask = F.pad(self._onehot.repeat_interleave(band, dim=1), (0, width - band * self.max_loras))
            self._masks[band, width] = mask
        return mask

    def bands(self, band: int, holding: frozenset) -> Optional[RowBands]:
        """Each row's band of ``band`` columns in the mask, none for slot 0 and for slots not in ``holding`` (an
        adapter without weights in the layer: its band is zeros there); None when no row has one."""
        key = (band, holding)
        if key not in self._bands:
            held = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
            held[list(holding)] = True
            rows_held = held[self._slots]
            start = torch.where(rows_held, (self._slots - 1) * band, -1).to(torch.int32)
            self._bands[key] = RowBands(start, band) if bool(rows_held.any()) else None
        return self._bands[key]


def adaptable_inputs(model: nn.Module) -> dict[str, tuple[Optional[nn.Module], list[Part]]]:
    """Every linear layer of the decoder layers by the weight names it holds, with the layers that read the same
    input: name -> (the PackedSwiGLU whose gate and up projections are the parts, or None; the parts). Packed layers
    (megapipe.inference.runner) by the names of the weights they fuse, plain nn.Linear by their own."""
    parts = {}
    for linear, weights, _, rows in packed_parts(model):
        if isinstance(linear, PackedLinear) and all(w.startswith("layers.") for w in weights) and len(weights) == len(rows):
            parts[linear] = Part(linear, weights, rows)
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name.startswith("layers."):
            parts[module] = Part(module, [f"{name}.weight"], [module.out_features])
    groups = {p.linear: (None, [p]) for p in parts.values()}
    for ff in model.modules():
        if isinstance(ff, PackedSwiGLU) and ff.w1 in parts and ff.w3 in parts:
            groups[ff.w1] = groups[ff.w3] = (ff, [parts[ff.w1], parts[ff.w3]])
    return {name: group for linear, group in groups.items() for name in parts[linear].names}
