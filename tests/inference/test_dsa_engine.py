"""The engine on DeepSeek Sparse Attention (a tiny random DeepseekV32ForCausalLM whose queries keep 4 keys): the
latent pool keeps each token's indexer key after its latent row, prefill chunks and decodes (absorbed) each take
their top-k keys by the indexer's scores over their sequence's cached keys, and the greedy output is transformers'
under any batch composition, chunked prefill, prefix-cache hits and preemption (bf16 within its round-off). The
CPU attention kernel takes no top-k mask: the capability row refuses it."""

from __future__ import annotations

import pytest

from megapipe.errors import ConfigError
from megapipe.inference import LLMEngine, SamplingParams
from megapipe.models.transformer import kv_cache_values_per_token
from tests.helpers.hf_tiny import hf_greedy, make_hf_dir
from tests.inference.test_engine import GREEDY, PROMPTS, run_staggered
from tests.inference.test_mla_engine import assert_bf16_within_round_off, assert_prefix_hits_and_logprobs

KV_RANK, ROPE, INDEX, LAYERS = 16, 8, 16, 2


@pytest.fixture(scope="module")
def deepseek32(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("deepseek32"), "deepseek_v32")


def test_the_pool_keeps_the_indexer_key_and_the_kernel_is_refused(deepseek32):
    engine = LLMEngine.from_pretrained(deepseek32[0], device="cpu", num_blocks=16)
    pool = engine.pool
    assert pool.latent and pool.k[0].shape == (1, 16 * 16, KV_RANK + ROPE + INDEX)
    assert pool.bytes_per_token() == LAYERS * (KV_RANK + ROPE + INDEX) * 4
    assert pool.bytes_per_token() == kv_cache_values_per_token(engine.model_config)[0] * 4  # what plan counts
    assert engine.runner.attention_kernel is None
    with pytest.raises(ConfigError, match="CPU attention kernel does not serve DeepSeek-V3.2 "):
        LLMEngine.from_pretrained(deepseek32[0], device="cpu", num_blocks=16, cpu_kernels=True)


def test_greedy_equals_transformers_in_any_batch_composition(deepseek32, one_thread):
    path, hf = deepseek32
    want = {i: hf_greedy(hf, p, 12) for i, p in enumerate(PROMPTS)}
    greedy = SamplingParams(max_tokens=12, **GREEDY)
    engine = LLMEngine.from_pretrained(path, device="cpu")
    assert engine.generate([PROMPTS[3]], greedy)[0].outputs[0].token_ids == want[3]  # batch 1
    assert run_staggered(engine, PROMPTS, greedy) == want  # decodes beside prefills of mixed lengths
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)] == list(want.values())
    chunked = LLMEngine.from_pretrained(path, device="cpu", max_num_batched_tokens=12, prefix_caching=False)
    assert run_staggered(chunked, PROMPTS, greedy, every=1) == want
    small = LLMEngine.from_pretrained(path, device="cpu", block_size=4, num_blocks=16, max_model_len=64,
                                      max_num_batched_tokens=16)
    assert run_staggered(small, PROMPTS, SamplingParams(max_tokens=20, **GREEDY), every=1) == {
        i: hf_greedy(hf, p, 20) for i, p in enumerate(PROMPTS)}
    assert small.scheduler.num_preemptions > 0


def test_prefix_cache_hits_and_decode_logprobs(deepseek32, one_thread):
    """Continuations over cached rows (latents and indexer keys) give transformers' tokens and logprobs."""
    path, hf = deepseek32
    assert_prefix_hits_and_logprobs(LLMEngine.from_pretrained(path, device="cpu"), hf)


def test_bf16_decodes_within_round_off_of_fp32(deepseek32, one_thread):
    """bf16 (the indexer keys stored in bf16, its scores in fp32 as transformers computes them): greedy tokens'
    logprobs within bf16 round-off of transformers' fp32 forward, as the MLA engine's bound."""
    path, hf = deepseek32
    assert_bf16_within_round_off(LLMEngine.from_pretrained(path, device="cpu", dtype="bfloat16"), hf)
