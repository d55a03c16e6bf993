import pytest
import torch

from megapipe.inference.kv_cache import KVPool, PagedBatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_prompts_attended_together_equal_each_attended_alone(dtype):
    """Neighbouring whole prompts of one length go through SDPA as one batch: the same values bit for bit as one
    call per prompt, and other chunks (a continuation over cached keys, a different length) break the run."""
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    pool = KVPool(1, 32, bs, kv_heads, dim, dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    # (blocks, start, n): three prompts of 6, one continuation from position 4, two of 5
    chunks = [([1, 2], 0, 6), ([3, 4], 0, 6), ([5, 6], 0, 6), ([7, 8, 9], 4, 6), ([10, 11], 0, 5), ([12, 13], 0, 5)]
    total = sum(n for _, _, n in chunks)
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(total, kv_heads, dim, generator=g).to(dtype) for _ in range(2))

    together = PagedBatch(pool)
    together.plan([], chunks)
    assert together.runs == [(0, 3, 6), (3, 1, 6), (4, 2, 5)]
    out = together.attend_flat(0, q, k, v)
    offset = 0
    for blocks, start, n in chunks:
        alone = PagedBatch(pool)
        alone.plan([], [(blocks, start, n)])
        rows = slice(offset, offset + n)
        assert torch.equal(alone.attend_flat(0, q[rows], k[rows], v[rows]), out[rows])
        offset += n
