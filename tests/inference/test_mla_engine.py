"""The engine on multi-latent attention (a tiny random DeepseekV3ForCausalLM: q bottleneck, YaRN, interleaved rope,
MoE): its latent KV cache stores kv_lora_rank + rope dims per token and layer, decodes with the up-projections
absorbed, prefills expanded, and its greedy output is transformers' under any batch composition, on the torch path
and on megapipe's CPU attention kernel."""

from __future__ import annotations

import json

import pytest
import torch

from megapipe.inference import LLMEngine, SamplingParams, kernels
from megapipe.inference.kv_cache import ABSORB_ROWS, KVPool, PagedBatch
from megapipe.inference.runner import DecoderLayer
from megapipe.models import build_model
from megapipe.models.capabilities import require
from megapipe.models.mla import MLAttention
from megapipe.posttrain.rl.engine_sync import check_engine_weights
from tests.helpers.hf_tiny import hf_greedy, make_hf_dir
from tests.inference.test_engine import GREEDY, PROMPTS, run_staggered

KV_RANK, ROPE, LAYERS, HEADS, QK, V = 24, 8, 2, 4, 20, 10  # a latent row of 32: two AVX512 vectors, four AVX2 ones
KERNELS = [False, pytest.param(True, id="cpu_kernels")]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("deepseek"), "deepseek_v3", kv_lora_rank=KV_RANK)


def engine_on(path, cpu_kernels: bool, **config) -> LLMEngine:
    if cpu_kernels and kernels.attention_kernel_for(KV_RANK + ROPE, torch.float32, "cpu") is None:
        pytest.skip("megapipe's CPU attention kernel is not built here")
    engine = LLMEngine.from_pretrained(path, device="cpu", cpu_kernels=cpu_kernels, **config)
    assert (engine.runner.attention_kernel is not None) == cpu_kernels
    return engine


def test_the_pool_stores_one_latent_row_per_token_and_layer(deepseek):
    engine = LLMEngine.from_pretrained(deepseek[0], device="cpu", kv_cache_memory=1 << 20)
    pool = engine.pool
    assert pool.latent and pool.v is pool.k and pool.k[0].shape == (1, pool.num_blocks * 16, KV_RANK + ROPE)
    assert pool.bytes_per_token() == LAYERS * (KV_RANK + ROPE) * 4
    assert pool.num_blocks == (1 << 20) // (16 * 256)  # the memory given, in blocks of the latent rows
    # next to the per-head keys and values the same attention reads: layers x heads x (qk + v) values
    assert engine.kv_cache_line() == (f"{pool.num_blocks} KV blocks of 16, 256 KV bytes/token (GQA equivalent "
                                      f"{LAYERS * HEADS * (QK + V) * 4}, 3.8x)")
    assert engine.runner.layers is None  # the model's own forward: DecoderLayer runs q/k/v attention only
    assert not any(DecoderLayer.supports(b) for b in engine.runner.model.layers.values())


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_greedy_equals_transformers_in_any_batch_composition(deepseek, cpu_kernels, one_thread):
    path, hf = deepseek
    want = {i: hf_greedy(hf, p, 12) for i, p in enumerate(PROMPTS)}
    greedy = SamplingParams(max_tokens=12, **GREEDY)
    engine = engine_on(path, cpu_kernels)
    assert engine.generate([PROMPTS[3]], greedy)[0].outputs[0].token_ids == want[3]  # batch 1
    assert run_staggered(engine, PROMPTS, greedy) == want  # decodes beside prefills of mixed lengths
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)] == list(want.values())
    chunked = engine_on(path, cpu_kernels, max_num_batched_tokens=8, prefix_caching=False)
    assert run_staggered(chunked, PROMPTS, greedy, every=1) == want
    # 16 blocks of 4 tokens: five sequences together do not fit, the newest are preempted and recomputed
    small = engine_on(path, cpu_kernels, block_size=4, num_blocks=16, max_model_len=64, max_num_batched_tokens=16)
    assert run_staggered(small, PROMPTS, SamplingParams(max_tokens=20, **GREEDY), every=1) == {
        i: hf_greedy(hf, p, 20) for i, p in enumerate(PROMPTS)}
    assert small.scheduler.num_preemptions > 0
    assert engine.blocks.usage() == chunked.blocks.usage() == small.blocks.usage() == 0


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_prefix_cache_hits_and_decode_logprobs(deepseek, cpu_kernels, one_thread):
    """Continuations over cached latents give transformers' tokens; every decoded token's logprob (the absorbed
    form) is within 1e-4 of transformers' full forward over the same sequence."""
    path, hf = deepseek
    assert_prefix_hits_and_logprobs(engine_on(path, cpu_kernels), hf)


def assert_prefix_hits_and_logprobs(engine: LLMEngine, hf) -> None:
    """Three prompts sharing three blocks, the last two after the first: they hit its cached blocks, their greedy
    tokens are transformers', every logprob within 1e-4 of transformers' full forward."""
    system = list(range(10, 58))  # three full blocks of 16
    prompts = [system + [i, i + 1, i + 2] for i in (100, 120, 140)]
    params = SamplingParams(max_tokens=10, logprobs=0, **GREEDY)
    outs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    assert [o.num_cached_tokens for o in outs] == [0, 48, 48]
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        want = ref[len(prompt) - 1:-1].gather(1, torch.tensor(out.outputs[0].token_ids)[:, None])[:, 0]
        got = torch.tensor([lp for lp, _ in out.outputs[0].logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_bf16_decodes_within_round_off_of_fp32(deepseek, cpu_kernels, one_thread):
    """bf16 (packed matmuls, the absorbed decode in bf16): its greedy tokens' logprobs, teacher-forced through
    transformers in fp32 over the same sequence, within bf16 round-off (as the MoE engines' bound)."""
    path, hf = deepseek
    assert_bf16_within_round_off(engine_on(path, cpu_kernels, dtype="bfloat16"), hf)


def assert_bf16_within_round_off(engine: LLMEngine, hf) -> None:
    """A bf16 engine's greedy tokens' logprobs against transformers' fp32 forward over the same sequences."""
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, logprobs=0, **GREEDY))
    diffs = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
        want = ref[len(prompt) - 1:-1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
        diffs.append((torch.tensor([lp for lp, _ in out.outputs[0].logprobs]) - want).abs())
    diff = torch.cat(diffs)
    assert diff.median() <= 0.05 and diff.mean() <= 0.1, diff


@pytest.mark.parametrize("cpu_kernels", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rl_weight_sync_reaches_every_tensor_the_engine_computes_with(deepseek, dtype, cpu_kernels):
    """load_weights on an MLA engine (wkv_b kept plain for the absorbed decode, the rest packed, in bf16 for
    megapipe's own kernel where the CPU has AVX512-BF16): the weight check passes and the engine decodes as a fresh
    one built on the new weights."""
    first = LLMEngine.from_pretrained(deepseek[0], device="cpu", dtype=dtype, num_blocks=16, cpu_kernels=cpu_kernels)
    other = build_model(first.model_config, seed=7).to(dtype)
    state = {k: v.float() for k, v in other.state_dict().items()}
    first.load_weights(state)
    check_engine_weights(first, state)
    fresh = LLMEngine(other, None, first.config, eos_token_ids=[])
    greedy = SamplingParams(max_tokens=8, **GREEDY)
    assert first.generate(PROMPTS, greedy)[0].outputs[0].token_ids == fresh.generate(PROMPTS, greedy)[0].outputs[
        0].token_ids


@pytest.mark.parametrize("cpu_kernels", KERNELS)
@pytest.mark.parametrize("prompt", [7, ABSORB_ROWS + 1], ids=["short-chunks-absorbed", "chunks-expanded"])
def test_attend_latent_equals_attention_over_the_expanded_keys(deepseek, cpu_kernels, prompt):
    """One mixed step straight on the cache: two decodes over scattered cached latents, a continuation chunk and a
    new prompt give SDPA's output over the decompressed per-head keys and values (MLA's scale folded into q), both
    when the chunks attend row by row as decodes (all at most ABSORB_ROWS long) and when they are expanded."""
    engine = engine_on(deepseek[0], cpu_kernels, num_blocks=16)
    attention = next(m for m in engine.runner.model.modules() if isinstance(m, MLAttention))
    pool = KVPool(attention.layer_id + 1, 16, 4, 1, KV_RANK + ROPE, torch.float32, "cpu", latent=True)
    g = torch.Generator().manual_seed(0)
    pool.k[attention.layer_id].normal_(generator=g)
    decodes, chunks = [([3, 9, 1], 9), ([5, 2], 5)], [([7, 8, 4], 6, 5), ([0, 6, 10], 0, prompt)]
    total = len(decodes) + sum(n for _, _, n in chunks)
    q = torch.randn(1, HEADS, total, QK, generator=g)
    c_kv, k_rope = torch.randn(1, total, KV_RANK, generator=g), torch.randn(1, 1, total, ROPE, generator=g)
    batch = PagedBatch(pool, None, engine.runner.attention_kernel)
    batch.plan(decodes, chunks)
    with torch.no_grad():
        out = batch.attend_latent(attention, q, c_kv, k_rope)
        latents = pool.k[attention.layer_id][0]  # the new rows stored by now
        queries = [(blocks, pos, 1) for blocks, pos in decodes] + [(b, s + n - 1, n) for b, s, n in chunks]
        row = 0
        for blocks, last, n in queries:
            slots = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(last + 1)])
            cached = latents[slots][None]
            k, v = attention.expand(cached[..., :KV_RANK], cached[:, None, :, KV_RANK:])
            mask = torch.arange(last + 1)[None] <= torch.arange(last + 1 - n, last + 1)[:, None]
            want = torch.nn.functional.scaled_dot_product_attention(q[:, :, row:row + n], k, v, attn_mask=mask)
            torch.testing.assert_close(out[:, :, row:row + n], want, atol=1e-5, rtol=1e-5)
            row += n


def test_attend_latent_needs_a_latent_pool(deepseek):
    engine = LLMEngine.from_pretrained(deepseek[0], device="cpu", num_blocks=16)
    attention = next(m for m in engine.runner.model.modules() if isinstance(m, MLAttention))
    batch = PagedBatch(KVPool(2, 4, 4, 4, QK, torch.float32, "cpu"))
    batch.plan([([0], 0)], [])
    with pytest.raises(ValueError, match="attend_latent needs a latent KV pool"):
        batch.attend_latent(attention, torch.zeros(1, HEADS, 1, QK), torch.zeros(1, 1, KV_RANK),
                            torch.zeros(1, 1, 1, ROPE))
    with pytest.raises(ValueError, match="one row per token and layer, not 4 kv heads"):
        KVPool(2, 4, 4, 4, QK, torch.float32, "cpu", latent=True)


@pytest.mark.parametrize("stage", ["generate", "serve", "eval", "rl"])
def test_the_capability_row_opens_the_engine_stages(deepseek, stage):
    cfg = LLMEngine.from_pretrained(deepseek[0], device="cpu", num_blocks=16).model_config
    require(cfg, stage, engine=["paged_kv", "prefix_caching", "chunked_prefill", "cpu_kernels"])


def test_generate_stage_on_a_deepseek_directory(deepseek, capsys):
    """The generate stage passes the capability check and prints the engine's completion."""
    from megapipe.cli import main

    path, _ = deepseek
    want = LLMEngine.from_pretrained(path, device="cpu").generate(
        ["The quick"], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0].text
    assert main(["generate", str(path), "--prompt", "The quick", "--max-new-tokens", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"prompt": "The quick", "completion": want}]
