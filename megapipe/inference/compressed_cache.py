"""DeepSeek-V4's compressed KV cache in the engine (megapipe.models.compressed_attention).

What a sequence keeps per layer:

- every layer: each token's key = value head (head_dim), in the paged pool (``kv_layout``: a latent pool of one
  row per token); a query reads the last ``sliding_window`` of them only, so the scheduler gives back the blocks
  behind the window (``eviction_window``), as for a model whose every layer is windowed.
- a compressed layer (HCA, CSA): its entries, one per ``rate`` tokens (CSA: and its indexer's key per entry), paged
  in an :class:`EntryPool`: per compression rate, blocks of ``block_size`` entries (``block_size * rate`` tokens)
  with one storage tensor per compressor of that rate, and a block table per sequence and rate
  (``Sequence.entry_ids``, a BlockManager per rate in the scheduler): blocks are taken as the sequence's entries
  grow and given back on finish / abort / preemption (a preempted sequence is recomputed from its tokens).
- the compressors' carry: the projections (``wkv``, ``wgate``) of the tokens of the block not yet complete, and, for
  the overlapping (CSA) compressors, those of the last complete block, whose first halves the next entry pools.
  Fixed in size, so it stays in a per-sequence slot of the engine's StatePool (megapipe.inference.state_cache),
  allocated with the sequence, carried through chunked prefill, given back with its blocks.

Why a pool per rate and not the window's blocks: the window's blocks go back as the sequence advances while its
entries stay, and one block id shared by every compressed layer would hold HCA entries at CSA's rate (32x the
memory on V4's rates 4 and 128); the layers of one rate grow alike, so they share a table. The engine splits its KV
memory into the window's pool, sized to what the running sequences' windows and a step's chunks need (it does not
grow with the context), and the entry pools, each given the same share of what max_num_seqs sequences of
max_model_len tokens would take, so a sequence's bytes per token are ``plan``'s (``compressed_kv_values``) but for
the last partial block of each table and the window's whole blocks.

A step: each layer stores its tokens' keys in their slots, then every sequence's compressors take the step's
tokens after its carry and pool the blocks they complete (entries roped at their blocks' first positions) into its
entry slots. Each row then attends, with the layer's sinks, to its window's keys (positions p - window + 1 .. p) and
to the entries it sees: every complete one (HCA), or the ``index_topk`` the lightning indexer scores highest among
them (CSA; the top-k taken over as many entries as the sequence has after the step, as transformers' cache does for
a prompt in one piece and for decodes: entries tied at exactly 0 may be picked otherwise when a prompt comes in
chunks, see the README). Prefix caching stays off (capability table): a cached block would need a snapshot of the
carry at its boundary.

Speculative decoding (megapipe.inference.speculative) verifies a sequence's last token and its drafts as one chunk.
What rejected drafts left in the window's pool and in the entry pools lies past the sequence's computed length:
masked, written again, the blocks taken for it given back (``Scheduler.rollback``). The carry would hold them, so a
verifying chunk's carry update is deferred: the step pools the entries its tokens complete from the carry as usual
and sets the chunk's projections aside; the verdict advances the carry over the kept tokens only (``commit_carry``).
Exact, as the carry is a function of the projections alone, and simpler than a snapshot of the slot to restore,
which would still need the kept tokens' projections to advance it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megapipe.errors import ConfigError
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


def compressors(model) -> dict[int, tuple[Compressor, ...]]:
    """Per compressed layer of ``model``: its compressor and (CSA) its indexer's."""
    return {m.layer_id: (m.compressor,) + ((m.indexer.compressor,) if m.indexer is not None else ())
            for m in model.modules() if isinstance(m, CompressedAttention) and m.compressor is not None}


def entry_bytes(model, dtype: torch.dtype) -> dict[int, int]:
    """Per compression rate of ``model``: the bytes of one entry over all its layers of that rate (CSA: with the
    indexer's key); empty for a model without compressed layers."""
    out: dict[int, int] = {}
    for parts in compressors(model).values():
        out[parts[0].rate] = out.get(parts[0].rate, 0) + sum(c.dim for c in parts) * dtype.itemsize
    return out


def entry_blocks_for(tokens: int, rate: int, block_size: int) -> int:
    """The entry blocks a sequence of ``tokens`` computed tokens holds at ``rate``: one entry per complete block of
    ``rate`` tokens, ``block_size`` entries a block."""
    return -(-(tokens // rate) // block_size)


class EntryPool:
    """The compressed layers' entries, paged (see the module docstring): per rate ``num_blocks[rate]`` blocks of
    ``block_size`` entries; ``store[layer_id]``: each of the layer's compressors' [blocks * block_size, dim]."""

    def __init__(self, model, num_blocks: dict[int, int], block_size: int, dtype: torch.dtype, device):
        self.num_blocks, self.block_size = dict(num_blocks), block_size
        # zeros: a padded (masked) entry must still be finite
        self.store = {i: tuple(torch.zeros(num_blocks[c.rate] * block_size, c.dim, dtype=dtype, device=device)
                               for c in parts) for i, parts in compressors(model).items()}
        self.bytes_per_entry = entry_bytes(model, dtype)

    def bytes_per_block(self, rate: int) -> int:
        return self.bytes_per_entry[rate] * self.block_size


class CompressorState:
    """One compressor's carry, ``slots`` of it: the projections [rate, width] of the partial block (``kv``,
    ``gate``) and, with overlap, of the last complete block (``before``)."""

    def __init__(self, compressor: Compressor, slots: int, dtype: torch.dtype, device):
        r, width = compressor.rate, compressor.position_bias.shape[-1]
        self.compressor = compressor
        self.kv, self.gate = (torch.zeros(slots, r, width, dtype=dtype, device=device) for _ in range(2))
        self.before = tuple(torch.zeros(slots, r, width, dtype=dtype, device=device) for _ in range(2)) \
            if compressor.overlap else ()
        # a verification's projections by state slot, until its drafts' verdict (``commit``)
        self.pending: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def tensors(self) -> tuple:
        return (self.kv, self.gate, *self.before)

    def clear(self, slot: int) -> None:
        """A new sequence: no carry (its entries are written before any query reads them)."""
        for t in self.tensors():
            t[slot].zero_()

    def update(self, x: torch.Tensor, plan: "StepPlan", cos_sin, store: torch.Tensor) -> None:
        """x [T, H] the step's attention inputs: each sequence's tokens continue its carry; the blocks they complete
        are pooled into its entries (their slots of ``store``, plan.entry_slots), the rest kept as carry. The
        decodes (one token each) at once."""
        comp, r = self.compressor, self.compressor.rate
        slots = plan.entry_slots[r]
        kv_rows, gate_rows = comp.wkv(x), comp.wgate(x)
        if plan.num_decodes:
            self._decodes(kv_rows, gate_rows, plan.positions[:plan.num_decodes], plan.row_slots[:plan.num_decodes],
                          cos_sin, store, slots)
        for index, (offset, start, n, slot) in enumerate(plan.sequences[plan.num_decodes:], start=plan.num_decodes):
            first, have = start // r, start % r
            kv, gate = kv_rows[offset:offset + n], gate_rows[offset:offset + n]
            if have:
                kv, gate = torch.cat([self.kv[slot, :have], kv]), torch.cat([self.gate[slot, :have], gate])
            whole = ((start + n) // r - first) * r
            if whole:
                before = (self.before[0][slot][None], self.before[1][slot][None]) if self.before and first else None
                pooled = comp.pool(kv[None, :whole], gate[None, :whole], before)
                store.index_copy_(0, slots[index, first:first + whole // r],
                                  entry_rope(pooled, r, cos_sin, first)[0].to(store.dtype))
            if slot in plan.deferred:
                self.pending[slot] = (start, kv_rows[offset:offset + n].clone(), gate_rows[offset:offset + n].clone())
            else:
                self._carry(slot, kv, gate, whole)

    def _carry(self, slot: int, kv: torch.Tensor, gate: torch.Tensor, whole: int) -> None:
        """The carry after the projections ``kv``, ``gate`` from the start of the slot's partial block, the first
        ``whole`` of them in complete blocks."""
        r = self.compressor.rate
        if whole and self.before:
            self.before[0][slot] = kv[whole - r:whole]
            self.before[1][slot] = gate[whole - r:whole]
        self.kv[slot, :len(kv) - whole] = kv[whole:]
        self.gate[slot, :len(gate) - whole] = gate[whole:]

    def commit(self, slot: int, kept: int) -> None:
        """A deferred sequence's verdict: its carry advances over the first ``kept`` tokens of its step (the last
        token and the accepted drafts); the rejected ones' are dropped (their entries lie past the sequence's count,
        masked and written again)."""
        start, kv, gate = self.pending.pop(slot)
        r = self.compressor.rate
        have = start % r
        kv, gate = torch.cat([self.kv[slot, :have], kv[:kept]]), torch.cat([self.gate[slot, :have], gate[:kept]])
        self._carry(slot, kv, gate, ((start + kept) // r - start // r) * r)

    def _decodes(self, kv_rows: torch.Tensor, gate_rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 cos_sin, store: torch.Tensor, entry_slots: torch.Tensor) -> None:
        """The first len(positions) rows, one token of each sequence (the first sequences of the plan): into its
        carry, and those that complete a block pooled together (an overlap's block 0 with a gate of -inf for the
        block before it)."""
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
        store[entry_slots[done, blocks]] = rotate_trailing_pairs(pooled, cos[:, 0], sin[:, 0])[:, 0].to(store.dtype)
        if self.before:
            self.before[0][slots], self.before[1][slots] = kv, gate


def compressed_states(model, slots: int, dtype: torch.dtype, device) -> dict[int, tuple]:
    """Per compressed layer of ``model``: the carry of its compressor and (CSA) its indexer's."""
    return {i: tuple(CompressorState(c, slots, dtype, device) for c in parts)
            for i, parts in compressors(model).items()}


def compressed_bytes_per_sequence(model, dtype: torch.dtype) -> int:
    """Bytes one sequence's carry takes over all compressed layers (its entries are paged: EntryPool)."""
    states = compressed_states(model, 1, dtype, "meta")
    return sum(t.numel() * t.element_size() for parts in states.values() for state in parts for t in state.tensors())


@dataclass
class StepPlan:
    """What every V4 layer of one step reads: each row's position, state slot, sequence (its index in
    ``sequences``), window's pool slots (and which are real: position >= 0), the sequences as (first row, first
    position, tokens, state slot), and per rate each sequence's entry slots in the EntryPool [sequences, entries]
    (as many as the longest has after the step; a shorter one's padded with slot 0)."""

    positions: torch.Tensor  # [T]
    row_slots: torch.Tensor  # [T]
    row_seqs: torch.Tensor  # [T]
    window_slots: torch.Tensor  # [T, window]
    window_keep: torch.Tensor  # [T, window] bool
    sequences: list[tuple[int, int, int, int]]
    entry_slots: dict[int, torch.Tensor]
    entries_after: torch.Tensor  # [T] each row's sequence's length after the step (its entries: // rate)
    num_decodes: int  # the first sequences have one token each
    inv_freq: Optional[torch.Tensor] = None  # the compressed layers' rope frequencies, once per step
    deferred: frozenset = frozenset()  # state slots whose carry waits for their drafts' verdict (commit)


def _entry_slots(tables: Sequence[Sequence[int]], width: int, block_size: int) -> torch.Tensor:
    """[sequences, width] each sequence's first ``width`` entries' slots through its block table (past its blocks:
    its last block's, never read unmasked)."""
    e = torch.arange(width)
    rows = []
    for table in tables:
        ids = torch.tensor(list(table) or [0], dtype=torch.long)
        rows.append(ids[(e // block_size).clamp(max=len(ids) - 1)] * block_size + e % block_size)
    return torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.long)


def plan_step(batch, decodes: Sequence[tuple], chunks: Sequence[tuple], state_slots: Sequence[int],
              window: int, deferred: Sequence[int] = ()) -> torch.Tensor:
    """PagedBatch.plan for a DeepSeek-V4 model, whose block tables are (the window's block ids, {rate: entry block
    ids}) pairs: sets ``batch.slots`` (where each token's key goes), ``batch.num_decodes`` and ``batch.compressed``
    (a StepPlan); -> positions [1, T]. ``deferred``: the state slots of chunks that verify drafts (their carry
    advances at ``commit_carry``)."""
    bs, dev = batch.pool.block_size, batch.pool.device
    spans = [(blocks, pos, 1) for blocks, pos in decodes] + list(chunks)
    sequences, slots, windows, positions, row_slots, row_seqs, after = [], [], [], [], [], [], []
    offset = 0
    back = torch.arange(window - 1, -1, -1)
    for index, (((blocks, _), start, n), slot) in enumerate(zip(spans, state_slots, strict=True)):
        table = torch.tensor(list(blocks), dtype=torch.long)
        pos = torch.arange(start, start + n)
        seen = pos[:, None] - back[None]  # [n, window] the positions each row's window covers
        windows.append(seen)
        safe = seen.clamp(min=0)
        slots.append(table[safe // bs] * bs + safe % bs)
        positions.append(pos)
        row_slots.append(torch.full((n,), slot, dtype=torch.long))
        row_seqs.append(torch.full((n,), index, dtype=torch.long))
        # a verification's rows rank the indexer's entries as the decodes they stand for: over those they see
        after.append(pos + 1 if slot in deferred else torch.full((n,), start + n, dtype=torch.long))
        sequences.append((offset, start, n, slot))
        offset += n
    entries = batch.pool.entries
    longest = max(start + n for _, start, n in spans)
    entry_slots = {r: _entry_slots([blocks[1].get(r, ()) for blocks, _, _ in spans], longest // r,
                                   entries.block_size).to(dev) for r in entries.num_blocks}
    window_slots = torch.cat(slots)
    positions_t = torch.cat(positions)
    batch.slots = window_slots[:, -1].to(dev)
    batch.num_decodes = len(decodes)
    batch.compressed = StepPlan(positions_t.to(dev), torch.cat(row_slots).to(dev), torch.cat(row_seqs).to(dev),
                                window_slots.to(dev), (torch.cat(windows) >= 0).to(dev), sequences, entry_slots,
                                torch.cat(after).to(dev), len(decodes), deferred=frozenset(deferred))
    return positions_t[None].to(dev)


def commit_carry(states, slot: int, kept: int) -> None:
    """After a verification of the sequence in state slot ``slot`` (a StatePool's) that kept ``kept`` tokens: every
    compressor's carry advances over them (CompressorState.commit)."""
    for parts in states.compressed.values():
        for state in parts:
            state.commit(slot, kept)


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

    stores = batch.pool.entries.store[layer.layer_id]
    for state, store in zip(batch.states.compressed[layer.layer_id], stores, strict=True):
        state.update(x[0], plan, cos_sin, store)
    r = layer.rate
    seen = (plan.positions + 1) // r  # complete entries each row sees
    count = plan.entries_after // r  # entries its sequence has after the step
    width = int(count.max())
    row_entries = plan.entry_slots[r][plan.row_seqs, :width]  # [T, E] each row's sequence's entry slots
    if layer.indexer is None:
        return stores[0][row_entries].to(x.dtype), torch.arange(width, device=x.device)[None] < seen[:, None]
    indexer = layer.indexer
    iq, weights = indexer.queries(x, q_latent, pos)  # [1, T, heads, dim], [1, T, heads]
    keys = stores[1][row_entries].to(x.dtype)  # [T, E, dim]
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
    entries = stores[0][row_entries.gather(1, chosen.clamp(min=0))].to(x.dtype)  # [T, k, hd]
    return entries, chosen >= 0


def sequence_kv_bytes(engine, seq) -> dict[str, int]:
    """What one running sequence holds in ``engine`` now, in bytes: ``window``, its blocks in the paged pool (the
    keys not yet given back); ``entries``, its blocks in the entry pools; ``carry``, its compressors' partial blocks
    (fixed per sequence, in its state slot)."""
    pool = engine.pool
    window = len(seq.block_ids[seq.num_evicted:]) * pool.bytes_per_block(pool.num_layers, pool.block_size,
                                                                         pool.kv_heads, pool.head_dim, pool.dtype,
                                                                         pool.latent)
    entries = sum(len(ids) * pool.entries.bytes_per_block(r) for r, ids in seq.entry_ids.items())
    carry = sum(t[0].numel() * t.element_size() for states in engine.states.compressed.values() for state in states
                for t in state.tensors())
    return {"window": window, "entries": entries, "carry": carry}


def kv_bytes_per_token(pool, window: int, context: int) -> float:
    """What a sequence of ``context`` tokens keeps per token in ``pool`` (a KVPool with its ``entries``) under a
    ``window``, counted as ``plan`` does (compressed_kv_values): the window's keys and every complete entry, not
    rounded to blocks."""
    keys = min(context, window) * pool.bytes_per_token()
    return (keys + sum(context // r * b for r, b in pool.entries.bytes_per_entry.items())) / context


def pool_blocks(entry_bytes: dict[int, int], memory: Optional[int], fixed: int, per_block: int, window: int,
                max_num_seqs: int, max_model_len: int, block_size: int, max_batched: int,
                default: int) -> tuple[int, dict[int, int]]:
    """A DeepSeek-V4 engine's pools out of its KV memory (``memory`` bytes, None: the default; ``fixed`` of them the
    state slots): (the window's blocks, {rate: entry blocks}). The window's pool gets what ``max_num_seqs`` windows and
    a step's chunks need (the keys behind a window go back); the entry pools the rest, each the same fraction of what
    ``max_num_seqs`` sequences of ``max_model_len`` tokens would hold. The default memory holds all of that, its
    entries capped at ``default`` bytes but never under one sequence's."""
    bs = block_size
    window_blocks = max_num_seqs * (-(-window // bs) + 2) + -(-max_batched // bs)
    one = {r: entry_blocks_for(max_model_len, r, bs) for r in entry_bytes}
    need = sum(one[r] * b * bs for r, b in entry_bytes.items())  # one sequence of max_model_len
    want = max_num_seqs * need
    if memory is None:
        memory = fixed + window_blocks * per_block + max(min(want, default), need)
    spare = memory - fixed - window_blocks * per_block
    if spare < need:
        raise ConfigError(f"--kv-cache-memory = {memory} bytes does not hold the carry and window keys of "
                          f"--max-num-seqs {max_num_seqs} sequences ({memory - spare} bytes) and the compressed "
                          f"entries of one sequence of --max-model-len {max_model_len} ({need} bytes): give more "
                          f"memory, fewer sequences or a smaller --max-model-len")
    share = spare / want if want else 0.0
    return window_blocks, {r: max(1, one[r], int(max_num_seqs * one[r] * share)) for r in entry_bytes}
