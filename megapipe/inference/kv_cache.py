"""The paged KV cache: one pool of fixed-size blocks allocated at start, and the per-step attention over it.

Storage: per attending layer one key and one value tensor [kv_heads, num_blocks * block_size, head_dim]; a token's *slot* is
``block_id * block_size + offset``. A sequence owns a list of block ids (its block table), so its keys need not be
contiguous and blocks can be shared (prefix caching) or returned at any time.

An engine step runs the model once on a flattened batch: every scheduled token of every sequence in one row
[1, T] with its own position. :class:`PagedBatch` is what the model sees as its ``cache``: ``advance(positions)``
(nothing to do: the step was planned by the engine) and ``attend(layer_id, q, k, v)``, which writes the new keys and
values into their slots and computes attention per sequence:

- on CPU every row at once by ``megapipe.inference.kernels``' paged attention (sinks included), which reads each sequence's keys
  and values in place through its block table (a chunk's row at position p attends to positions [0, p]);
- elsewhere, or where that kernel cannot be built: one-token queries (decodes) together, as a padded batch over
  their gathered keys, in two batched matmuls;
- and longer chunks (prefill, chunked prefill, recompute after preemption) with SDPA, causal from the chunk's first
  position, over the sequence's earlier keys when it does not start at 0; neighbouring whole prompts of one length
  (a batch of equal prompts) in one call, each other chunk on its own.

Tokens are ordered decodes first, then the chunks, so each group is a contiguous slice of the batch.

Per-layer windows (GPT-OSS's windowed and full layers): ``sliding_window`` may map each layer to its window
(``layer_windows``); the decode masks and chunk masks are planned once per distinct window and each layer attends
with its own. KV is stored per token whatever the window, so prefix caching is unchanged. When every layer is windowed
(``eviction_window``) the scheduler gives back a sequence's blocks wholly behind the window, their ids left in its
block table as placeholders that only masked positions read. A model with windowed and full-attention layers
(GPT-OSS, ``split_window``) keeps its windowed layers' keys and values in blocks of their own (``windowed_layers``,
``windowed_blocks`` of the pool): each sequence has two block tables, given to ``plan`` as (full, windowed) pairs,
and the windowed one gives back its blocks behind the window while the full one keeps them all; each window's plan
holds its table's slots, so a layer stores and reads through its own. Attention sinks (``sinks`` [heads]): one more
logit in every row's softmax denominator, on each path (the decode softmax, ``sink_attention`` for chunks, the
kernel's running sum).

A hybrid model's Mamba layers call ``ssm(layer_id, mixer, xbc, dt)`` instead: each sequence's conv window and SSM
state live in a slot of the engine's StatePool (megapipe.inference.state_cache); the decodes take one step of the
recurrence together from their gathered states, each chunk runs the scan from its sequence's state (from zeros
when it starts at position 0; neighbouring new prompts of one length as one batch), and the states are written back.

Multi-latent attention (megapipe.models.mla) has a *latent* pool (``kv_layout``): per layer one tensor
[1, slots, kv_lora_rank + rope dims] of each token's ``c_kv`` and shared rope key, read as both keys and values (no
second copy). Its layers call ``attend_latent``: decodes attend to the latents directly as multi-query attention, the
key up-projection absorbed into the query and the value up-projection applied to the output (vLLM's MLA decode);
prefill chunks expand their latents (and the cached ones before them) to per-head keys and values for SDPA; a step
whose chunks are all short (``ABSORB_ROWS``: a speculative verification, MTP drafting) attends them row by row as
decodes at their positions, all new latents being stored before any row attends.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from megapipe.inference import compressed_cache
from megapipe.inference.state_cache import StatePool
from megapipe.models.attention import additive, sink_attention, with_sink_column

KEY_BUCKET = 16
# a latent pool's chunks of at most this many rows attend as decodes do (absorbed up-projections)
ABSORB_ROWS = 8


def layer_windows(cfg) -> dict[int, Optional[int]]:
    """Each layer's sliding window (None: full attention), the PagedBatch's ``sliding_window``; DeepSeek-V4's layers
    all read their keys over the window (their compressed entries live in entry pools: compressed_cache)."""
    if cfg.attention_layer_types is not None:
        return {i: cfg.sliding_window for i in range(cfg.num_layers)}
    return {i: cfg.layer_window(i) for i in range(cfg.num_layers)}


def eviction_window(cfg) -> Optional[int]:
    """How far back any layer attends when every layer has a window (the blocks behind it can be given back), else
    None: a full-attention layer (GPT-OSS's every other one) needs every key of the sequence."""
    windows = set(layer_windows(cfg).values())
    return None if None in windows else max(windows)


def split_window(cfg) -> Optional[int]:
    """A model with windowed and full-attention layers: how far back its windowed layers attend (their own block
    table gives back what is behind it); None when every layer is alike (full, or windowed: ``eviction_window``)."""
    windows = set(layer_windows(cfg).values())
    return max(w for w in windows if w is not None) if None in windows and len(windows) > 1 else None


def kv_layout(cfg) -> dict:
    """What a pool stores per token and layer for this model (ModelConfig): kv_heads x head_dim keys and as many
    values, or with multi-latent attention one latent row of kv_lora_rank + rope dims, its keys and values alike
    (with DeepSeek Sparse Attention the indexer's key after them)."""
    if cfg.multi_latent_attention:  # DeepSeek Sparse Attention: the indexer's key per token beside the latent
        index = cfg.dsa_indexer_head_dim if cfg.sparse_attention else 0
        return dict(kv_heads=1, head_dim=cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim + index, latent=True)
    if cfg.attention_layer_types is not None:  # DeepSeek-V4: each token's key = value head (compressed_cache)
        return dict(kv_heads=1, head_dim=cfg.dim_per_head, latent=True)
    return dict(kv_heads=cfg.kv_heads, head_dim=cfg.dim_per_head, latent=False)


class KVPool:
    """``layers``: how many layers (ids 0..n-1), or the ids of the layers that attend (a hybrid model's attention
    layers: its Mamba and MLP layers get no KV memory); ``k[layer_id]`` / ``v[layer_id]`` either way. Those of
    ``windowed_layers`` hold ``windowed_blocks`` blocks, addressed by the sequences' windowed block tables.
    ``entries``: DeepSeek-V4's compressed entries, paged per rate (compressed_cache.EntryPool)."""

    def __init__(self, layers: Union[int, Sequence[int]], num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device, latent: bool = False,
                 windowed_layers: Sequence[int] = (), windowed_blocks: int = 0, entries=None):
        if latent and kv_heads != 1:
            raise ValueError(f"a latent KV pool has one row per token and layer, not {kv_heads} kv heads")
        self.num_blocks, self.block_size, self.latent = num_blocks, block_size, latent
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, torch.device(device)
        ids = range(layers) if isinstance(layers, int) else list(layers)
        self.windowed_layers, self.windowed_blocks = frozenset(windowed_layers), windowed_blocks
        self.entries = entries

        def zeros(i):  # zeros, not empty: a padded (masked) key must still be finite, or 0 * inf poisons the softmax
            blocks = windowed_blocks if i in self.windowed_layers else num_blocks
            return torch.zeros((kv_heads, blocks * block_size, head_dim), dtype=dtype, device=device)

        self.k = {i: zeros(i) for i in ids}
        self.v = self.k if latent else {i: zeros(i) for i in ids}
        self.num_layers = len(ids)
        self.element_size = torch.empty(0, dtype=dtype).element_size() if ids else 0

    def bytes_per_token(self) -> int:
        """Bytes the pool holds per token over all its layers."""
        return self.bytes_per_block(self.num_layers, 1, self.kv_heads, self.head_dim, self.dtype, self.latent)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                        latent: bool = False) -> int:
        tensors = 1 if latent else 2
        return tensors * num_layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


@dataclass
class Chunk:
    """Tokens [offset, offset + n) of the flattened batch are positions [start, start + n) of one sequence."""

    offset: int
    start: int
    n: int
    key_slots: Optional[torch.Tensor]  # slots of positions [0, start + n), or None when start == 0 (keys are local)
    mask: Optional[torch.Tensor]  # additive [n, start + n] when plain causal does not describe it


# what PagedBatch plans per window: the chunks and masks, and the slots and block tables of the window's block table
PLANNED = ("chunks", "runs", "decode_mask", "_mask_cast", "slots", "block_table", "decode_index", "decode_len")


def _as_batch(t: torch.Tensor, count: int) -> torch.Tensor:
    """[count * n, heads, D] token-major rows of ``count`` equal sequences -> [count, heads, n, D] (a view)."""
    return t.view(count, -1, t.shape[1], t.shape[2]).transpose(1, 2)


def _slots(block_ids: Sequence[int], block_size: int, length: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(length)]


class PagedBatch:
    """The ``cache`` object of one engine step (see the module docstring)."""

    def __init__(self, pool: KVPool, sliding_window: Union[None, int, Mapping[int, Optional[int]]] = None,
                 kernel: Optional[Callable] = None, states: Optional[StatePool] = None,
                 mamba_step: Optional[Callable] = None):
        """``sliding_window``: one window for every layer, or each layer's (``layer_windows``; None: full);
        ``mamba_step``: the fused decode step of Mamba layers (megapipe.inference.kernels), None: the mixer's own."""
        self.pool, self.kernel, self.states, self.mamba_step = pool, kernel, states, mamba_step
        self.windows = sliding_window if isinstance(sliding_window, Mapping) else None
        self.window = None if self.windows is not None else sliding_window  # the window being planned / attended
        # (first row, sequences, tokens each, from their states?, their state slots): scanned together by ``ssm``
        self.state_runs: list[tuple[int, int, int, bool, torch.Tensor, Optional[int]]] = []
        self.slots: Optional[torch.Tensor] = None  # [T] where each token's k/v go
        self.num_decodes = 0
        # kernel: int32 block tables [sequences, blocks], and per row its sequence and the positions it attends to
        self.block_table: Optional[torch.Tensor] = None
        self.seq_of_row: Optional[torch.Tensor] = None
        self.context_lens: Optional[torch.Tensor] = None
        self.decode_index: Optional[torch.Tensor] = None  # [Bd * kv_heads * L] rows of the pool viewed [-1, D]
        self.decode_mask: Optional[torch.Tensor] = None  # additive [Bd, 1, 1, L] fp32 (over kv heads, group)
        self._mask_cast: Optional[torch.Tensor] = None  # decode_mask in the model's dtype
        self.decode_len = 0
        self.chunks: list[Chunk] = []
        self.compressed = None  # DeepSeek-V4's plan of the step (compressed_cache.StepPlan)
        self.runs: list[tuple[int, int, int]] = []  # (index of first chunk, chunks, n): plain chunks attended at once
        # per distinct window of the layers: its PLANNED attributes, planned once per step
        self._plans: dict[Optional[int], tuple] = {}
        self._sink_masks: dict[tuple, torch.Tensor] = {}

    def window_of(self, layer_id: int) -> Optional[int]:
        return self.window if self.windows is None else self.windows.get(layer_id)

    def _use_window(self, layer_id: int) -> None:
        """Point the planned attributes (PLANNED) at the plan of this layer's window."""
        window = self.window_of(layer_id)
        if window != self.window and window in self._plans:
            self._plans[self.window] = tuple(getattr(self, name) for name in PLANNED)
            self.window = window
            for name, value in zip(PLANNED, self._plans[window], strict=True):
                setattr(self, name, value)

    def slots_of(self, layer_id: int) -> torch.Tensor:
        """[T] the slots where layer ``layer_id`` stores the batch's keys and values (its window's block table)."""
        self._use_window(layer_id)
        return self.slots

    def _table(self, blocks, window: Optional[int]):
        """A sequence's block table for the layers of ``window``: under a split pool it gives (full, windowed)."""
        if not self.pool.windowed_layers:
            return blocks
        return blocks[0] if window is None else blocks[1]

    def plan(self, decodes: Sequence[tuple[Sequence[int], int]], chunks: Sequence[tuple[Sequence[int], int, int]],
             state_slots: Optional[Sequence[int]] = None, deferred: Sequence[int] = ()):
        """decodes: (block ids, position) of each one-token query; chunks: (block ids, start, n); state_slots: each
        one's slot in the state pool (decodes, then chunks; hybrid models); block ids are (full, windowed) pairs
        under a split pool, (window's, {rate: entry blocks}) pairs for DeepSeek-V4 (``deferred``: the state slots of
        its chunks that verify drafts, compressed_cache.plan_step). Returns the positions [1, T] of
        the flattened batch in that order."""
        if self.states is not None and self.states.compressed:  # DeepSeek-V4 plans its own step
            window = max(self.windows.values()) if self.windows is not None else self.window
            return compressed_cache.plan_step(self, decodes, chunks, state_slots, window, deferred)
        bs, dev = self.pool.block_size, self.pool.device
        if self.pool.latent and chunks and all(n <= ABSORB_ROWS for _, _, n in chunks):
            # short chunks (speculative verification, MTP drafting): each row attends to the latents like a decode
            # at its position, cheaper than expanding every earlier latent to per-head keys and values
            decodes = list(decodes) + [(blocks, p) for blocks, start, n in chunks for p in range(start, start + n)]
            chunks = []
        positions = [pos for _, pos in decodes] + [p for _, start, n in chunks for p in range(start, start + n)]
        self.num_decodes = len(decodes)
        # the kernel attends to every row at once, except a latent pool's chunks: those are expanded for SDPA
        plan_chunks = self.kernel is None or self.pool.latent
        windows = [self.window] if self.windows is None else sorted(set(self.windows.values()), key=str)
        tables = None
        for window in windows:
            self.window, self.chunks, self.runs, self.decode_mask, self._mask_cast = window, [], [], None, None
            if tables is None or self.pool.windowed_layers:  # one table for every window unless the pool is split
                tables = ([(self._table(b, window), pos) for b, pos in decodes],
                          [(self._table(b, window), start, n) for b, start, n in chunks])
                slots = [blocks[pos // bs] * bs + pos % bs for blocks, pos in tables[0]]
                seq_slots_of = []
                for blocks, start, n in tables[1]:
                    seq_slots_of.append(_slots(blocks, bs, start + n))
                    slots.extend(seq_slots_of[-1][start:])
                self.slots = torch.tensor(slots, dtype=torch.long, device=dev)
                if self.kernel is not None:
                    self._plan_kernel(*tables)
            offset = len(decodes)
            for (_, start, n), seq_slots in zip(chunks, seq_slots_of, strict=True):
                if plan_chunks:
                    self.chunks.append(self._chunk(offset, start, n, seq_slots))
                offset += n
            for i, c in enumerate(self.chunks):
                first, count, n = self.runs[-1] if self.runs else (0, 0, 0)
                if count and n == c.n and self._plain(c) and self._plain(self.chunks[first]):
                    self.runs[-1] = (first, count + 1, n)
                else:
                    self.runs.append((i, 1, c.n))
            if self.kernel is None and decodes:
                blocks = self.pool.windowed_blocks if window is not None and self.pool.windowed_layers else None
                self._plan_decodes(tables[0], blocks or self.pool.num_blocks)
            self._plans[window] = tuple(getattr(self, name) for name in PLANNED)
        if state_slots is not None:
            self._plan_states(len(decodes), [(start, n) for _, start, n in chunks], state_slots)
        return torch.tensor([positions], dtype=torch.long, device=dev)

    def _plan_states(self, num_decodes: int, chunks: Sequence[tuple[int, int]], state_slots: Sequence[int]) -> None:
        runs = [(0, num_decodes, 1, True, list(state_slots[:num_decodes]))] if num_decodes else []
        offset = num_decodes
        for (start, n), slot in zip(chunks, state_slots[num_decodes:], strict=True):
            last = runs[-1] if runs else None
            if start == 0 and last is not None and not last[3] and last[2] == n:
                runs[-1] = (last[0], last[1] + 1, n, False, last[4] + [slot])
            else:
                runs.append((offset, 1, n, start > 0, [slot]))
            offset += n
        dev = self.pool.device
        # a decode run whose slots follow one another updates its states in place, a slice of the pool (``first``)
        self.state_runs = [(*run[:4], torch.tensor(run[4], dtype=torch.long, device=dev),
                            run[4][0] if run[2] == 1 and run[4] == list(range(run[4][0], run[4][0] + run[1])) else None)
                           for run in runs]

    def _chunk(self, offset: int, start: int, n: int, seq_slots: list[int]) -> Chunk:
        dev = self.pool.device
        key_slots = None if start == 0 else torch.tensor(seq_slots, device=dev)
        mask = None
        if start > 0 or (self.window is not None and n > self.window):
            q_pos = torch.arange(start, start + n)[:, None]
            k_pos = torch.arange(start + n)[None] if start > 0 else torch.arange(n)[None]
            allowed = k_pos <= q_pos
            if self.window is not None:
                allowed &= q_pos - k_pos < self.window
            mask = torch.zeros(allowed.shape, dtype=self.pool.dtype).masked_fill_(~allowed, float("-inf")).to(dev)
        return Chunk(offset, start, n, key_slots, mask)

    def _plan_decodes(self, decodes, num_blocks: int) -> None:
        """``num_blocks``: how many blocks the pool's tensors of these decodes' layers hold."""
        bs, dev = self.pool.block_size, self.pool.device
        # keys padded to a multiple of 16 (masked): oneDNN builds a kernel per matmul shape (~1 ms in bf16), so a
        # length that grew by one every step would build two new ones every step; 16 keeps the padding small
        length = -(-(max(pos for _, pos in decodes) + 1) // KEY_BUCKET) * KEY_BUCKET
        nb = (length + bs - 1) // bs
        table = torch.tensor([list(b[:nb]) + [0] * (nb - len(b[:nb])) for b, _ in decodes], dtype=torch.long)
        key_slots = (table[:, :, None] * bs + torch.arange(bs)).view(len(decodes), -1)[:, :length]
        ctx = torch.tensor([pos for _, pos in decodes])
        keys = torch.arange(length)
        allowed = keys[None] <= ctx[:, None]
        if self.window is not None:
            allowed &= ctx[:, None] - keys[None] < self.window
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        self.decode_mask = mask[:, None, None].to(dev)
        self.decode_len = length
        # the pool viewed as rows [kv_heads * slots, D]: row h * slots + s holds kv head h of slot s, so one
        # index_select over dim 0 (a parallel copy of whole rows, unlike one over dim 1) gathers every decode's
        # keys straight into the [Bd, kv_heads, L, D] the matmuls read
        heads = torch.arange(self.pool.kv_heads)[None, :, None] * (num_blocks * bs)
        self.decode_index = (heads + key_slots[:, None, :]).reshape(-1).to(dev)

    def _plan_kernel(self, decodes, chunks) -> None:
        tables = [blocks for blocks, _ in decodes] + [blocks for blocks, _, _ in chunks]
        width = max(len(b) for b in tables)
        self.block_table = torch.tensor([list(b) + [0] * (width - len(b)) for b in tables], dtype=torch.int32)
        rows = list(range(len(decodes)))
        lens = [pos + 1 for _, pos in decodes]
        for i, (_, start, n) in enumerate(chunks, start=len(decodes)):
            rows.extend([i] * n)
            lens.extend(range(start + 1, start + n + 1))
        self.seq_of_row = torch.tensor(rows, dtype=torch.int32)
        self.context_lens = torch.tensor(lens, dtype=torch.int32)

    def advance(self, positions: torch.Tensor) -> None:
        """Called by the model once per forward; the step was planned already."""

    takes_sinks = True  # ``attend`` applies attention sinks (the model's layers ask before passing them)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [1, heads, T, D], k/v [1, kv_heads, T, D] -> attention output [1, heads, T, D]; ``sinks`` [heads]: a
        logit per head in every row's softmax denominator (GPT-OSS)."""
        heads, total, dim = q.shape[1], q.shape[2], q.shape[3]
        out = self.attend_flat(layer_id, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                               sinks=sinks)
        return out.view(total, heads, dim).transpose(0, 1)[None]

    def attend_compressed(self, layer, x: torch.Tensor, pos) -> torch.Tensor:
        """A DeepSeek-V4 attention layer (CompressedAttention) over its window's keys and its compressed entries:
        x [1, T, H] -> [1, T, H] (megapipe.inference.compressed_cache)."""
        return compressed_cache.attend(self, layer, x, pos)

    def attend_flat(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    stored: bool = False, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] (views of the projections are fine) -> [T, heads * D]: stores k/v
        in their slots (unless the caller has: ``stored``), then attends (with ``sinks`` [heads], see ``attend``).
        The token-major form the engine's decode path calls directly."""
        pk, pv = self.pool.k[layer_id], self.pool.v[layer_id]
        self._use_window(layer_id)
        if not stored:
            pk.index_copy_(1, self.slots, k.transpose(0, 1).to(pk.dtype))
            pv.index_copy_(1, self.slots, v.transpose(0, 1).to(pv.dtype))
        total, heads, dim = q.shape
        out = torch.empty(total, heads * dim, dtype=q.dtype, device=q.device)
        if self.kernel is not None:
            self.kernel(q, pk, pv, self.block_table, self.seq_of_row, self.context_lens, self.pool.block_size,
                        self.window_of(layer_id) or 0, dim ** -0.5, out, sinks)
            return out
        if self.num_decodes:
            bd = self.num_decodes
            keys_t, values = self._gather(pk).transpose(-1, -2), self._gather(pv)
            self._decode(q[:bd], keys_t, values, out[:bd].view(bd, pk.shape[0], -1, dim), dim ** -0.5, sinks)

        def keys_values(c: Chunk, rows: slice, count: int):
            if c.key_slots is None:
                return _as_batch(k[rows], count), _as_batch(v[rows], count)
            return pk.index_select(1, c.key_slots)[None], pv.index_select(1, c.key_slots)[None]

        self._attend_chunks(q, out.view(total, heads, dim), keys_values, sinks)
        return out

    def ssm(self, layer_id: int, mixer, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """A Mamba layer (``mixer``, megapipe.models.mamba) on the batch: xbc [1, T, C] and raw dt [1, T, heads]
        from its in-projections -> the SSM output [1, T, heads, head_dim]; each sequence continues from its state
        in the pool, which is updated."""
        conv, ssm = self.states.conv[layer_id], self.states.ssm[layer_id]
        parts = []
        for offset, count, n, resume, slots, first in self.state_runs:
            rows = slice(offset, offset + count * n)
            if resume and n == 1 and self.mamba_step is not None:  # decodes: their states updated in their slots
                y = xbc.new_empty(count, ssm.shape[1] * ssm.shape[2])
                self.mamba_step(xbc[0, rows], dt[0, rows], conv, ssm, slots, *mixer.step_params(), y)
                parts.append(y.view(1, count, ssm.shape[1], ssm.shape[2]))
                continue
            if resume and first is not None:
                y, _, _ = mixer.ssm(xbc[0, rows].reshape(count, 1, -1), dt[0, rows].reshape(count, 1, -1),
                                    conv[first:first + count], ssm[first:first + count], inplace=True)
                parts.append(y.reshape(1, count, *y.shape[2:]))
                continue
            start = (conv.index_select(0, slots), ssm.index_select(0, slots)) if resume else (None, None)
            y, conv_state, ssm_state = mixer.ssm(xbc[0, rows].reshape(count, n, -1), dt[0, rows].reshape(count, n, -1),
                                                 *start)
            conv.index_copy_(0, slots, conv_state.to(conv.dtype))
            ssm.index_copy_(0, slots, ssm_state)
            parts.append(y.reshape(1, count * n, *y.shape[2:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def attend_latent(self, attention, q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
                      index=None, index_keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Multi-latent attention over a latent pool for ``attention`` (the layer's MLAttention): q [1, heads, T, qk]
        (roped, the softmax scale folded in), c_kv [1, T, rank], k_rope [1, 1, T, rope] -> [1, heads, T, v]. Stores
        each token's [c_kv, k_rope] row; see the module docstring for how decodes and chunks attend. DeepSeek Sparse
        Attention: ``index`` (megapipe.models.dsa.IndexerQueries of the T rows) and ``index_keys`` [1, T, D], stored
        after the latent: each row attends to its top-k keys by the indexer's scores over its sequence's keys."""
        if not self.pool.latent:
            raise ValueError("attend_latent needs a latent KV pool (kv_layout of a multi-latent attention model)")
        layer = self.pool.k[attention.layer_id]
        rank = c_kv.shape[-1]
        width = rank + k_rope.shape[-1]  # what attention reads of a row; the indexer's key follows
        latents = torch.cat((c_kv[0], k_rope[0, 0]) + (() if index is None else (index_keys[0],)), dim=-1)
        layer.index_copy_(1, self.slots, latents[None].to(layer.dtype))
        q = q[0].transpose(0, 1)  # [T, heads, qk]
        total, heads, qk = q.shape
        scale = qk ** -0.5  # SDPA's default for the model's q/k width, as the model's forward assumes
        w_uk, w_uv = attention.kv_up_weights()
        out = torch.empty(total, heads, w_uv.shape[1], dtype=q.dtype, device=q.device)
        bd = self.num_decodes
        if bd:
            q_nope, q_rope = q[:bd].split([w_uk.shape[1], qk - w_uk.shape[1]], dim=-1)
            absorbed = torch.cat((torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_rope), dim=-1)
            attended = torch.empty(bd, heads, rank if self.kernel is None else latents.shape[-1], dtype=q.dtype,
                                   device=q.device)
            if self.kernel is not None:  # one kv head whose values are its keys: the output's first rank columns
                self.kernel(absorbed, layer, layer, self.block_table, self.seq_of_row[:bd], self.context_lens[:bd],
                            self.pool.block_size, 0, scale, attended.view(bd, -1))
            else:
                rows = self._gather(layer)  # [Bd, 1, L, rank + rope (+ index)]
                mask = None if index is None else self._decode_selection(index, rows[:, 0, :, width:])
                self._decode(absorbed, rows[..., :width].transpose(-1, -2), rows[..., :rank], attended[:, None], scale,
                             mask=mask)
            out[:bd] = torch.matmul(attended[..., :rank].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

        def keys_values(c: Chunk, rows: slice, count: int):
            if c.key_slots is None:
                cached = latents[rows].view(count, c.n, -1)
            else:
                cached = layer[0].index_select(0, c.key_slots)[None].to(q.dtype)
            return attention.expand(cached[..., :rank], cached[:, None, :, rank:width])

        def selection(c: Chunk, rows: slice, count: int) -> torch.Tensor:
            """The run's additive mask: its causal mask & each row's top-k keys by the indexer."""
            if c.key_slots is None:
                keys = latents[rows, width:].reshape(count, c.n, -1)
            else:
                keys = layer[0].index_select(0, c.key_slots)[None, :, width:]
            keep = torch.ones(c.n, c.n, dtype=torch.bool, device=q.device).tril() if c.mask is None else c.mask == 0
            part = _rows_of(index, rows, count)
            with torch.no_grad():
                return additive(part.select(keys, keep.expand(count, -1, -1))[:, None], q.dtype)

        self._attend_chunks(q, out, keys_values, chunk_mask=None if index is None else selection)
        return out.transpose(0, 1)[None]

    def _decode_selection(self, index, keys: torch.Tensor) -> torch.Tensor:
        """The decodes' additive mask [Bd, 1, 1, L] (fp32): the decode mask & each row's top-k keys by the indexer
        over its gathered keys [Bd, L, D]."""
        bd = self.num_decodes
        keep = self.decode_mask[:, 0] == 0  # [Bd, 1, L]
        with torch.no_grad():
            chosen = _rows_of(index, slice(0, bd), bd).select(keys, keep)
        return additive(chosen[:, None], torch.float32)

    def _attend_chunks(self, q: torch.Tensor, out: torch.Tensor, keys_values: Callable,
                       sinks: Optional[torch.Tensor] = None, chunk_mask: Optional[Callable] = None) -> None:
        """The chunks' rows of q [T, heads, D] with SDPA into out [T, heads, Dv]; ``keys_values(chunk, rows, count)``
        gives a run's keys and values [count (or 1 for a continuation), kv_heads, S, D / Dv]; with ``sinks``
        through ``sink_attention`` (its extra key every row sees); ``chunk_mask(chunk, rows, count)``: the run's
        additive mask [count, 1, n, S] in place of the causal one (DeepSeek Sparse Attention's selection)."""
        heads = q.shape[1]
        for first, count, n in self.runs:
            c = self.chunks[first]
            rows = slice(c.offset, c.offset + count * n)
            qc = _as_batch(q[rows], count)
            kc, vc = keys_values(c, rows, count)
            gqa = kc.shape[1] != heads
            if sinks is not None:
                o = sink_attention(qc, kc.expand(count, -1, -1, -1), vc.expand(count, -1, -1, -1), sinks,
                                   self._sink_mask(first, qc.dtype))
            elif chunk_mask is not None:
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=chunk_mask(c, rows, count), enable_gqa=gqa)
            elif c.mask is None:
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask.to(qc.dtype), enable_gqa=gqa)
            out[rows].view(count, n, heads, -1).copy_(o.transpose(1, 2))

    def _sink_mask(self, first: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask of chunk ``first`` with the sink key's column (``sink_attention``), made once per step
        for every sink layer of this window."""
        key = (self.window, first, dtype)
        if key not in self._sink_masks:
            c = self.chunks[first]
            keep = torch.ones(c.n, c.n, dtype=torch.bool).tril() if c.mask is None else c.mask == 0
            self._sink_masks[key] = additive(with_sink_column(keep), dtype).to(self.pool.device)
        return self._sink_masks[key]

    @staticmethod
    def _plain(c: Chunk) -> bool:
        return c.key_slots is None and c.mask is None

    def _gather(self, pool_layer: torch.Tensor) -> torch.Tensor:
        kvh, dim = pool_layer.shape[0], pool_layer.shape[2]
        rows = pool_layer.view(-1, dim).index_select(0, self.decode_index)
        return rows.view(self.num_decodes, kvh, self.decode_len, dim)

    def _decode(self, q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
                scale: float, sinks: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> None:
        """q [Bd, heads, D] one token per sequence, keys_t [Bd, kv_heads, D, L] (transposed), values [Bd, kv_heads,
        L, Dv] -> out [Bd, kv_heads, group, Dv]; the matmuls in the model's dtype, the softmax in fp32 (as HF's eager
        attention does); ``sinks`` [heads]: one more fp32 column in each row's softmax, dropped after it; ``mask``:
        an fp32 additive mask [Bd, 1, 1, L] in place of the decode mask."""
        bd, heads, dim = q.shape
        kvh = keys_t.shape[1]
        group = heads // kvh
        qg = q.reshape(bd, kvh, group, dim)  # head h reads kv head h // group, as SDPA's GQA
        fp32_mask = self.decode_mask if mask is None else mask
        if sinks is not None:
            scores = torch.matmul(qg, keys_t).float().mul_(scale).add_(fp32_mask)
            column = sinks.float().view(1, kvh, group, 1).expand(bd, -1, -1, -1)
            probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
        elif math.frexp(scale)[0] == 0.5:
            # a power of two: scaling q first is exact, and a 0 / -inf mask added in q's dtype is too, so this is
            # the same as scaling and masking the scores in fp32, with fewer passes over them
            scores = torch.matmul(qg * scale, keys_t).add_(self.decode_mask_as(q.dtype) if mask is None
                                                           else mask.to(q.dtype))
            probs = scores.softmax(dim=-1, dtype=torch.float32)
        else:
            scores = torch.matmul(qg, keys_t).float().mul_(scale).add_(fp32_mask)
            probs = scores.softmax(dim=-1)
        out.copy_(torch.matmul(probs.to(values.dtype), values))

    def decode_mask_as(self, dtype: torch.dtype) -> torch.Tensor:
        if self._mask_cast is None or self._mask_cast.dtype != dtype:
            self._mask_cast = self.decode_mask.to(dtype)
        return self._mask_cast


def _rows_of(index, rows: slice, count: int):
    """The indexer queries (megapipe.models.dsa.IndexerQueries) of the flattened batch's ``rows`` as ``count``
    sequences of equal length."""
    q, w = index.q[0, rows], index.weights[0, rows]
    return dataclasses.replace(index, q=q.reshape(count, -1, *q.shape[1:]), weights=w.reshape(count, -1, w.shape[-1]))
