"""Block allocation with prefix caching: reference counts, content hashes of full blocks, LRU eviction.

A full block is identified by a chained hash of its tokens and every token before it (sha256 of the parent's digest
and the block's ids), so two sequences with the same prefix map to the same blocks. A block whose last user leaves
stays cached (evictable) until a new allocation needs it; the least recently freed goes first, and a sequence
frees its blocks tail first so the shared prefix outlives its continuations.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Optional, Sequence


def block_hash(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref = [0] * num_blocks
        self.hash: list[Optional[bytes]] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # never hashed (or evicted): taken first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, least recently freed first
        self.cached: dict[bytes, int] = {}
        self.query_tokens = 0  # prefix-cache lookups, in tokens (vLLM's prefix_cache_queries)
        self.hit_tokens = 0

    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free() / self.num_blocks

    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free():
            raise RuntimeError(f"{count} KV blocks asked for, {self.num_free()} free")  # the scheduler checks first
        out = []
        for _ in range(count):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                del self.cached[self.hash[b]]
                self.hash[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes``; acquired (their references taken)."""
        hits = []
        if self.prefix_caching:
            for h in hashes:
                b = self.cached.get(h)
                if b is None:
                    break
                hits.append(b)
        self._acquire(hits)
        return hits

    def lookup_all(self, hashes: Sequence[bytes]) -> Optional[list[int]]:
        """The blocks holding every one of ``hashes``, acquired; None (nothing taken) when one is not cached."""
        hits = [self.cached.get(h) for h in hashes] if self.prefix_caching else [None]
        if None in hits:
            return None
        self._acquire(hits)
        return hits

    def _acquire(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """``block`` now holds the full block whose chained hash is ``h``."""
        if self.prefix_caching and self.hash[block] is None and h not in self.cached:
            self.cached[h] = block
            self.hash[block] = h

    def release(self, blocks: Sequence[int]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is not None:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def reset_prefix_cache(self) -> None:
        for b in list(self.evictable):
            del self.cached[self.hash[b]]
            self.hash[b] = None
            self.free.append(b)
        self.evictable.clear()
