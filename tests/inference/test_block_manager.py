"""Block allocation and the prefix cache by hand: reference counts, chained hashes, LRU eviction, tail-first frees."""

from __future__ import annotations

import pytest

from megapipe.inference.block_manager import BlockManager, block_hash


def chain(*blocks):
    out, parent = [], None
    for tokens in blocks:
        parent = block_hash(parent, tokens)
        out.append(parent)
    return out


def test_hashes_chain_the_whole_prefix():
    a, b = chain([1, 2], [3, 4]), chain([9, 2], [3, 4])
    assert a[0] != b[0] and a[1] != b[1]  # the same block after a different prefix is a different block
    assert chain([1, 2], [3, 4]) == a


def test_refcounts_reuse_and_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=2)
    h = chain([1, 2], [3, 4])
    blocks = bm.allocate(2)
    for b, x in zip(blocks, h, strict=True):
        bm.register(b, x)
    assert bm.lookup(h) == blocks and bm.ref[blocks[0]] == 2  # a second user shares them
    bm.release(blocks)
    bm.release(blocks)
    assert bm.num_free() == 4 and bm.usage() == 0.0  # free, but still cached
    assert bm.lookup(h) == blocks
    bm.release(blocks)
    other = bm.allocate(2)  # never-cached blocks go first
    assert set(other).isdisjoint(blocks) and bm.lookup(h) == blocks
    bm.release(blocks)
    bm.release(other)
    # evictions take the least recently freed cached block: the tail (freed first), so the prefix survives longer
    bm.allocate(3)
    assert bm.lookup(h[:1]) == blocks[:1] and bm.lookup(h) == blocks[:1]
    with pytest.raises(RuntimeError, match="2 KV blocks asked for, 0 free"):
        bm.allocate(2)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=2, block_size=2, prefix_caching=False)
    (b,) = bm.allocate(1)
    bm.register(b, chain([1, 2])[0])
    assert bm.lookup(chain([1, 2])) == []
