"""megapipe's CPU kernels (megapipe/inference/csrc): the paged decode attention is exact attention over scattered
blocks, the layer ops round as the torch operations they replace, the engine gives the torch path's results with
them, and falls back cleanly where they cannot be built."""

import logging
import random
import re
import time

import pytest
import torch

from megapipe.errors import ConfigError
from megapipe.inference import LLMEngine, SamplingParams, kernels
from megapipe.inference import runner as runner_module
from megapipe.inference.kv_cache import KVPool, PagedBatch
from megapipe.inference.runner import ExtraInputs, PackedLinear, repack, rope_
from megapipe.models.norms import RMSNorm
from megapipe.models.rope import inv_frequencies, rope_cos_sin
from tests.helpers.hf_tiny import make_hf_dir
from tests.inference.test_engine import GREEDY, PROMPTS, run_staggered


@pytest.fixture(scope="module")
def ops():
    found = kernels.ops()
    if found is None:
        pytest.skip("megapipe's CPU kernels cannot be built here (see the warning in the log)")
    return found


@pytest.fixture(scope="module")
def op(ops):
    return ops.paged_attention


def scattered_decodes(pool: KVPool, lengths, seed: int):
    """A block table per sequence drawn at random from the whole pool (no two sequences share a block)."""
    rng = random.Random(seed)
    free = list(range(pool.num_blocks - 1))  # the last block stays spare (attend_decodes writes there)
    rng.shuffle(free)
    return [([free.pop() for _ in range(-(-n // pool.block_size))], n - 1) for n in lengths]


def exact_attention(pool: KVPool, decodes, q: torch.Tensor, window):
    """fp64 softmax(q k^T / sqrt(d)) v of each row (block ids, position) over positions [0, position] of its
    sequence (the last ``window`` of them), [rows, heads * D]."""
    bs, kvh, dim = pool.block_size, pool.kv_heads, pool.head_dim
    group = q.shape[1] // kvh
    rows = []
    for b, (blocks, pos) in enumerate(decodes):
        first = 0 if window is None else max(0, pos + 1 - window)
        slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(first, pos + 1)])
        k, v = pool.k[0][:, slots].double(), pool.v[0][:, slots].double()
        qg = q[b].double().view(kvh, group, dim)
        probs = (torch.einsum("hgd,htd->hgt", qg, k) * dim ** -0.5).softmax(-1)
        rows.append(torch.einsum("hgt,htd->hgd", probs, v).reshape(-1))
    return torch.stack(rows)


def attend_decodes(pool, decodes, q, window, kernel):
    batch = PagedBatch(pool, window, kernel)
    batch.plan(decodes, [])
    k = v = torch.zeros(len(decodes), pool.kv_heads, pool.head_dim, dtype=pool.dtype)
    batch.slots = torch.full((len(decodes),), pool.num_blocks * pool.block_size - 1)  # a spare slot, not attended
    return batch.attend_flat(0, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,heads,kv_heads,window", [(16, 4, 2, None), (64, 9, 3, None), (128, 8, 8, None),
                                                       (64, 6, 2, 7), (576, 4, 1, None)])
def test_paged_attention_is_exact_attention_over_scattered_blocks(op, dtype, dim, heads, kv_heads, window):
    """Keys in blocks spread over the pool, lengths from 1 to several blocks (one ending exactly on a block edge),
    q a strided view of a fused projection as the engine passes it: within one rounding of the fp64 result; in
    bf16 / fp16 at least as close as the torch path (which rounds the scores and probabilities to that dtype)."""
    bs = 16
    pool = KVPool(1, 64, bs, kv_heads, dim, dtype, "cpu")
    g = torch.Generator().manual_seed(dim + heads)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    decodes = scattered_decodes(pool, [1, 5, 16, 17, 40, 93], seed=dim)
    fused = torch.randn(len(decodes), (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q = fused[:, :heads * dim].view(len(decodes), heads, dim)
    assert not q.is_contiguous()

    want = exact_attention(pool, decodes, q, window)
    got = attend_decodes(pool, decodes, q, window, op)
    torch_path = attend_decodes(pool, decodes, q, window, None)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(torch_path.double(), want, atol=4 * tol, rtol=4 * tol)
    if dtype != torch.float32:
        assert (got.double() - want).abs().max() <= (torch_path.double() - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_serves_a_mixed_step_of_decodes_and_prefill_chunks(op, dtype, window):
    """One call for the whole step: decodes, two whole prompts of one length (a run the torch path batches), a
    chunk continuing over cached keys, a prompt of another length. Each chunk row is causal from its own position;
    the chunks' own keys are stored before they are read. Exact within a rounding, and the torch path's values."""
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    pool = KVPool(1, 64, bs, kv_heads, dim, dtype, "cpu")
    g = torch.Generator().manual_seed(7)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    seqs = scattered_decodes(pool, [9, 14, 7, 7, 13, 5], seed=8)
    decodes = seqs[:2]
    chunks = [(seqs[2][0], 0, 7), (seqs[3][0], 0, 7), (seqs[4][0], 8, 5), (seqs[5][0], 0, 5)]
    rows = decodes + [(blocks, start + i) for blocks, start, n in chunks for i in range(n)]
    total = len(rows)
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(total, kv_heads, dim, generator=g).to(dtype) for _ in range(2))

    outs = []
    for kernel in (op, None):
        batch = PagedBatch(pool, window, kernel)
        batch.plan(decodes, chunks)
        outs.append(batch.attend_flat(0, q, k, v))
    want = exact_attention(pool, rows, q, window)  # the pool now holds the step's keys too
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8}[dtype]
    torch.testing.assert_close(outs[0].double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(outs[0].double(), outs[1].double(), atol=4 * tol, rtol=4 * tol)


def chunked_step(dtype, dim, heads, kv_heads, pool_blocks, chunk_rows, seed, scatter_seed):
    """One step over a pool of scattered blocks of 16: a chunk of ``chunk_rows`` rows over 20 cached keys, a
    one-row chunk at position 8 and a decode at 30; (pool, decodes, chunks, rows, q, k, v, the generator)."""
    pool = KVPool(1, pool_blocks, 16, kv_heads, dim, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    seqs = scattered_decodes(pool, [20 + chunk_rows, 9, 30], seed=scatter_seed)
    decodes = seqs[2:]
    chunks = [(seqs[0][0], 20, chunk_rows), (seqs[1][0], 8, 1)]
    rows = decodes + [(blocks, start + i) for blocks, start, n in chunks for i in range(n)]
    q = torch.randn(len(rows), heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(len(rows), kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    return pool, decodes, chunks, rows, q, k, v, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,window", [(9, 3, None), (9, 3, 11), (16, 1, None), (4, 4, 5)])
def test_paged_attention_on_long_prefill_chunks_in_runs_of_rows(op, dtype, heads, kv_heads, window):
    """A prefill chunk's rows go through the kernel in runs that fill its vector lanes with (row, head) pairs
    (5 rows of 3 heads, 16 rows of one; with 16 heads per kv head one row at a time): a 45-row chunk over 20 cached
    keys, a one-row chunk and a decode in one step, with and without a sliding window. Exact within a rounding."""
    pool, decodes, chunks, rows, q, k, v, _ = chunked_step(dtype, 64, heads, kv_heads, 16, 45, heads + kv_heads, heads)
    batch = PagedBatch(pool, window, op)
    batch.plan(decodes, chunks)
    got = batch.attend_flat(0, q, k, v)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
    torch.testing.assert_close(got.double(), exact_attention(pool, rows, q, window), atol=tol, rtol=tol)


@pytest.mark.skipif(not (kernels.has_amx() and kernels.has_avx512_bf16()),
                    reason="the kernels are built without AMX tiles (they need AMX and AVX512-BF16 at torch's capability)")
@pytest.mark.parametrize("dim,heads,kv_heads,window,sinks", [(64, 9, 3, None, False), (64, 9, 3, 11, False),
                                                             (128, 4, 4, None, True), (32, 2, 1, 70, False),
                                                             (64, 8, 1, None, True)])
def test_prefill_attention_on_amx_tiles_is_the_fp32_loops_within_a_rounding(op, dim, heads, kv_heads, window, sinks):
    """Where the CPU has AMX a bf16 prefill chunk's rows go in runs of up to 64 (a 100-row chunk over 20 cached
    keys: 64 + 36, whose last 16-row block has 4), their scores and weighted values on tiles, the probabilities
    in two bf16 parts: within a bf16 rounding of exact attention as the fp32 loop (amx=False) is, at most one bf16
    step from the loop's outputs and nearly all equal to them; sliding windows, attention sinks, head dims of one
    to four 32-dim steps, and a one-row chunk and a decode beside them in the step."""
    bs = 16
    pool, decodes, chunks, rows, q, k, v, g = chunked_step(torch.bfloat16, dim, heads, kv_heads, 24, 100, dim + heads,
                                                           dim)
    sink = torch.randn(heads, generator=g) if sinks else None
    outs = []
    for amx in (True, False):
        batch = PagedBatch(pool, window, lambda *args, amx=amx: op(*args[:-1], sink, amx=amx))
        batch.plan(decodes, chunks)
        outs.append(batch.attend_flat(0, q, k, v).double())
    tiles, loop = outs
    want = exact_attention(pool, rows, q, window)
    if sinks:  # the sink's logit joins each row's softmax denominator
        want = want.view(len(rows), heads, dim)
        for r, (blocks, pos) in enumerate(rows):
            first = 0 if window is None else max(0, pos + 1 - window)
            slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(first, pos + 1)])
            scores = torch.einsum("hd,htd->ht", q[r].double().view(heads, dim),
                                  pool.k[0][:, slots].double().repeat_interleave(heads // kv_heads, 0)) * dim ** -0.5
            top = torch.maximum(scores.max(-1).values, sink.double())
            kept = torch.exp(scores - top[:, None]).sum(-1)
            want[r] *= (kept / (kept + torch.exp(sink.double() - top)))[:, None]
        want = want.reshape(len(rows), -1)
    torch.testing.assert_close(tiles, want, atol=2 ** -8, rtol=2 ** -8)
    torch.testing.assert_close(loop, want, atol=2 ** -8, rtol=2 ** -8)
    # one bf16 step of the larger, or near zero (where a row's weighted values cancel) 2^-17: the weights' ~16 bits
    # times values of size ~1
    step = 2.0 ** (torch.floor(torch.log2(torch.maximum(tiles.abs(), loop.abs()).clamp_min(2 ** -126))) - 7)
    assert ((tiles - loop).abs() <= step.clamp_min(2 ** -17)).all()
    assert (tiles != loop).double().mean() < 0.02
    assert not torch.equal(tiles, loop)  # the tiles did run: their sums are not the loop's to the last bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(9, 3, None), (9, 3, 4), (4, 1, None), (16, 1, None)])
def test_a_prompt_rows_attention_does_not_depend_on_where_its_chunk_starts(op, dtype, heads, kv_heads, window):
    """A prompt's rows computed in one chunk from position 0, or in a chunk starting later over cached keys (a
    prefix-cache hit, chunked prefill), give bit-identical outputs: a row's result does not depend on how its
    chunk splits into runs of rows (5 rows of 3 heads, 4 of 4; 16 heads per kv head: one row at a time). In fp32
    every bit of the sums shows; bf16 rounds most differences away, and a few flip a greedy token."""
    dim, bs, length = 64, 16, 23
    pool = KVPool(1, 8, bs, kv_heads, dim, dtype, "cpu")
    g = torch.Generator().manual_seed(heads)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    table = torch.tensor([[3, 0]], dtype=torch.int32)
    q = torch.randn(length, heads, dim, generator=g).to(dtype)

    def chunk(start: int) -> torch.Tensor:
        rows = length - start
        out = torch.empty(rows, heads * dim, dtype=dtype)
        op(q[start:], pool.k[0], pool.v[0], table, torch.zeros(rows, dtype=torch.int32),
           torch.arange(start + 1, length + 1, dtype=torch.int32), bs, window or 0, dim ** -0.5, out)
        return out

    whole = chunk(0)
    for start in range(1, length - 1):  # chunks of 22 .. 2 rows: every remainder of the runs
        assert torch.equal(chunk(start), whole[start:]), start


def test_a_killed_builds_lock_file_does_not_hang_the_next_engine(ops):
    """torch waits forever on the ``lock`` file a killed build leaves; megapipe's flock says it is stale."""
    import subprocess
    import sys

    lock = kernels.build_directory(kernels._build_spec()[0]) / "lock"
    lock.touch()
    try:  # without the flock this hangs until the timeout
        out = subprocess.run([sys.executable, "-c", "from megapipe.inference import kernels; print(kernels.ops())"],
                             capture_output=True, text=True, timeout=120)
        left = lock.exists()
    finally:
        lock.unlink(missing_ok=True)
    # (another test process loading the kernels meanwhile may be the one that removes it, with the warning)
    assert "torch.ops.megapipe" in out.stdout and not left, out.stderr


def test_paged_attention_refuses_a_block_table_that_reads_outside_the_pool(op):
    pool = KVPool(1, 4, 16, 1, 16, torch.float32, "cpu")
    q, out = torch.zeros(1, 1, 16), torch.empty(1, 16)
    rows, lens = torch.zeros(1, dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="row 0 reads block 4 outside the pool"):
        op(q, pool.k[0], pool.v[0], torch.tensor([[0, 4]], dtype=torch.int32), rows, lens, 16, 0, 0.25, out)
    with pytest.raises(RuntimeError, match="row 0 attends to 20 positions, more than its block table holds"):
        op(q, pool.k[0], pool.v[0], torch.tensor([[0]], dtype=torch.int32), rows, lens, 16, 0, 0.25, out)


def test_paged_attention_does_not_depend_on_the_thread_count(op):
    pool = KVPool(1, 32, 16, 2, 64, torch.bfloat16, "cpu")
    pool.k[0].normal_(generator=torch.Generator().manual_seed(1))
    pool.v[0].normal_(generator=torch.Generator().manual_seed(2))
    decodes = scattered_decodes(pool, [3, 30, 64, 100], seed=3)
    q = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend_decodes(pool, decodes, q, None, op)
        torch.set_num_threads(2)
        two = attend_decodes(pool, decodes, q, None, op)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [32, 64, 128, 48])
def test_rope_and_cache_rounds_as_the_torch_ops_it_replaces(ops, dtype, dim):
    """Bit for bit: the rotary embedding on the q and k heads of a fused projection (a strided [T, 3 parts] row),
    and k and v stored at their slots, for several head sizes."""
    tokens, nq, nk = 7, 6, 2
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, (nq + 2 * nk) * dim, generator=g).to(dtype)
    positions = torch.tensor([[0, 1, 2, 40, 41, 300, 7]])
    cos, sin = (t[0, 0] for t in rope_cos_sin(positions, inv_frequencies(dim, 10000.0, None, "cpu"), dtype))
    slots = torch.tensor([3, 9, 4, 60, 61, 0, 33])
    pools = [KVPool(1, 4, 16, nk, dim, dtype, "cpu") for _ in range(2)]

    want = qkv.clone()
    rope_(want[:, :(nq + nk) * dim].view(tokens, nq + nk, dim), cos[:, None], sin[:, None])
    parts = want.view(tokens, nq + 2 * nk, dim)
    pools[0].k[0].index_copy_(1, slots, parts[:, nq:nq + nk].transpose(0, 1))
    pools[0].v[0].index_copy_(1, slots, parts[:, nq + nk:].transpose(0, 1))
    got = qkv.clone()
    ops.rope_and_cache(got, cos, sin, pools[1].k[0], pools[1].v[0], slots, nq, nk)
    assert torch.equal(got, want)
    assert torch.equal(pools[1].k[0], pools[0].k[0]) and torch.equal(pools[1].v[0], pools[0].v[0])
    with pytest.raises(RuntimeError, match="slot 64 is outside the pool"):
        ops.rope_and_cache(got, cos, sin, pools[1].k[0], pools[1].v[0], torch.full((tokens,), 64), nq, nk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [576, 100])
def test_rms_norm_and_the_fused_residual_add_match_the_module(ops, dtype, width):
    """RMSNorm's value within an ulp (the squares summed in another order), the residual add exactly add_'s; a
    width of whole 16-lane groups and one with a tail."""
    g = torch.Generator().manual_seed(6)
    norm = RMSNorm(width, eps=1e-5).to(dtype)
    norm.weight.data.copy_(torch.rand(width, generator=g) + 0.5)
    h = (3 * torch.randn(37, width, generator=g)).to(dtype)
    delta = torch.randn(37, width, generator=g).to(dtype)
    ulp = {torch.float32: 2 ** -22, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9}[dtype]

    out = torch.empty_like(h)
    ops.rms_norm(h, norm.weight.data, norm.eps, out)
    want = norm(h)
    torch.testing.assert_close(out, want, rtol=ulp, atol=1e-6)
    if dtype != torch.float32:  # an ulp of the fp32 variance rarely moves a value rounded to bf16 / fp16
        assert (out == want).float().mean() > 0.99

    summed, out = h.clone(), torch.empty_like(h)
    ops.add_rms_norm(summed, delta, norm.weight.data, norm.eps, out)
    assert torch.equal(summed, h.clone().add_(delta))
    torch.testing.assert_close(out, norm(summed), rtol=ulp, atol=1e-6)


@pytest.fixture(scope="module")
def bf16_linear(ops):
    if not kernels.bf16_linear_built():
        pytest.skip("this CPU has no AVX512-BF16: bf16 linears stay on oneDNN")
    return ops.linear_bf16


def check_extra_inputs(lin, w, b, extra, x, x2, other, **tol):
    """``lin`` (on megapipe's kernel, weight w, bias b) extended by extra's input columns: with x2 their values,
    the product is [x | x2] [w | extra]^T + b, with SiLU and the product with other in the epilogue; without x2 it is
    the layer's own, also after a repack (which keeps the extra columns); the weight reads back as it was."""
    lin.extend(extra.shape[1])
    lin.set_extra_inputs(extra)

    def exact(weight):
        return torch.cat([x, x2], 1).double() @ torch.cat([weight, extra], 1).double().t() + b.double()

    both = exact(w)
    extra_inputs = ExtraInputs(x2)
    for got, want in ((lin(x, extra=extra_inputs), both), (lin(x, "swish", extra_inputs), both * both.sigmoid()),
                      (lin.times(x, other, extra_inputs), both * other.double()),
                      (lin(x), x.double() @ w.double().t() + b.double())):
        assert got.shape == other.shape
        torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(lin.dense(), w)
    repack(lin, w.flip(0), b)
    torch.testing.assert_close(lin(x, extra=extra_inputs).double(), exact(w.flip(0)), **tol)


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 40, 64), (5, 200, 576), (70, 1536, 576), (9, 576, 1536)])
def test_bf16_linear_matches_onednn_and_the_exact_product(bf16_linear, m, n, k):
    """Row blocks and weight tiles with remainders (n = 40: a part tile; 200: groups of tiles and single ones),
    bias, SiLU and a product in the epilogue: within a rounding of the fp32 result, and (nearly always bit for
    bit) oneDNN's packed matmul, which makes the same vdpbf16ps products."""
    g = torch.Generator().manual_seed(m + n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    other = torch.randn(m, n, generator=g).bfloat16()
    mine, onednn = PackedLinear(w, b, own=True), PackedLinear(w, b, own=False)
    assert mine.own and mine.packed.shape == (-(-n // 16), k // 2, 16, 2)
    exact = x.double() @ w.double().t() + b.double()
    cases = [(lambda lin: lin(x), exact), (lambda lin: lin(x, "swish"), exact * exact.sigmoid()),
             (lambda lin: lin.times(x, other), exact * other.double())]
    for run, want in cases:
        got, theirs = run(mine), run(onednn)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-2)
        assert (got == theirs).float().mean() > 0.99
    extra = (torch.randn(n, 32, generator=g) * 0.05).bfloat16()  # 32 more inputs: x2 (LoRA's low-rank sums)
    x2 = torch.randn(m, 32, generator=g).bfloat16()
    check_extra_inputs(mine, w, b, extra, x, x2, other, rtol=2 ** -7, atol=1e-2)
    no_bias = PackedLinear(w, None, own=True)
    torch.testing.assert_close(no_bias(x[None]).double(), (exact - b.double())[None], rtol=2 ** -7, atol=1e-2)


def banded(m: int, band: int, slots: int, dtype, g) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [m, slots * band] zero but for each row's band, and the bands' starts (int32 [m], -1: none): a block of 8
    rows in one band, 8 rows in bands of their own (and none), the rest in one band again, then 8 rows with none."""
    slot = [2] * 8 + [r % (slots + 1) - 1 for r in range(8)] + [slots - 1] * (m - 24) + [-1] * 8
    start = torch.tensor([s * band if s >= 0 else -1 for s in slot[:m]], dtype=torch.int32)
    x2 = torch.zeros(m, slots * band)
    for r, s in enumerate(start.tolist()):
        if s >= 0:
            x2[r, s:s + band] = torch.randn(band, generator=g)
    return x2.to(dtype), start


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extra_inputs_over_each_rows_band_give_the_full_products_bit_for_bit(ops, dtype):
    """With x2_start the kernels multiply each row's band of x2 alone (LoRA's rows, each with its own adapter's
    band): the same outputs as over all of x2, whose other values are zeros, for rows sharing a band, rows of mixed
    bands and rows with none, on the loop and (here the same loop where the CPU has no AMX) the tile path, the fused
    SwiGLU too; with out_start the masked low-rank sums multiply only the output tiles that meet each row's band,
    the same outputs as the full masked product. bf16: on both of the loop's ways to multiply. On AMX tiles a block
    is 32 rows: the second (13 rows, one band and none) skips x2's steps and output tiles outside that band."""
    if not (kernels.bf16_linear_built() if dtype == torch.bfloat16 else kernels.f32_linear_built()):
        pytest.skip("megapipe's kernel for this dtype is not built on this CPU")
    if dtype == torch.float32:
        return check_bands(ops, dtype)
    chosen = ops.bf16_loop("")
    try:
        for mode in ("vdpbf16ps", "fma"):
            ops.bf16_loop(mode)
            check_bands(ops, dtype)
    finally:
        ops.bf16_loop(chosen[0])


def check_bands(ops, dtype):
    g = torch.Generator().manual_seed(5)
    m, n, k, band, slots = 45, 200, 64, 24, 4
    x = torch.randn(m, k, generator=g).to(dtype)
    x2, start = banded(m, band, slots, dtype, g)
    w = (torch.randn(n, k + slots * band, generator=g) * 0.05).to(dtype)
    b, other = torch.randn(n, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)
    lin = PackedLinear(w[:, :k], b, own=True)
    lin.extend(slots * band)
    lin.set_extra_inputs(w[:, k:])
    for activation, times in (("none", None), ("swish", None), ("none", other)):
        for amx in ((True, False) if dtype == torch.bfloat16 else (None,)):
            kw = {} if amx is None else {"amx": amx}
            full, bands = torch.empty(m, n, dtype=dtype), torch.empty(m, n, dtype=dtype)
            lin.own_op()(x, lin.wide, n, b, activation == "swish", times, full, x2=x2, **kw)
            lin.own_op()(x, lin.wide, n, b, activation == "swish", times, bands, x2=x2, x2_start=start,
                         x2_band=band, **kw)
            assert torch.equal(full, bands), (activation, amx)
    if dtype == torch.bfloat16:
        gate, up = kernels.pack_bf16_weight(w), kernels.pack_bf16_weight(w.flip(0))
        for amx in (True, False):
            full, bands = torch.empty(m, n, dtype=dtype), torch.empty(m, n, dtype=dtype)
            ops.glu_bf16(x, gate, up, n, full, amx=amx, x2=x2)
            ops.glu_bf16(x, gate, up, n, bands, amx=amx, x2=x2, x2_start=start, x2_band=band)
            assert torch.equal(full, bands), amx
    # the low-rank sums themselves, (x A^T) * mask, with out_start: only the tiles that meet a row's band multiplied
    a = PackedLinear((torch.randn(slots * band, k, generator=g) * 0.1).to(dtype), own=True)
    mask = (x2 != 0).to(dtype)
    mask[start < 0] = 0
    for amx in ((True, False) if dtype == torch.bfloat16 else (None,)):
        kw = {} if amx is None else {"amx": amx}
        full, bands = torch.empty(m, slots * band, dtype=dtype), torch.empty(m, slots * band, dtype=dtype)
        a.own_op()(x, a.packed, slots * band, None, False, mask, full, **kw)
        a.own_op()(x, a.packed, slots * band, None, False, mask, bands, out_start=start, out_band=band, **kw)
        assert torch.equal(full, bands) and bands.count_nonzero() == mask.count_nonzero(), amx
    with pytest.raises(RuntimeError, match=rf"out_start\[9\] = {3 * band + 1} is not -1 or a start of a band of "
                                           rf"{band} in out's {slots * band} columns"):
        bad = start.clone()
        bad[9] = 3 * band + 1
        a.own_op()(x, a.packed, slots * band, None, False, mask, bands, out_start=bad, out_band=band)
    out = torch.empty(m, n, dtype=dtype)

    def call(**kw):
        lin.own_op()(x, lin.wide, n, None, False, None, out, **{"x2": x2, "x2_band": band, **kw})

    with pytest.raises(RuntimeError, match=r"x2_start must be int32 \[M\] beside an x2"):
        call(x2_start=start.long())
    with pytest.raises(RuntimeError, match=r"x2_start must be int32 \[M\] beside an x2"):
        lin.own_op()(x, lin.packed, n, None, False, None, out, x2_start=start, x2_band=band)
    with pytest.raises(RuntimeError, match=rf"x2_band {slots * band + 2} must be in 1 .. {slots * band}"):
        call(x2_start=start, x2_band=slots * band + 2)
    bad = start.clone()
    bad[9] = (slots - 1) * band + 2
    with pytest.raises(RuntimeError, match=rf"x2_start\[9\] = {int(bad[9])} is not -1 or a start of a band of "
                                           rf"{band} in x2's {slots * band} columns"):
        call(x2_start=bad)
    if dtype == torch.bfloat16:
        with pytest.raises(RuntimeError, match=rf"x2_band {band + 1} must be .* a multiple of 2"):
            call(x2_start=start, x2_band=band + 1)
        bad[9] = 3
        with pytest.raises(RuntimeError, match=r"x2_start\[9\] = 3 is not -1 .* \(a multiple of 2\)"):
            call(x2_start=bad)


def test_bf16_linear_refuses_mismatched_shapes_and_leaves_odd_widths_to_onednn(bf16_linear):
    w = torch.randn(32, 64).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    out = torch.empty(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x has 62 features and the weight 64 for 32 outputs"):
        bf16_linear(torch.zeros(2, 62, dtype=torch.bfloat16), packed, 32, None, False, None, out)
    with pytest.raises(RuntimeError, match="linear_bf16 takes bf16 tensors"):
        bf16_linear(torch.zeros(2, 64), packed, 32, None, False, None, out)
    x, x2 = torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 30, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"x has 32 \(\+ x2's 30\) features and the weight 64 for 32 outputs"):
        bf16_linear(x, packed, 32, None, False, None, out, x2=x2)
    with pytest.raises(RuntimeError, match=r"linear_bf16: x2 must be \[M, K2\]"):
        bf16_linear(x, packed, 32, None, False, None, out, x2=torch.zeros(3, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="only a layer on megapipe's kernel takes extra inputs"):
        PackedLinear(w, own=False).extend(32)
    assert not PackedLinear(torch.randn(8, 63).bfloat16(), own=True).own
    with pytest.raises(ValueError, match="megapipe's linear fuses no 'gelu'"):
        PackedLinear(w, own=True)(torch.zeros(2, 64, dtype=torch.bfloat16), "gelu")


def test_own_row_limit_is_the_cheapest_split_of_the_measured_rows():
    def times(*own_wins):
        return {m: {"own": 1.0, "onednn": 2.0 if win else 0.5} for m, win in zip(kernels.CHOICE_ROWS, own_wins, strict=True)}

    assert kernels.own_row_limit(times(True, True, False, False, False, False, False)) == 2
    assert kernels.own_row_limit(times(True, False, True, True, False, False, False)) == 8  # one noisy count
    assert kernels.own_row_limit(times(False, False, True, False, False, False, False)) == 0
    assert kernels.own_row_limit(times(False, True, False, False, False, False, False)) == 2  # even: OWN_EDGE tips it
    assert kernels.own_row_limit(times(*[True] * len(kernels.CHOICE_ROWS))) == kernels.OWN_ALWAYS
    assert kernels.own_row_limit(times(True, True, True, True, True, True, False)) == 32
    close = {m: {"own": 1.0, "onednn": 0.97} for m in kernels.CHOICE_ROWS}  # oneDNN 3% faster: within OWN_EDGE
    assert kernels.own_row_limit(close) == kernels.OWN_ALWAYS
    close[64]["onednn"] = 0.9  # 10%: beyond it
    assert kernels.own_row_limit(close) == 32
    assert kernels.describe_row_limit(4) == "megapipe up to 4 rows, oneDNN above"


def test_the_kernels_measured_take_turns_and_each_keeps_its_fastest_call():
    """A few ms of another process then slow one call of each kernel, not every call of one."""
    calls = []
    pause = {"own": iter([0.004, 0.0, 0.0]), "onednn": iter([0.0, 0.002, 0.0])}

    def run(name):
        calls.append(name)
        time.sleep(next(pause[name]))

    times = kernels._fastest_seconds({"own": lambda: run("own"), "onednn": lambda: run("onednn")}, 3)
    assert calls == ["own", "onednn"] * 3
    assert set(times) == {"own", "onednn"} and all(t < 0.002 for t in times.values())


def test_a_linear_with_a_row_limit_runs_each_call_on_its_kernel(bf16_linear, monkeypatch):
    """Both layouts kept; up to 2 rows on megapipe's kernel, more on oneDNN's; both give the same product, and a
    repack reaches both copies."""
    g = torch.Generator().manual_seed(7)
    w, b = (torch.randn(48, 64, generator=g) * 0.05).bfloat16(), torch.randn(48, generator=g).bfloat16()
    lin = PackedLinear(w, b, own=2)
    assert lin.own and lin.own_rows == 2 and lin.onednn is not None
    assert PackedLinear(w, b, own=True).onednn is None and PackedLinear(w, b, own=0).onednn is None
    calls = []
    monkeypatch.setattr(runner_module, "torch_compat", _Counting(runner_module.torch_compat, calls))
    for m in (1, 2, 3, 16):
        x = torch.randn(m, 64, generator=g).bfloat16()
        want = x.double() @ w.double().t() + b.double()
        for got in (lin(x), lin(x, "swish"), lin.times(x, x[:, :48])):
            assert got.shape == (m, 48)
        torch.testing.assert_close(lin(x).double(), want, rtol=2 ** -7, atol=1e-2)
    assert calls == ["linear_pointwise", "linear_pointwise", "linear_pointwise_binary", "linear_pointwise"] * 2
    w2 = (torch.randn(48, 64, generator=g) * 0.05).bfloat16()
    repack(lin, w2, b)
    for m in (1, 16):
        x = torch.randn(m, 64, generator=g).bfloat16()
        torch.testing.assert_close(lin(x).double(), x.double() @ w2.double().t() + b.double(), rtol=2 ** -7,
                                   atol=1e-2)


class _Counting:
    """torch_compat with its oneDNN calls recorded by name."""

    def __init__(self, module, calls):
        self.module, self.calls = module, calls

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)
        return counted


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (3, 40, 63), (8, 200, 576), (70, 1536, 576)])
def test_f32_linear_is_the_product_within_fp32_round_off(ops, m, n, k):
    """megapipe's fp32 kernel (AVX-512 CPUs): row blocks and tiles with remainders, odd widths, bias, SiLU and a
    product in the epilogue, against the float64 product; the packed weight reads back as it was."""
    if not kernels.f32_linear_built():
        pytest.skip("megapipe's fp32 linear is built on AVX-512 CPUs only")
    g = torch.Generator().manual_seed(m + n + k)
    w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    x, other = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
    mine = PackedLinear(w, b, own=True)
    assert mine.own and mine.packed.shape == (-(-n // 16), k, 16) and torch.equal(mine.dense(), w)
    exact = x.double() @ w.double().t() + b.double()
    for got, want in ((mine(x), exact), (mine(x, "swish"), exact * exact.sigmoid()),
                      (mine.times(x, other), exact * other.double())):
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=f"x has {k + 1} features and the weight {k} for {n} outputs"):
        ops.linear_f32(torch.zeros(m, k + 1), mine.packed, n, None, False, None, torch.empty(m, n))
    with pytest.raises(RuntimeError, match=r"linear_f32: x2 must be \[M, K2\]"):
        ops.linear_f32(x, mine.packed, n, None, False, None, torch.empty(m, n), x2=torch.zeros(m + 1, 3))
    check_extra_inputs(mine, w, b, torch.randn(n, 5, generator=g) * 0.05, x, torch.randn(m, 5, generator=g), other,
                       rtol=1e-5, atol=1e-5)


def test_bf16_engine_on_the_own_linears_scores_as_on_onednn(bf16_linear, hf_llama, one_thread):
    """Teacher-forced (prompt logprobs, so no diverging continuation): the same log-probs within bf16 round-off."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY)
    engines = [LLMEngine.from_pretrained(hf_llama[0], device="cpu", dtype="bfloat16", cpu_kernels=flag,
                                         bf16_linear="own") for flag in (None, False)]
    assert engines[0].runner.own_linears and not engines[1].runner.own_linears
    scored = [[lp for out in engine.generate(PROMPTS, params) for lp, *_ in out.prompt_logprobs[1:]]
              for engine in engines]
    torch.testing.assert_close(torch.tensor(scored[0]), torch.tensor(scored[1]), atol=0.1, rtol=0)


def test_bf16_engine_takes_plain_greedy_tokens_from_the_head_without_its_logits(bf16_linear, hf_llama, one_thread,
                                                                               monkeypatch):
    """Steps whose rows are all plain greedy take the head's argmax (linear_bf16_argmax), no logits written; a step
    that needs logits (logprobs; before min_tokens, whose suppressed ids apply) takes the logits path; the tokens
    agree."""
    engine = LLMEngine.from_pretrained(hf_llama[0], device="cpu", dtype="bfloat16", bf16_linear="own")
    calls, real = [], PackedLinear.greedy_ids
    monkeypatch.setattr(PackedLinear, "greedy_ids", lambda self, x: calls.append(len(x)) or real(self, x))

    def tokens(**extra):
        return [out.outputs[0].token_ids for out in engine.generate(PROMPTS, SamplingParams(max_tokens=10, **GREEDY,
                                                                                            **extra))]

    fused = tokens()
    assert calls and sum(calls) == 10 * len(PROMPTS)  # every token of every prompt
    calls.clear()
    assert tokens(logprobs=0) == fused and not calls
    assert tokens(min_tokens=3) == fused and sum(calls) == 7 * len(PROMPTS)  # from the 4th token on


def test_bf16_linear_choice_is_measured_or_as_set(bf16_linear, hf_llama, capsys, one_thread):
    limit, why = kernels.choose_bf16_linear("auto", 96, 64)
    assert f"bf16 matmuls on {kernels.describe_row_limit(limit)}" in why and "96x64 weight" in why
    assert all(f"{m}: " in why.split("measured")[1] for m in kernels.CHOICE_ROWS)
    assert ("megapipe's loop on" in why) == (not kernels.has_amx())  # what the loop multiplies on, where it serves
    assert kernels.choose_bf16_linear("onednn", 96, 64)[0] == 0
    assert kernels.choose_bf16_linear("own", 96, 64)[0] == kernels.OWN_ALWAYS
    with pytest.raises(ValueError, match="bf16_linear = 'amx' must be one of auto, own, onednn"):
        kernels.choose_bf16_linear("amx", 96, 64)
    engine = LLMEngine.from_pretrained(hf_llama[0], device="cpu", dtype="bfloat16", bf16_linear="onednn")
    assert not engine.runner.own_linears
    assert "megapipe: bf16 matmuls on oneDNN (as set)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--bf16-linear = 'fast' must be one of auto, own, onednn"):
        LLMEngine.from_pretrained(hf_llama[0], device="cpu", dtype="bfloat16", bf16_linear="fast")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_engine_with_the_kernels_gives_the_torch_paths_tokens_and_logprobs(ops, arch, tmp_path_factory, one_thread):
    """fp32, staggered arrivals (decodes batched with prefill chunks), biases (qwen2), a sliding window (mistral)."""
    path, _ = make_hf_dir(tmp_path_factory.mktemp(f"kernel_{arch}"), arch)
    params = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    outs = []
    for kernel in (True, False):
        engine = LLMEngine.from_pretrained(path, device="cpu", max_num_batched_tokens=8, cpu_kernels=kernel)
        assert (engine.runner.attention_kernel is not None) == kernel
        assert all((layer.ops is not None) == kernel for layer in engine.runner.layers)
        assert (engine.runner.own_linears > 0) == (kernel and kernels.f32_linear_built())  # fp32 matmuls too
        outs.append(run_staggered(engine, PROMPTS, params, every=1,
                                  pick=lambda out: (out.outputs[0].token_ids, out.outputs[0].logprobs)))
    assert outs[0].keys() == outs[1].keys()
    for i, (tokens, logprobs) in outs[0].items():
        want_tokens, want_logprobs = outs[1][i]
        assert tokens == want_tokens
        got = torch.tensor([[lp] + [a for _, a in alts] for lp, alts in logprobs])
        want = torch.tensor([[lp] + [a for _, a in alts] for lp, alts in want_logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # the bound for fp32 logprobs


@pytest.mark.parametrize("arch,dtype", [("qwen2", "bfloat16"), ("mistral", "float32"), ("llama", "bfloat16")])
def test_direct_kernel_calls_give_the_modules_values_bit_for_bit(ops, arch, dtype, tmp_path_factory, one_thread,
                                                                 monkeypatch):
    """DecoderLayer.direct (a step's layers as direct kernel calls) against the modules' path: the same tokens and
    the same logprobs to the bit, with biases (qwen2) and a sliding window (mistral); a step over its row limit
    takes the modules (as an engine with LoRA adapters does: test_multi_lora's outputs on the kernels)."""
    if dtype == "bfloat16" and not kernels.bf16_linear_built():
        pytest.skip("this CPU has no AVX512-BF16: bf16 linears stay on oneDNN")
    if dtype == "float32" and not kernels.f32_linear_built():
        pytest.skip("megapipe's fp32 linear needs AVX-512")
    path, _ = make_hf_dir(tmp_path_factory.mktemp(f"direct_{arch}"), arch)
    engine = LLMEngine.from_pretrained(path, device="cpu", dtype=dtype, max_num_batched_tokens=8,
                                       bf16_linear="own")
    runner = engine.runner
    assert runner.direct_rows == kernels.OWN_ALWAYS
    calls, real = [], runner_module.DecoderLayer.direct
    monkeypatch.setattr(runner_module.DecoderLayer, "direct", lambda self, *a: calls.append(1) or real(self, *a))
    params = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    pick = lambda out: (out.outputs[0].token_ids, out.outputs[0].logprobs)  # noqa: E731
    direct = run_staggered(engine, PROMPTS, params, every=1, pick=pick)
    assert calls
    calls.clear()
    runner.direct_rows = 0
    modules = run_staggered(engine, PROMPTS, params, every=1, pick=pick)
    assert not calls and direct == modules


def test_kernels_that_cannot_be_built_leave_the_torch_path(tmp_path, monkeypatch, caplog, tiny_engine_factory):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCES", [broken])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    kernels.ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="megapipe.inference.kernels"):
            assert kernels.ops() is None and kernels.paged_attention() is None
        assert "could not be built" in caplog.text and "using the torch path" in caplog.text
        engine = tiny_engine_factory(num_blocks=32)
        assert engine.runner.ops is None and engine.runner.attention_kernel is None
        assert engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3, **GREEDY))[0].outputs[0].token_ids
        with pytest.raises(ConfigError, match=r"cpu_kernels = True but megapipe's CPU kernels do not run here "
                                              r"\(cpu, torch.float32, "):
            tiny_engine_factory(num_blocks=32, cpu_kernels=True)
    finally:
        kernels.ops.cache_clear()


def test_megapipe_cpu_kernels_0_turns_them_off(monkeypatch, tiny_engine_factory):
    monkeypatch.setenv("MEGAPIPE_CPU_KERNELS", "0")
    kernels.ops.cache_clear()
    try:
        assert kernels.ops() is None
        engine = tiny_engine_factory(num_blocks=32)
        assert engine.runner.ops is None and engine.runner.attention_kernel is None
    finally:
        kernels.ops.cache_clear()


def test_unsupported_shapes_and_devices_take_the_torch_path(op):
    width = kernels.vector_width()
    assert kernels.attention_kernel_for(4 * width, torch.bfloat16, "cpu") is op
    assert kernels.attention_kernel_for(4 * width + 1, torch.bfloat16, "cpu") is None
    assert kernels.attention_kernel_for(7 * width, torch.float32, "cpu") is None  # no instantiation for 7 vectors
    assert kernels.attention_kernel_for(4 * width, torch.float64, "cpu") is None
    assert kernels.attention_kernel_for(4 * width, torch.float32, "meta") is None


def test_cpu_kernels_setting_must_be_a_boolean_or_none(tiny_engine_factory):
    with pytest.raises(ConfigError, match=r"EngineConfig.cpu_kernels = 'on' must be True, False or None"):
        tiny_engine_factory(num_blocks=32, cpu_kernels="on")


def test_a_build_is_announced_only_when_one_is_needed(ops, tmp_path, monkeypatch, capsys):
    """The kernels loaded from the cache: no build needed for them there, one needed in an empty cache (a real
    compile takes minutes on a busy machine, so the notice is shown around a short wait instead)."""
    assert not kernels.needs_build()  # where ops() found or built them
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert kernels.needs_build()
    with kernels.build_notice(False):
        pass
    assert capsys.readouterr().err == ""
    with kernels.build_notice(True, every_s=0.05):
        time.sleep(0.2)
    err = capsys.readouterr().err
    assert err.startswith("megapipe: building CPU kernels (once") and "still building CPU kernels" in err
    assert err.rstrip().endswith("s") and "CPU kernels built in" in err
    with pytest.raises(OSError), kernels.build_notice(True):
        raise OSError("no compiler")
    assert "CPU kernels failed (the torch path serves instead)" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dim", [16, 12])
def test_mamba_step_is_the_mixers_decode_step(ops, dtype, state_dim):
    """The fused decode step of a Mamba layer (conv, SiLU, dt with its limits, state update, read-out, D) against
    the mixer's in-place step, on strided rows of a projection output as the engine passes them, each row's state
    at its slot of a larger pool, out of order (the slots a continuous batch holds); the other slots untouched; a
    state size of whole 16-lane groups and one with a tail. fp32 within round-off; bf16 within its ulp (the kernel
    keeps the conv output in fp32, the torch path rounds it)."""
    from tests.models.test_mamba import _mixer

    mixer = _mixer(4, mamba_state_dim=state_dim, mamba_dt_limit_max=0.5).to(dtype)
    channels, heads = mixer.conv_params()[0].shape[0], mixer.in_dt.out_features
    g = torch.Generator().manual_seed(7)
    proj = torch.randn(3, channels + heads + 5, generator=g).to(dtype)  # xbc | dt | more: strided rows
    xbc, dt = proj[:, :channels], proj[:, channels:channels + heads]
    conv = torch.randn(5, channels, 3, generator=g).to(dtype)
    ssm = torch.randn(5, heads, mixer.head_dim, state_dim, generator=g)
    slots = torch.tensor([3, 0, 2])
    want_conv, want_ssm = conv.clone(), ssm.clone()
    with torch.no_grad():
        rows_conv, rows_ssm = want_conv[slots], want_ssm[slots]
        want, _, _ = mixer.ssm(xbc[:, None], dt[:, None], rows_conv, rows_ssm, inplace=True)
        want_conv[slots], want_ssm[slots] = rows_conv, rows_ssm
        out = torch.empty(3, heads * mixer.head_dim, dtype=dtype)
        ops.mamba_step(xbc, dt, conv, ssm, slots, *mixer.step_params(), out)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert torch.equal(conv, want_conv)
    assert torch.equal(ssm[[1, 4]], want_ssm[[1, 4]])
    torch.testing.assert_close(ssm, want_ssm, **tol)
    torch.testing.assert_close(out.view(want.shape), want, **tol)


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (7, 40, 64), (16, 200, 576), (45, 96, 1536), (3, 48, 40)])
def test_bf16_linear_on_amx_tiles_matches_its_vdpbf16ps_loop(bf16_linear, m, n, k):
    """Where the CPU has AMX the kernel multiplies tiles of 16 rows x 32 inputs (k = 40: not a whole tile, the
    vdpbf16ps loop serves); both sum the same exact products in fp32 in another order: within a rounding of each
    other, and nearly always equal, with bias, SiLU and the product in the epilogue, and a second input x2."""
    g = torch.Generator().manual_seed(m * n + k)
    w, b = (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x, other = torch.randn(m, k, generator=g).bfloat16(), torch.randn(m, n, generator=g).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    x2 = torch.randn(m, 64, generator=g).bfloat16()  # x's last 64 inputs as a second input instead
    wide = kernels.pack_bf16_weight(torch.cat([w, (torch.randn(n, 64, generator=g) * 0.05).bfloat16()], 1))
    for swish, times, extra in ((False, None, None), (True, None, None), (False, other, None), (True, other, x2)):
        tiles, loop = (torch.empty(m, n, dtype=torch.bfloat16) for _ in range(2))
        weight = packed if extra is None else wide
        bf16_linear(x, weight, n, b, swish, times, tiles, x2=extra)
        bf16_linear(x, weight, n, b, swish, times, loop, amx=False, x2=extra)
        torch.testing.assert_close(tiles.float(), loop.float(), rtol=2 ** -7, atol=2 ** -7)
        assert (tiles == loop).float().mean() > 0.95


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (9, 40, 64), (17, 200, 600), (3, 48, 40)])
def test_bf16_loop_on_fmas_sums_the_exact_products_as_on_vdpbf16ps(bf16_linear, ops, m, n, k):
    """The loop multiplies on vdpbf16ps or, the bf16 values widened, on fp32 FMAs (what a measurement at first use
    picks for this CPU): both sum the exact products in fp32, so both are within a rounding of the exact result and
    nearly always equal, with bias, SiLU, the product and a second input x2 (k = 600: x widened in two parts of 256
    and 44 pairs); the setting is refused by name and reported with the measurement that chose it."""
    g = torch.Generator().manual_seed(m * n + k)
    w, b = (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x, other = torch.randn(m, k, generator=g).bfloat16(), torch.randn(m, n, generator=g).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    exact = x.double() @ w.double().t() + b.double()
    chosen = ops.bf16_loop("")
    assert chosen[0] in ("vdpbf16ps", "fma") and chosen[1] and kernels.bf16_loop() == chosen
    try:
        outs = {}
        for mode in ("vdpbf16ps", "fma"):
            assert ops.bf16_loop(mode) == (mode, "as set")
            for swish, times, split in ((False, None, 0), (True, other, 0), (True, other, 8)):
                out = torch.empty(m, n, dtype=torch.bfloat16)
                inputs = (x, None) if not split else (x[:, :k - split], x[:, k - split:])
                bf16_linear(inputs[0], packed, n, b, swish, times, out, amx=False, x2=inputs[1])
                want = exact * exact.sigmoid() if swish else exact
                want = want if times is None else want * other.double()
                torch.testing.assert_close(out.double(), want, rtol=2 ** -7, atol=1e-2)
                outs[mode, swish, split] = out
        for (_, swish, split), out in outs.items():
            assert (out == outs["vdpbf16ps", swish, split]).float().mean() > 0.95
        auto = ops.bf16_loop("auto")
        other = {"vdpbf16ps": "fma", "fma": "vdpbf16ps"}[auto[0]]
        found = re.fullmatch(rf"measured: {auto[0]} (\d+\.\d+)x {other}", auto[1])
        assert found and float(found[1]) >= 1.0, auto  # the chosen loop, and how much faster than the other
        with pytest.raises(RuntimeError, match="bf16_loop: 'fast' must be one of auto, vdpbf16ps, fma"):
            ops.bf16_loop("fast")
    finally:
        ops.bf16_loop(chosen[0])


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (7, 40, 64), (45, 1536, 576), (70, 200, 576), (3, 48, 40)])
def test_glu_is_the_gated_product_of_its_two_linears_in_one_call(bf16_linear, ops, m, n, k):
    """glu_bf16 (a SwiGLU's gate and up projections, each block both halves' tiles of the same outputs, on AMX tiles
    and on the vdpbf16ps loop) is silu(x Wg^T) * (x Wu^T) within a rounding of the exact value, and closer to it on
    average than the two calls it replaces (which round the gate's SiLU to bf16 before the product)."""
    g = torch.Generator().manual_seed(m * n + k)
    gate, up = ((torch.randn(n, k, generator=g) * 0.05).bfloat16() for _ in range(2))
    x = torch.randn(m, k, generator=g).bfloat16()
    exact_gate = x.double() @ gate.double().t()
    want = exact_gate * exact_gate.sigmoid() * (x.double() @ up.double().t())
    packed_gate, packed_up = kernels.pack_bf16_weight(gate), kernels.pack_bf16_weight(up)
    for amx in (True, False):
        fused, silu, two = (torch.empty(m, n, dtype=torch.bfloat16) for _ in range(3))
        ops.glu_bf16(x, packed_gate, packed_up, n, fused, amx=amx)
        bf16_linear(x, packed_gate, n, None, True, None, silu, amx=amx)
        bf16_linear(x, packed_up, n, None, False, silu, two, amx=amx)
        torch.testing.assert_close(fused.double(), want, rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(two.double(), want, rtol=2 ** -6, atol=1e-3)
        assert (fused.double() - want).abs().mean() <= (two.double() - want).abs().mean()
        split = torch.empty(m, n, dtype=torch.bfloat16)  # x's last 32 inputs as a second input: the same sums
        ops.glu_bf16(x[:, :k - 32], packed_gate, packed_up, n, split, amx=amx, x2=x[:, k - 32:])
        assert torch.equal(split, fused)
    with pytest.raises(RuntimeError, match="glu_bf16: x has 64 features and the weight 32 for 16 outputs"):
        ops.glu_bf16(torch.zeros(2, 64, dtype=torch.bfloat16), kernels.pack_bf16_weight(gate[:16, :32]),
                     kernels.pack_bf16_weight(up[:16, :32]), 16, torch.empty(2, 16, dtype=torch.bfloat16))


def test_the_fused_silu_holds_at_extreme_inputs(bf16_linear):
    """SiLU from a reciprocal estimate and a Newton step: finite and right far out on both sides (1 + exp(-x) would
    overflow to inf below about -88), exact where it is x or 0."""
    values = torch.tensor([-1e4, -1000, -100, -88.8, -80, -20, -1, -1e-3, 0, 1e-3, 1, 20, 100, 1e4])
    x = torch.zeros(len(values), 32, dtype=torch.bfloat16)
    x[:, 0] = values
    weight = torch.zeros(16, 32, dtype=torch.bfloat16)
    weight[0, 0] = 1
    for amx in (True, False):
        out = torch.empty(len(values), 16, dtype=torch.bfloat16)
        bf16_linear(x, kernels.pack_bf16_weight(weight), 16, None, True, None, out, amx=amx)
        want = torch.nn.functional.silu(x[:, 0].double())
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[:, 0].double(), want, rtol=2 ** -8, atol=1e-30)


def test_packed_swiglu_runs_the_fused_glu_where_chosen_with_or_without_extra_inputs(bf16_linear, monkeypatch):
    """Where kernels.glu_fused says so the gate and up projections are one glu_bf16 call, also with extra inputs
    (LoRA's low-rank sums, PackedLinear.extend); elsewhere two linear calls; each is the SwiGLU of [x | x2] against
    the extended weights."""
    from megapipe.config import ModelConfig
    from megapipe.inference.runner import PackedSwiGLU
    from megapipe.models.dense import FeedForward

    torch.manual_seed(0)
    ff = FeedForward(ModelConfig(hidden_size=64, intermediate_size=96)).bfloat16()
    x, x2 = torch.randn(2, 5, 64).bfloat16(), torch.randn(10, 32).bfloat16()
    extra = {name: (torch.randn(96, 32) * 0.05).bfloat16() for name in ("w1", "w3")}
    with torch.no_grad():
        want = ff(x).double()
        wide = torch.cat([x.view(10, 64), x2], 1)
        gate, up = (wide @ torch.cat([getattr(ff, n).weight, extra[n]], 1).T for n in ("w1", "w3"))
        want_extra = ff.w2(torch.nn.functional.silu(gate.float()).bfloat16() * up).double().view(2, 5, 64)
    calls = []
    real = torch.ops.megapipe

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(torch.ops, "megapipe", Counting(), raising=False)
    for amx in (True, False):
        monkeypatch.setattr(kernels, "glu_fused", lambda n, k, amx=amx: amx)  # fused or not, whatever this CPU chose
        packed = PackedSwiGLU(ff, own=True)
        calls.clear()
        got = packed(x)
        torch.testing.assert_close(got.double(), want, rtol=2 ** -6, atol=2e-2)
        for name in ("w1", "w3"):
            getattr(packed, name).extend(32)
            getattr(packed, name).set_extra_inputs(extra[name])
        torch.testing.assert_close(packed(x, ExtraInputs(x2)).double(), want_extra, rtol=2 ** -6, atol=3e-2)
        assert calls == (["glu_bf16", "linear_bf16"] if amx else ["linear_bf16"] * 3) * 2, amx


def test_onednn_max_cpu_isa_caps_megapipe_kernels_too(monkeypatch):
    """ONEDNN_MAX_CPU_ISA below AMX (or below AVX512-BF16) makes the kernels build and choose as on a CPU without
    them, as oneDNN does: one variable to run an AMX machine as a CPU without AMX."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    amx, bf16 = kernels.has_amx(), kernels.has_avx512_bf16()
    assert amx == bool(torch.cpu._is_amx_tile_supported())
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_bf16")
    assert not kernels.has_amx() and kernels.has_avx512_bf16() == bf16
    assert "-mamx-tile" not in kernels._build_spec()[2]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not kernels.has_amx() and not kernels.has_avx512_bf16()
    assert "-mavx512bf16" not in kernels._build_spec()[2] and "amx" not in kernels.isa_summary()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert (kernels.has_amx(), kernels.has_avx512_bf16()) == (amx, bf16)


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (7, 40, 64), (45, 1536, 576), (3, 48, 40)])
def test_bf16_linear_writes_fp32_outputs_as_its_rounded_bf16_ones(bf16_linear, m, n, k):
    """An fp32 ``out`` holds exactly the bf16 outputs widened (a head's logits without a widening pass), on AMX
    tiles and on the vdpbf16ps loop, with a bias; a bf16 op refuses other output dtypes."""
    g = torch.Generator().manual_seed(m + n + k)
    w, b = (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x, packed = torch.randn(m, k, generator=g).bfloat16(), kernels.pack_bf16_weight(w)
    for amx in (True, False):
        rounded, wide = torch.empty(m, n, dtype=torch.bfloat16), torch.full((m, n), float("nan"))
        bf16_linear(x, packed, n, b, False, None, rounded, amx=amx)
        bf16_linear(x, packed, n, b, False, None, wide, amx=amx)
        assert torch.equal(wide, rounded.float())
    with pytest.raises(RuntimeError, match="takes bf16 tensors"):
        bf16_linear(x, packed, n, b, False, None, torch.empty(m, n, dtype=torch.float16))
    lin = PackedLinear(w, b, own=True)
    assert torch.equal(lin.forward_float(x[None]), lin(x[None]).float()) and lin.forward_float(x).dtype == torch.float32
    onednn = PackedLinear(w, b, own=False)  # another kernel: the plain widening
    assert torch.equal(onednn.forward_float(x), onednn(x).float())


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (7, 40, 64), (64, 4099, 576), (70, 1536, 96), (3, 48, 40)])
def test_bf16_argmax_is_argmax_rows_of_the_fp32_outputs(bf16_linear, ops, m, n, k):
    """A head's greedy tokens without its logits: the index argmax_rows picks from linear_bf16's fp32 outputs, on
    AMX tiles and the loop, with a bias, over part tiles (n = 40, 4099) and rows spread over both threads; ties take
    the first column, a NaN wins (over +inf too) and all -inf keeps column 0."""
    g = torch.Generator().manual_seed(m + n + k)
    w, b = (torch.randn(n, k, generator=g) * 0.05).bfloat16(), torch.randn(n, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    x[:, 0] = 1.0
    cases = [(w, b)]
    tied = w.clone()
    tied[1], tied[n // 2] = 0.0, 0.0
    tied[1, 0] = tied[n // 2, 0] = 50.0  # columns 1 and n // 2: the equal largest logits of every row
    cases.append((tied, None))
    odd = w.clone()
    odd[n - 2, 0], odd[n // 3, 0] = float("nan"), float("inf")  # x[:, 0] = 1: every row's logit there
    cases.append((odd, b))
    cases.append((w, torch.full((n,), float("-inf")).bfloat16()))
    picked = []
    for weight, bias in cases:
        packed = kernels.pack_bf16_weight(weight)
        for amx in (True, False):
            logits, want, got = torch.empty(m, n), torch.empty(m, dtype=torch.long), torch.full((m,), -1)
            bf16_linear(x, packed, n, bias, False, None, logits, amx=amx)
            ops.argmax_rows(logits, want)
            ops.linear_bf16_argmax(x, packed, n, bias, got, amx=amx)
            assert torch.equal(got, want), (amx, got, want)
        picked.append(want)
    assert (picked[1] == 1).all()  # the first of the tied columns
    assert (picked[2] == n - 2).all() and (picked[3] == 0).all()  # the NaN; all -inf
    with pytest.raises(RuntimeError, match="out must be int64"):
        ops.linear_bf16_argmax(x, packed, n, None, torch.empty(m, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="features and the weight"):
        ops.linear_bf16_argmax(x[:, :-2], packed, n, None, torch.empty(m, dtype=torch.long))


def test_argmax_rows_is_max_indices_with_ties_nans_and_infinities(ops):
    from megapipe.inference.sampling import greedy_ids

    g = torch.Generator().manual_seed(3)
    for shape in [(64, 49152), (1, 7), (3, 17), (5, 1), (2, 1003)]:
        x = torch.randn(*shape, generator=g)
        assert torch.equal(greedy_ids(x), x.max(-1).indices), shape
    x = torch.randn(7, 50, generator=g)
    x[1, 7] = x[1, 30] = float("nan")  # the first NaN wins
    x[2, :] = float("-inf")
    x[3, 5] = x[3, 40] = 100.0  # the first of equal maxima
    x[4, 49] = 1e9  # in the tail past the last whole vector
    x[5, 10] = float("inf")
    x[6, 45:] = float("nan")
    got = greedy_ids(x)
    assert got.tolist() == x.max(-1).indices.tolist() == [int(x[0].argmax()), 7, 0, 5, 49, 10, 45]
    assert torch.equal(greedy_ids(x[:, ::2]), x[:, ::2].max(-1).indices)  # strided rows: made contiguous
    assert torch.equal(greedy_ids(x[0]), x[0].max(-1).indices)  # one row as a vector: torch's
    with pytest.raises(RuntimeError, match="argmax_rows: x must be fp32"):
        ops.argmax_rows(x.double(), torch.empty(7, dtype=torch.long))
