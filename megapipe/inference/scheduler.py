"""Continuous batching: which tokens of which sequences the next engine step computes.

Every step is planned afresh under a token budget (``max_num_batched_tokens``):

1. running sequences that decode (one token each, plus ``lookahead(seq)`` draft tokens under speculative decoding)
   first, so a long prompt never stalls them; when the pool has no
   slot for one, the most recently admitted other sequence is preempted (its blocks freed, its tokens recomputed
   later: it goes back to the front of the queue with what it generated so far);
2. then running sequences whose prompt is still being prefilled, a chunk each of what budget and free blocks allow;
3. then waiting sequences, first come first served, while fewer than ``max_num_seqs`` run: a cached prefix
   (full blocks) is taken from the prefix cache, the rest is prefilled in chunks.

A sequence's state is its tokens (prompt + generated) and ``num_computed``, how many of them have keys/values in its
blocks; the step computes ``tokens[num_computed : num_computed + n]``. A hybrid model's sequences also hold a slot
of recurrent state (``states``, megapipe.inference.state_cache) from admission to finish or preemption; DeepSeek-V4's
sequences a slot of its compressors' carry and, per compression rate, blocks of compressed entries
(``entry_blocks``, megapipe.inference.compressed_cache), taken as the tokens they cover are computed. What a
sequence has output (text, log-probs, timings) is the engine's, not the scheduler's (megapipe.inference.engine).

``schedule()`` returns one :class:`SchedulerOutput`, which the runner executes (megapipe.inference.runner) and the
engine applies (``LLMEngine.update_from_output``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megapipe.inference.block_manager import BlockManager, block_hash
from megapipe.inference.compressed_cache import entry_blocks_for
from megapipe.inference.sampling import SamplingParams
from megapipe.inference.state_cache import StatePool

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Sequence:
    def __init__(self, seq_id: int, request, index: int, params: SamplingParams,
                 generator: Optional[torch.Generator]):
        self.seq_id, self.request, self.index = seq_id, request, index
        self.params, self.generator = params, generator
        self.tokens: list[int] = list(request.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.block_ids: list[int] = []
        self.num_evicted = 0  # leading block_ids behind the window, given back (their ids stay as placeholders)
        self.window_ids: list[int] = []  # the windowed layers' own block table (a model with full layers too)
        self.num_window_evicted = 0  # its leading blocks behind the window, given back
        self.hashes: list[bytes] = []  # chained hashes of the full blocks of tokens
        self.num_registered = 0  # blocks already offered to the prefix cache
        self.num_computed = 0
        self.num_cached = 0  # prompt tokens found in the prefix cache at first admission
        self.status = WAITING
        self.finish_reason: Optional[str] = None
        self.after: Optional[Sequence] = None  # a sibling whose prompt is computed first (then shared via the cache)
        self.matcher = None  # structured output: its grammar's Matcher (megapipe.inference.structured)
        self.preemptions = 0
        self.num_lookahead = 0  # draft tokens the current step verifies after its last token (speculative decoding)
        self.state_slot: Optional[int] = None  # its slot in the Mamba layers' state pool (hybrid models)
        self.entry_ids: dict[int, list[int]] = {}  # per compression rate: its entry blocks (DeepSeek-V4)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.num_computed

    def full_hashes(self, block_size: int) -> list[bytes]:
        while len(self.hashes) < len(self.tokens) // block_size:
            i = len(self.hashes)
            parent = self.hashes[-1] if i else getattr(self.request, "hash_seed", None)
            self.hashes.append(block_hash(parent, self.tokens[i * block_size:(i + 1) * block_size]))
        return self.hashes


@dataclass
class SchedulerOutput:
    """One step's plan. ``decodes`` compute their last token (``tokens[num_computed]``) and, under speculative
    decoding, up to ``seq.num_lookahead`` drafts after it; ``chunks`` compute ``n`` tokens of their prompt (or of
    their tokens again after a preemption), from ``num_computed``. ``new``: the sequences admitted this step (their
    first chunk is among ``chunks``); ``preempted``: those sent back to waiting; ``tables``: each scheduled
    sequence's block table(s), by seq_id (``Scheduler.table``), with blocks for its tokens allocated."""

    decodes: list[Sequence] = field(default_factory=list)
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    new: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    tables: dict = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.chunks

    @property
    def num_scheduled_tokens(self) -> dict[int, int]:
        """seq_id -> tokens (at most) the step computes for it: 1 + lookahead per decode, n per chunk."""
        out = {s.seq_id: 1 + s.num_lookahead for s in self.decodes}
        out.update((s.seq_id, n) for s, n in self.chunks)
        return out

    @property
    def continuing(self) -> list[Sequence]:
        """Scheduled sequences that were running before this step."""
        new = {s.seq_id for s in self.new}
        return list(self.decodes) + [s for s, _ in self.chunks if s.seq_id not in new]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: Optional[Callable[[Sequence], int]] = None, states: Optional[StatePool] = None,
                 window: Optional[int] = None, window_blocks: Optional[BlockManager] = None,
                 admit: Optional[Callable[[Sequence], bool]] = None,
                 entry_blocks: Optional[dict[int, BlockManager]] = None):
        """``window``: every layer attends at most this many positions back, so the blocks wholly behind it are
        given back as a sequence advances (its KV memory stays about one window). With ``window_blocks``, only the
        windowed layers do (a model with full-attention layers too, GPT-OSS): those layers have their own block table
        (``seq.window_ids``, blocks of ``window_blocks``) whose blocks behind the window are given back, while
        ``seq.block_ids`` (the full layers') keep every block. ``admit(seq)``: whether the next waiting sequence may
        start now (its LoRA adapter resident); admission stops at the first that may not. ``entry_blocks``: per
        compression rate r, the blocks of a DeepSeek-V4 model's compressed entries (``block_size`` entries, one per r
        tokens, each; ``seq.entry_ids[r]``), held until the sequence finishes or is preempted."""
        self.blocks, self.lookahead, self.window, self.window_blocks = blocks, lookahead, window, window_blocks
        self.entry_blocks = entry_blocks or {}
        self.admit = admit
        self.states = states if states else None  # an empty pool (no Mamba layers): no slots to hand out
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._deferred: set[int] = set()  # seq_ids passed over for want of an adapter slot when last admitting
        self._preempted: list[Sequence] = []  # this step's, for its SchedulerOutput

    def num_deferred(self) -> int:
        """Waiting sequences the last admission passed over for want of an adapter slot (vLLM's deferred ones)."""
        return sum(1 for s in self.waiting if s.seq_id in self._deferred) if self._deferred else 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: Optional[str]) -> None:
        """Take ``seq`` out (finished or aborted) and return its blocks."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status, seq.finish_reason = FINISHED, reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)  # its recurrent state too: recomputed from its tokens with its keys and values
        seq.num_computed, seq.num_registered = 0, 0
        seq.status = WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self._preempted.append(seq)
        self.waiting.appendleft(seq)

    def table(self, seq: Sequence):
        """The block table(s) the runner reads ``seq``'s keys and values through: (full layers', windowed layers')
        under ``window_blocks``, (every layer's, {rate: entry blocks}) under ``entry_blocks``, else the one of every
        layer."""
        if self.entry_blocks:
            return seq.block_ids, seq.entry_ids
        return seq.block_ids if self.window_blocks is None else (seq.block_ids, seq.window_ids)

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_ids[seq.num_evicted:])
        if self.window_blocks is not None:
            self.window_blocks.release(seq.window_ids[seq.num_window_evicted:])
        for rate, ids in seq.entry_ids.items():
            self.entry_blocks[rate].release(ids)
        seq.block_ids, seq.num_evicted, seq.window_ids, seq.num_window_evicted = [], 0, [], 0
        seq.entry_ids = {}
        if self.states is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None

    def _evict(self, seq: Sequence) -> None:
        """Give back the blocks no later query reaches: a query at position p >= num_computed sees keys after
        p - window. Only blocks already offered to the prefix cache, so a shared prefix stays cached. Their ids stay
        in the block table (read only under the window's mask, never written)."""
        behind = (seq.num_computed - self.window + 1) // self.blocks.block_size
        if self.window_blocks is None:
            seq.num_evicted = self._give_back(self.blocks, seq.block_ids, seq.num_evicted, behind, seq)
        else:
            seq.num_window_evicted = self._give_back(self.window_blocks, seq.window_ids, seq.num_window_evicted,
                                                     behind, seq)

    @staticmethod
    def _give_back(blocks: BlockManager, ids: list[int], evicted: int, behind: int, seq: Sequence) -> int:
        upto = min(behind, seq.num_registered, len(ids))
        if upto <= evicted:
            return evicted
        blocks.release(ids[evicted:upto])
        return upto

    def _fit(self, seq: Sequence, n: int) -> int:
        """How many of n tokens the blocks it holds plus the free ones can take (in each block table)."""
        bs = self.blocks.block_size
        capacity = (len(seq.block_ids) + self.blocks.num_free()) * bs - seq.num_computed
        if self.window_blocks is not None:
            capacity = min(capacity, (len(seq.window_ids) + self.window_blocks.num_free()) * bs - seq.num_computed)
        for rate, blocks in self.entry_blocks.items():  # up to the token before the first entry with no block
            entries = (len(seq.entry_ids.get(rate, ())) + blocks.num_free()) * blocks.block_size
            capacity = min(capacity, (entries + 1) * rate - 1 - seq.num_computed)
        return min(n, capacity)

    def _grow(self, seq: Sequence, n: int) -> None:
        need = -(-(seq.num_computed + n) // self.blocks.block_size)
        seq.block_ids.extend(self.blocks.allocate(max(0, need - len(seq.block_ids))))
        if self.window_blocks is not None:
            seq.window_ids.extend(self.window_blocks.allocate(max(0, need - len(seq.window_ids))))
        for rate, blocks in self.entry_blocks.items():
            ids = seq.entry_ids.setdefault(rate, [])
            ids.extend(blocks.allocate(max(0, entry_blocks_for(seq.num_computed + n, rate, blocks.block_size)
                                           - len(ids))))

    def _make_room(self, seq: Sequence, n: int, scheduled: set) -> bool:
        """Preempt unscheduled running sequences (latest admitted first) until n tokens of seq fit; False when seq
        itself had to go."""
        while self._fit(seq, n) < n:
            victims = [s for s in self.running if s is not seq and s.seq_id not in scheduled]
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(victims[-1])
        return True

    def schedule(self) -> SchedulerOutput:
        """The next step's plan; blocks for its tokens are allocated."""
        self._preempted = []
        out = self._plan()
        out.preempted = self._preempted
        out.tables = {s.seq_id: self.table(s) for s in out.decodes}
        out.tables.update((s.seq_id, self.table(s)) for s, _ in out.chunks)
        return out

    def _plan(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        out = SchedulerOutput()
        decodes, chunks = out.decodes, out.chunks
        scheduled: set[int] = set()
        if self.window is not None:
            for seq in self.running:
                self._evict(seq)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != RUNNING or seq.remaining != 1:
                continue
            width = min(budget, 1 + (self.lookahead(seq) if self.lookahead else 0))
            if self._make_room(seq, width, scheduled):
                self._grow(seq, width)
                seq.num_lookahead = width - 1
                decodes.append(seq)
                scheduled.add(seq.seq_id)
                budget -= width
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != RUNNING or seq.remaining <= 1 or seq.seq_id in scheduled:
                continue
            n = self._fit(seq, min(seq.remaining, budget))
            if n <= 0:
                if not self._make_room(seq, min(seq.remaining, budget, self.blocks.block_size), scheduled):
                    continue
                n = self._fit(seq, min(seq.remaining, budget))
            self._grow(seq, n)
            chunks.append((seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        if self._preempted:
            return out  # the pool is short: admit nobody this step
        skipped: list[Sequence] = []
        try:
            self._admit_waiting(out, budget, scheduled, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))  # they keep their places at the head of the queue
            self._deferred = {s.seq_id for s in skipped}
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, scheduled: set, skipped: list) -> None:
        """Start waiting sequences in order while the budget, the seats and the pool allow. One whose LoRA adapter
        can get no slot now (``admit``) is passed over, not waited for, as vLLM's scheduler does: the others go
        ahead (into ``skipped``, which the caller puts back in front)."""
        chunks = out.chunks
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.admit is not None and not self.admit(seq):
                skipped.append(self.waiting.popleft())
                continue
            first = seq.after
            if first is not None and first.status != FINISHED and first.num_computed < first.prompt_len:
                break  # its sibling's prompt blocks will be cached in a moment: wait for them
            if seq.num_computed == 0 and not seq.block_ids:
                self._cached_prefix(seq)
            n = self._fit(seq, min(seq.remaining, budget))
            if n <= 0:
                self._release(seq)  # the cached prefix's blocks
                seq.num_computed = 0
                break
            self.waiting.popleft()
            if seq.preemptions == 0:  # recomputing after a preemption is not a prefix-cache query
                self.blocks.query_tokens += seq.prompt_len
                self.blocks.hit_tokens += seq.num_cached
            self._grow(seq, n)
            if self.states is not None:
                seq.state_slot = self.states.allocate()
            seq.status = RUNNING
            self.running.append(seq)
            chunks.append((seq, n))
            out.new.append(seq)
            scheduled.add(seq.seq_id)
            budget -= n

    def _cached_prefix(self, seq: Sequence) -> None:
        """Take the longest cached prefix of ``seq``'s full blocks (under ``window_blocks``, one whose last window
        the windowed layers still cache: ``_window_prefix``)."""
        bs = self.blocks.block_size
        if seq.params.prompt_logprobs is not None:  # every prompt position's logits are needed
            return
        usable = (len(seq.tokens) - 1) // bs  # the last token is always computed: its logits give the next one
        hashes = seq.full_hashes(bs)[:usable]
        hits = self.blocks.lookup(hashes)
        if self.window_blocks is not None:
            hits, seq.window_ids, seq.num_window_evicted = self._window_prefix(hashes, hits)
        seq.block_ids = list(hits)
        seq.num_computed = seq.num_registered = len(hits) * bs
        if seq.preemptions == 0:
            seq.num_cached = seq.num_computed

    def _window_prefix(self, hashes: list[bytes], hits: list[int]) -> tuple[list[int], list[int], int]:
        """The longest prefix of the full layers' ``hits`` whose blocks within the window of its end the windowed
        pool still caches (the only ones a query after it reads there): (those hits, the windowed table, its
        leading placeholders: the blocks behind the window, never read unmasked). The rest is released."""
        bs, window = self.blocks.block_size, self.window
        for n in range(len(hits), 0, -1):
            first = 0 if window is None else min(max(0, (n * bs - window + 1) // bs), n - 1)
            tail = self.window_blocks.lookup_all(hashes[first:n])
            if tail is not None:
                self.blocks.release(hits[n:])
                return hits[:n], [tail[0]] * first + tail, first
        self.blocks.release(hits)
        return [], [], 0

    def rollback(self, seq: Sequence) -> None:
        """Return the blocks past the sequence's computed tokens (allocated for drafts that were rejected)."""
        keep = -(-seq.num_computed // self.blocks.block_size)
        if len(seq.block_ids) > keep:
            self.blocks.release(seq.block_ids[keep:])
            del seq.block_ids[keep:]
        if len(seq.window_ids) > keep:
            self.window_blocks.release(seq.window_ids[keep:])
            del seq.window_ids[keep:]
        for rate, ids in seq.entry_ids.items():
            keep = entry_blocks_for(seq.num_computed, rate, self.entry_blocks[rate].block_size)
            self.entry_blocks[rate].release(ids[keep:])
            del ids[keep:]

    def register_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly completed full blocks to the prefix cache."""
        bs = self.blocks.block_size
        full = seq.num_computed // bs
        if full > seq.num_registered:
            hashes = seq.full_hashes(bs)
            for j in range(seq.num_registered, full):
                self.blocks.register(seq.block_ids[j], hashes[j])
                if self.window_blocks is not None:
                    self.window_blocks.register(seq.window_ids[j], hashes[j])
            seq.num_registered = full


def now() -> float:
    return time.monotonic()
