"""Prefix caching against transformers: a block is reused only when every one of its tokens (and every token before
it) matches, a fully cached block-aligned prompt still has its last token computed (the rule: full blocks of the
prompt without its last token), and both hold when a small pool preempts sequences."""

from __future__ import annotations

from megapipe.inference import LLMEngine, SamplingParams
from tests.helpers.hf_tiny import hf_greedy
from tests.inference.test_engine import GREEDY, run_staggered

BS = 16
GREEDY_8 = SamplingParams(max_tokens=8, **GREEDY)


def cacheable_tokens(prompt: list[int], block_size: int) -> int:
    """The block rule, written out: the full blocks of the prompt without its last token (whose logits are needed)."""
    return (len(prompt) - 1) // block_size * block_size


def test_a_block_differing_only_in_its_last_token_is_not_reused(hf_llama, cpu_kernels, one_thread):
    path, hf = hf_llama
    engine = LLMEngine.from_pretrained(path, device="cpu", block_size=BS, cpu_kernels=cpu_kernels)
    first = list(range(10, 50))  # 40 tokens: two full blocks and 8 more
    engine.generate([first], GREEDY_8)
    for changed, cached in ((BS - 1, 0), (2 * BS - 1, BS)):  # the last token of block 0, then of block 1
        other = list(first)
        other[changed] = 300
        out = engine.generate([other], GREEDY_8)[0]
        assert out.num_cached_tokens == cached, f"token {changed} changed"
        assert out.outputs[0].token_ids == hf_greedy(hf, other, 8)


def test_an_exactly_two_block_prompt_repeated(hf_llama, cpu_kernels, one_thread):
    path, hf = hf_llama
    engine = LLMEngine.from_pretrained(path, device="cpu", block_size=BS, cpu_kernels=cpu_kernels)
    prompt = list(range(100, 100 + 2 * BS))
    want = hf_greedy(hf, prompt, 8)
    cached = []
    for _ in range(3):
        out = engine.generate([prompt], GREEDY_8)[0]
        assert out.outputs[0].token_ids == want
        cached.append(out.num_cached_tokens)
    assert cached == [0, cacheable_tokens(prompt, BS), cacheable_tokens(prompt, BS)] == [0, BS, BS]
    # three at once (the later two find the first one's blocks only if it registered them first): same answers
    outs = engine.generate([prompt] * 3, GREEDY_8)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    assert {o.num_cached_tokens for o in outs} == {BS}
    assert engine.blocks.hit_tokens == sum(cached) + 3 * BS
    assert engine.blocks.usage() == 0


def test_block_aligned_repeats_under_preemption(hf_llama, cpu_kernels, one_thread):
    path, hf = hf_llama
    bs = 4
    # 16 blocks of 4 tokens: the sequences below (8 prompt + 20 generated tokens each) cannot all hold their blocks
    engine = LLMEngine.from_pretrained(path, device="cpu", block_size=bs, num_blocks=16, max_model_len=64,
                                       max_num_batched_tokens=16, cpu_kernels=cpu_kernels)
    aligned = list(range(200, 200 + 2 * bs))
    near = aligned[:-1] + [299]  # differs in the last token of the second block
    prompts = [aligned, aligned, near, aligned, list(range(30, 42)), aligned, near]
    want = {i: hf_greedy(hf, p, 20) for i, p in enumerate(prompts)}
    outs = run_staggered(engine, prompts, SamplingParams(max_tokens=20, **GREEDY), every=1, pick=lambda out: out)
    assert engine.scheduler.num_preemptions > 0
    assert {i: o.outputs[0].token_ids for i, o in outs.items()} == want
    for i, o in outs.items():
        assert o.num_cached_tokens % bs == 0 and o.num_cached_tokens <= cacheable_tokens(prompts[i], bs)
    assert engine.blocks.hit_tokens == sum(o.num_cached_tokens for o in outs.values()) > 0
    assert engine.blocks.usage() == 0
