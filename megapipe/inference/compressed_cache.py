"""DeepSeek-V4's compressed KV cache in the engine (megapipe.models.compressed_attention).

What a sequence keeps per layer:

- every layer: each token's key = value head (head_dim), in the paged pool (``kv_layout``: a latent pool of one
  row per token); a query reads the last ``sliding_window`` of them only, so the scheduler gives back the blocks
  behind the window (``eviction_window``), as for a model whose every layer is windowed.
- a compressed layer (HCA, CSA): its entries, one per ``rate`` tokens (CSA: and its indexer's key per entry), and the
  compressors' carry: the projections (``wkv``, ``wgate``) of the tokens of the block not yet complete, and, for the
  overlapping (CSA) compressors, those of the last complete block, whose first halves the next entry pools. These
  live in a per-sequence slot of the engine's StatePool (megapipe.inference.state_cache), allocated with the
  sequence, carried through chunked prefill, given back on finish / abort / preemption (a preempted sequence is
  recomputed from its tokens); entries are reserved for ``max_model_len`` tokens per slot, not paged.

A step: each layer stores its tokens' keys in their slots, then every sequence's compressors take the step's
tokens after its carry and pool the blocks they complete (entries roped at their blocks' first positions). Each
row then attends, with the layer's sinks, to its window's keys (positions p - window + 1 .. p) and to the entries
it sees: every complete one (HCA), or the ``index_topk`` the lightning indexer scores highest among them (CSA; the
top-k taken over as many entries as the sequence has after the step, as transformers' cache does for a prompt in
one piece and for decodes: entries tied at exactly 0 may be picked otherwise when a prompt comes in chunks, see the
README). Prefix caching stays off (capability table): a cached block would need a snapshot of the carry at its
boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megapipe.models.attention import additive
from megapipe.models.compressed_attention import (
    CompressedAttention,
    Compressor,
    V4Positions,
    compress_inv_frequencies,
    entry_rope,
)
from megapipe.models.rope import pair_cos_sin, rotate_trailing_pairs

ROWS = 256  # rows attended at once: bounds the gathered keys of a long prefill chunk


class CompressorState:
    """One compressor's per-sequence state, ``slots`` of it: entries [capacity, dim]; the projections [rate, width]
    of the partial block (``kv``, ``gate``) and, with overlap, of the last complete block (``before``)."""

    def __init__(self, compressor: Compressor, slots: int, capacity: int, dtype: torch.dtype, device):
        r, width = compressor.rate, compressor.position_bias.shape[-1]
        self.compressor = compressor
        self.entries = torch.zeros(slots, capacity, compressor.dim, dtype=dtype, device=device)
        self.kv, self.gate = (torch.zeros(slots, r, width, dtype=dtype, device=device) for _ in range(2))
        self.before = tuple(torch.zeros(slots, r, width, dtype=dtype, device=device) for _ in range(2)) \
            if compressor.overlap else ()

    def tensors(self) -> tuple:
        return (self.entries, self.kv, self.gate, *self.before)

    def clear(self, slot: int) -> None:
        """A new sequence: no carry (its entries are written before any query reads them)."""
        for t in (self.kv, self.gate, *self.before):
            t[slot].zero_()

    def update(self, x: torch.Tensor, plan: "StepPlan", cos_sin) -> None:
        """x [T, H] the step's attention inputs: each sequence's tokens continue its carry; the blocks they complete
        are pooled into its entries, the rest kept as carry. The decodes (one token each) at once."""
        comp, r = self.compressor, self.compressor.rate
        kv_rows, gate_rows = comp.wkv(x), comp.wgate(x)
        if plan.num_decodes:
            self._decodes(kv_rows, gate_rows, plan.positions[:plan.num_decodes], plan.row_slots[:plan.num_decodes],
                          cos_sin)
        for offset, start, n, slot in plan.sequences[plan.num_decodes:]:
            first, have = start // r, start % r
            kv, gate = kv_rows[offset:offset + n], gate_rows[offset:offset + n]
            if have:
                kv, gate = torch.cat([self.kv[slot, :have], kv]), torch.cat([self.gate[slot, :have], gate])
            blocks = (start + n) // r - first
            if blocks:
                before = (self.before[0][slot][None], self.before[1][slot][None]) if self.before and first else None
                whole = blocks * r
                pooled = comp.pool(kv[None, :whole], gate[None, :whole], before)
                self.entries[slot, first:first + blocks] = entry_rope(pooled, r, cos_sin, first)[0]
                if self.before:
                    self.before[0][slot] = kv[whole - r:whole]
                    self.before[1][slot] = gate[whole - r:whole]
                kv, gate = kv[whole:], gate[whole:]
            self.kv[slot, :len(kv)] = kv
            self.gate[slot, :len(gate)] = gate

    def _decodes(self, kv_rows: torch.Tensor, gate_rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 cos_sin) -> None:
        """The first len(positions) rows, one token of each sequence: into its carry, and those that complete a
        block pooled together (an overlap's block 0 with a gate of -inf for the block before it)."""
        comp, r, count = self.compressor, self.compressor.rate, len(positions)
        self.kv[slots, positions % r] = kv_rows[:count]
        self.gate[slots, positions % r] = gate_rows[:count]
        done = ((positions + 1) % r == 0).nonzero()[:, 0]
        if not len(done):
            return
        slots, blocks = slots[done], positions[done] // r
        kv, gate = self.kv[slots], self.gate[slots]
        before = None
        if self.before:
            before = (self.before[0][slots], self.before[1][slots].masked_fill((blocks == 0)[:, None, None], -math.inf))
        pooled = comp.pool(kv, gate, before)  # [done, 1, dim]
        cos, sin = cos_sin(blocks[:, None] * r)  # [done, 1, 1, rope / 2]
        self.entries[slots, blocks] = rotate_trailing_pairs(pooled, cos[:, 0], sin[:, 0])[:, 0]
        if self.before:
            self.before[0][slots], self.before[1][slots] = kv, gate


def compressed_states(model, slots: int, max_len: int, dtype: torch.dtype, device) -> dict[int, tuple]:
    """Per compressed layer of ``model``: its compressor's state and (CSA) its indexer's."""
    states = {}
    for m in model.modules():
        if isinstance(m, CompressedAttention) and m.compressor is not None:
            parts = [m.compressor] + ([m.indexer.compressor] if m.indexer is not None else [])
            states[m.layer_id] = tuple(CompressorState(c, slots, max_len // c.rate, dtype, device) for c in parts)
    return states


def compressed_bytes_per_sequence(model, max_len: int, dtype: torch.dtype) -> int:
    """Bytes one sequence's slot takes over all compressed layers (entries for ``max_len`` tokens and the carry)."""
    states = compressed_states(model, 1, max_len, dtype, "meta")
    return sum(t.numel() * t.element_size() for parts in states.values() for state in parts for t in state.tensors())


@dataclass
class StepPlan:
    """What every V4 layer of one step reads: each row's position, state slot, window's pool slots (and which are
    real: position >= 0) and the sequences as (first row, first position, tokens, state slot)."""

    positions: torch.Tensor  # [T]
    row_slots: torch.Tensor  # [T]
    window_slots: torch.Tensor  # [T, window]
    window_keep: torch.Tensor  # [T, window] bool
    sequences: list[tuple[int, int, int, int]]
    entries_after: torch.Tensor  # [T] each row's sequence's length after the step (its entries: // rate)
    num_decodes: int  # the first sequences have one token each
    inv_freq: Optional[torch.Tensor] = None  # the compressed layers' rope frequencies, once per step


def plan_step(batch, decodes: Sequence[tuple], chunks: Sequence[tuple], state_slots: Sequence[int],
              window: int) -> torch.Tensor:
    """PagedBatch.plan for a DeepSeek-V4 model: sets ``batch.slots`` (where each token's key goes),
    ``batch.num_decodes`` and ``batch.compressed`` (a StepPlan); -> positions [1, T]."""
    bs, dev = batch.pool.block_size, batch.pool.device
    spans = [(blocks, pos, 1) for blocks, pos in decodes] + list(chunks)
    sequences, slots, windows, positions, row_slots, after = [], [], [], [], [], []
    offset = 0
    back = torch.arange(window - 1, -1, -1)
    for (blocks, start, n), slot in zip(spans, state_slots, strict=True):
        table = torch.tensor(list(blocks), dtype=torch.long)
        pos = torch.arange(start, start + n)
        seen = pos[:, None] - back[None]  # [n, window] the positions each row's window covers
        windows.append(seen)
        safe = seen.clamp(min=0)
        slots.append(table[safe // bs] * bs + safe % bs)
        positions.append(pos)
        row_slots.append(torch.full((n,), slot, dtype=torch.long))
        after.append(torch.full((n,), start + n, dtype=torch.long))
        sequences.append((offset, start, n, slot))
        offset += n
    window_slots = torch.cat(slots)
    positions_t = torch.cat(positions)
    batch.slots = window_slots[:, -1].to(dev)
    batch.num_decodes = len(decodes)
    batch.compressed = StepPlan(positions_t.to(dev), torch.cat(row_slots).to(dev), window_slots.to(dev),
                                (torch.cat(windows) >= 0).to(dev), sequences, torch.cat(after).to(dev),
                                len(decodes))
    return positions_t[None].to(dev)


def attend(batch, layer: CompressedAttention, x: torch.Tensor, pos: V4Positions) -> torch.Tensor:
    """``layer`` over one engine step: x [1, T, H] -> [1, T, H] (see the module docstring)."""
    plan: StepPlan = batch.compressed
    q_latent, q, kv, (cos, sin) = layer.project(x, pos)
    pool = batch.pool.k[layer.layer_id][0]  # [slots, hd]
    pool.index_copy_(0, batch.slots, kv[0, 0].to(pool.dtype))
    keys, keep = pool[plan.window_slots].to(x.dtype), plan.window_keep  # [T, window, hd]
    if layer.compressor is not None:
        entries, seen = _entries(batch, layer, x, q_latent, pos, plan)
        keys, keep = torch.cat([keys, entries], dim=1), torch.cat([keep, seen], dim=1)
    q = q[0].transpose(0, 1)  # [T, heads, hd]
    out = torch.empty_like(q)
    for first in range(0, q.shape[0], ROWS):  # each row a decode over its own keys (one key = value head)
        rows = slice(first, first + ROWS)
        k = keys[rows, None]  # [rows, 1, K, hd]
        batch._decode(q[rows], k.transpose(-1, -2), k, out[rows, None], q.shape[-1] ** -0.5, layer.sinks,
                      additive(keep[rows, None, None], torch.float32))
    return layer.output(out.transpose(0, 1)[None], cos, sin)


def _entries(batch, layer: CompressedAttention, x: torch.Tensor, q_latent: torch.Tensor, pos: V4Positions,
             plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the step's entries, then -> (the entries each row may attend to [T, E, hd], which are real [T, E])."""
    if plan.inv_freq is None:
        plan.inv_freq = compress_inv_frequencies(layer.cfg, x.device)
    inv_freq = plan.inv_freq

    def cos_sin(p):
        return pair_cos_sin(p, inv_freq, x.dtype)

    states = batch.states.compressed[layer.layer_id]
    for state in states:
        state.update(x[0], plan, cos_sin)
    r = layer.rate
    seen = (plan.positions + 1) // r  # complete entries each row sees
    count = plan.entries_after // r  # entries its sequence has after the step
    width = int(count.max())
    main = states[0].entries
    if layer.indexer is None:
        entries = main.index_select(0, plan.row_slots)[:, :width]
        return entries, torch.arange(width, device=x.device)[None] < seen[:, None]
    indexer = layer.indexer
    iq, weights = indexer.queries(x, q_latent, pos)  # [1, T, heads, dim], [1, T, heads]
    keys = states[1].entries.index_select(0, plan.row_slots)[:, :width]  # [T, E, dim]
    scores = indexer.scores(iq[0, :, None], weights[0, :, None], keys)[:, 0]  # [T, E]
    k = min(indexer.topk, width)
    chosen = torch.full((scores.shape[0], k), -1, dtype=torch.long, device=x.device)
    # top-k over exactly the sequence's entries: torch breaks ties among equal scores by the row's length
    for c in torch.unique(count).tolist():
        if c == 0:
            continue
        rows = (count == c).nonzero()[:, 0]
        picked = indexer.choose(scores[rows, None, :c], seen[rows, None])[:, 0]
        chosen[rows, :picked.shape[1]] = picked
    entries = main[plan.row_slots[:, None], chosen.clamp(min=0)]  # [T, k, hd]
    return entries, chosen >= 0



def sequence_kv_bytes(engine, seq) -> dict[str, int]:
    """What one running sequence holds in ``engine`` now, in bytes: ``window``, its blocks in the paged pool (the
    keys not yet given back); ``entries``, the compressed entries of its computed tokens; ``carry``, its
    compressors' partial blocks (fixed per sequence)."""
    pool = engine.pool
    window = len(seq.block_ids[seq.num_evicted:]) * pool.bytes_per_block(pool.num_layers, pool.block_size,
                                                                         pool.kv_heads, pool.head_dim, pool.dtype,
                                                                         pool.latent)
    entries = carry = 0
    for states in engine.states.compressed.values():
        for state in states:
            entries += seq.num_computed // state.compressor.rate * state.entries[0, 0].numel() * \
                state.entries.element_size()
            carry += sum(t[0].numel() * t.element_size() for t in state.tensors()[1:])
    return {"window": window, "entries": entries, "carry": carry}
