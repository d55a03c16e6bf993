"""The engine on GPT-OSS (a tiny random GptOssForCausalLM: learned attention sinks, a 4-token window on layer 0 and
full attention on layer 1, YaRN, biased clamped-SwiGLU experts): its greedy output is transformers' at batch 1 and
in a continuous batch of mixed lengths, with prompts longer than the window, chunked prefill, prefix caching, on the
torch path and with megapipe's CPU kernels (the paged attention kernel with its sink term)."""

from __future__ import annotations

import pytest
import torch

from megapipe.inference import LLMEngine, SamplingParams, kernels
from megapipe.inference.kv_cache import KVPool, PagedBatch, eviction_window, layer_windows
from megapipe.models.attention import CausalSDPA
from tests.helpers.hf_tiny import hf_greedy, make_hf_dir
from tests.inference.test_engine import GREEDY, PROMPTS, run_staggered

KERNELS = [False, pytest.param(None, id="cpu_kernels")]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")


def test_each_layer_keeps_its_window(gpt_oss):
    engine = LLMEngine.from_pretrained(gpt_oss[0], device="cpu", kv_cache_memory=1 << 20)
    assert layer_windows(engine.model_config) == {0: 4, 1: None}
    assert engine.runner.window == {0: 4, 1: None}
    assert engine.runner.layers is not None  # the fast layer path, sinks passed to the paged attention


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, id="cpu_kernel")])
def test_paged_attention_with_sinks_equals_the_model_attention(use_kernel):
    """Decodes and chunks (one from 0, one continuing over cached keys) of the paged batch against the training
    attention on each whole sequence, for a windowed and a full layer, on the torch paths and the CPU kernel."""
    kernel = kernels.attention_kernel_for(16, torch.float32, "cpu") if use_kernel else None
    if use_kernel and kernel is None:
        pytest.skip("megapipe's CPU attention kernel is not built here")
    torch.manual_seed(0)
    heads, kvh, dim, bs = 4, 2, 16, 4
    pool = KVPool([0, 1], 16, bs, kvh, dim, torch.float32, "cpu")
    windows = {0: 3, 1: None}
    sinks = torch.randn(heads)
    lengths, starts = [9, 6, 7], [8, 0, 2]  # a decode at position 8, a prompt of 6, positions 2..6 after 2 cached
    tables = [[0, 1, 2], [3, 4], [5, 6]]
    seqs = [(torch.randn(1, heads, n, dim), torch.randn(1, kvh, n, dim), torch.randn(1, kvh, n, dim)) for n in lengths]
    for layer, window in windows.items():
        want = [CausalSDPA(window)(q, k, v, sinks=sinks) for q, k, v in seqs]
        cached = PagedBatch(pool, windows, kernel)  # the first positions of each sequence, stored by a step before
        cached.plan([], [(t, 0, s) for t, s in zip(tables, starts, strict=True) if s], None)
        firsts = [(q[:, :, :s], k[:, :, :s], v[:, :, :s]) for (q, k, v), s in zip(seqs, starts, strict=True) if s]
        cached.attend(layer, *(torch.cat(parts, dim=2) for parts in zip(*firsts, strict=True)), sinks=sinks)
        batch = PagedBatch(pool, windows, kernel)
        batch.plan([(tables[0], 8)], [(tables[1], 0, 6), (tables[2], 2, 5)], None)
        rest = [(q[:, :, s:], k[:, :, s:], v[:, :, s:]) for (q, k, v), s in zip(seqs, starts, strict=True)]
        out = batch.attend(layer, *(torch.cat(parts, dim=2) for parts in zip(*rest, strict=True)), sinks=sinks)
        expected = torch.cat([w[:, :, s:] for w, s in zip(want, starts, strict=True)], dim=2)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_greedy_equals_transformers(gpt_oss, cpu_kernels, one_thread):
    path, hf = gpt_oss
    want = {i: hf_greedy(hf, p, 12) for i, p in enumerate(PROMPTS)}  # prompts of 2 to 37 tokens, window 4
    greedy = SamplingParams(max_tokens=12, **GREEDY)
    engine = LLMEngine.from_pretrained(path, device="cpu", cpu_kernels=cpu_kernels)
    assert (engine.runner.attention_kernel is None) == (cpu_kernels is False or not kernels.available(
        torch.float32, torch.device("cpu")))
    assert engine.generate([PROMPTS[3]], greedy)[0].outputs[0].token_ids == want[3]  # batch 1
    assert run_staggered(engine, PROMPTS, greedy) == want  # decodes beside prefills of mixed lengths
    chunked = LLMEngine.from_pretrained(path, device="cpu", cpu_kernels=cpu_kernels, max_num_batched_tokens=8,
                                        prefix_caching=False)
    assert run_staggered(chunked, PROMPTS, greedy, every=1) == want
    assert engine.blocks.usage() == chunked.blocks.usage() == 0


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_prefix_cache_shared_prefix(gpt_oss, cpu_kernels, one_thread):
    path, hf = gpt_oss
    system = list(range(10, 42))  # two full blocks of 16, far longer than the window
    prompts = [system + [i, i + 1, i + 2] for i in (100, 120)]
    engine = LLMEngine.from_pretrained(path, device="cpu", block_size=16, cpu_kernels=cpu_kernels)
    greedy = SamplingParams(max_tokens=10, **GREEDY)
    first = engine.generate([prompts[0]], greedy)[0].outputs[0].token_ids
    second = engine.generate([prompts[1]], greedy)[0]
    assert second.num_cached_tokens == 32
    assert [first, second.outputs[0].token_ids] == [hf_greedy(hf, p, 10) for p in prompts]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("mistral_window"), "mistral")  # every layer windowed (8)


def test_eviction_window_only_when_every_layer_is_windowed(gpt_oss, mistral):
    assert eviction_window(LLMEngine.from_pretrained(gpt_oss[0], device="cpu").model_config) is None
    assert eviction_window(LLMEngine.from_pretrained(mistral[0], device="cpu").model_config) == 8


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_a_windowed_model_holds_only_its_window(mistral, cpu_kernels, one_thread):
    """Blocks of 4 behind a window of 8 are given back as the sequences advance: a long generation holds at most
    the window's blocks plus the one being filled, and greedy output stays transformers' (batch 1 and a staggered
    batch, prefix caching on)."""
    path, hf = mistral
    engine = LLMEngine.from_pretrained(path, device="cpu", cpu_kernels=cpu_kernels, block_size=4)
    prompts = [list(range(60, 97)), [5, 17, 9, 33, 2, 71], list(range(60, 90))]  # the third: a cached prefix
    params = SamplingParams(max_tokens=30, **GREEDY)
    want = {i: hf_greedy(hf, p, 30) for i, p in enumerate(prompts)}
    held = []
    engine.add_request("long", prompts[0], params)
    while engine.has_unfinished():
        engine.step()
        held += [len(s.block_ids) - s.num_evicted for s in engine.scheduler.running]
    assert max(held[1:]) <= 8 // 4 + 2 and len(prompts[0]) + 30 > 4 * (8 // 4 + 2) * 2
    assert run_staggered(engine, prompts, params, every=1) == want
    assert engine.blocks.usage() == 0


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_the_windowed_layer_holds_only_its_window(gpt_oss, cpu_kernels, one_thread):
    """GPT-OSS's windowed layer (window 4) has a block table of its own: a long generation holds at most the window's
    blocks plus the one being filled there (the full layer keeps every block), and greedy output is the same as with
    nothing given back and as transformers'; a later prompt sharing the prefix, whose windowed blocks were given back
    (still cached), takes it from the prefix cache and decodes the same."""
    path, hf = gpt_oss
    prompts = [list(range(60, 97)), list(range(60, 90)) + [7, 8]]
    params = SamplingParams(max_tokens=30, **GREEDY)
    want = [hf_greedy(hf, p, 30) for p in prompts]
    engine = LLMEngine.from_pretrained(path, device="cpu", cpu_kernels=cpu_kernels, block_size=4)
    assert engine.pool.windowed_layers == {0} and engine.scheduler.window == 4
    # blocks for every sequence's window (and a step's chunks) on the windowed layer, the rest of the memory for the
    # full one
    windowed = engine.pool.windowed_blocks
    assert windowed == engine.scheduler.window_blocks.num_blocks < engine.pool.num_blocks
    assert engine.pool.k[0].shape[1] == windowed * 4 and engine.pool.k[1].shape[1] == engine.pool.num_blocks * 4
    held, full = [], []
    engine.add_request("long", prompts[0], params)
    while engine.has_unfinished():
        engine.step()
        held += [len(s.window_ids) - s.num_window_evicted for s in engine.scheduler.running]
        full += [(len(s.block_ids), -(-s.num_computed // 4), s.num_evicted) for s in engine.scheduler.running]
    assert max(held[1:]) == -(-4 // 4) + 1 and len(held) >= 29
    assert all(n == need and evicted == 0 for n, need, evicted in full)
    got = engine.generate([prompts[1]], params)[0]
    assert got.num_cached_tokens == 28 and got.outputs[0].token_ids == want[1]

    keeping = LLMEngine.from_pretrained(path, device="cpu", cpu_kernels=cpu_kernels, block_size=4)
    keeping.scheduler.window = None  # nothing given back
    outs = [keeping.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert outs == want and engine.generate([prompts[0]], params)[0].outputs[0].token_ids == want[0]
    assert engine.blocks.usage() == engine.scheduler.window_blocks.usage() == 0


def test_a_prefix_hit_needs_only_the_windowed_blocks_within_the_window(gpt_oss, one_thread):
    """A windowed pool of 5 blocks (one sequence, chunks of 8): the first prompt's early windowed blocks are reused
    while it is prefilled, yet a prompt sharing its 28-token prefix takes it from the cache (the full layer's 7
    blocks, the windowed layer's block within the window of its end) and decodes as transformers does."""
    path, hf = gpt_oss
    first, second = list(range(60, 90)), list(range(60, 90)) + [7, 8]
    params = SamplingParams(max_tokens=8, **GREEDY)
    engine = LLMEngine.from_pretrained(path, device="cpu", block_size=4, max_num_seqs=1, max_num_batched_tokens=8)
    assert engine.pool.windowed_blocks == 1 * (4 // 4 + 2) + 8 // 4
    assert engine.generate([first], params)[0].outputs[0].token_ids == hf_greedy(hf, first, 8)
    windowed = engine.scheduler.window_blocks
    assert sum(h is not None for h in windowed.hash) < 7  # not every block of the prefix is cached there
    got = engine.generate([second], params)[0]
    assert got.num_cached_tokens == 28 and got.outputs[0].token_ids == hf_greedy(hf, second, 8)
    assert engine.blocks.usage() == windowed.usage() == 0


@pytest.mark.parametrize("name", ["gpt_oss", "mistral"])
def test_ngram_drafts_rolled_back_behind_a_moving_window(name, request, one_thread):
    """Prompt-lookup speculation on windowed layers (GPT-OSS: window 4 in the windowed layer's own block table;
    Mistral: every layer windowed, 8): blocks behind the window are given back only up to the accepted tokens
    (``num_computed``), so rejected drafts rolled back never took a block a later query reads, and the greedy tokens
    are transformers'."""
    path, hf = request.getfixturevalue(name)
    plain = LLMEngine.from_pretrained(path, device="cpu", block_size=4)
    params = SamplingParams(max_tokens=40, **GREEDY)
    head = list(range(60, 68))
    # the head, its greedy continuation, the head again: the lookup proposes that continuation (which this random
    # model does not repeat: every draft is rejected and rolled back); 56 + 40 tokens within the model's 128
    prompt = head + plain.generate([head], params)[0].outputs[0].token_ids + head
    engine = LLMEngine.from_pretrained(path, device="cpu", block_size=4, speculative_tokens=3,
                                       speculative_method="ngram", prompt_lookup_min=1)
    sched, rollbacks = engine.scheduler, []
    rollback = sched.rollback

    def recording(seq):
        table = seq.window_ids if sched.window_blocks is not None else seq.block_ids
        before = len(table)
        rollback(seq)
        rollbacks.append((before - len(table), seq.num_window_evicted + seq.num_evicted))

    sched.rollback = recording
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 40)
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert any(released and evicted for released, evicted in rollbacks)  # drafts rejected behind a moved window
    assert engine.blocks.usage() == 0 and (sched.window_blocks is None or sched.window_blocks.usage() == 0)
