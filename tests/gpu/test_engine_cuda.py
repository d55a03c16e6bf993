"""On a CUDA device the engine gives what it gives on a CPU: greedy tokens equal to transformers' (dense, sliding
window and MoE models; staggered arrivals, chunked prefill, preemption, prefix-cache hits), seeded sampling
reproducible, speculative decoding (MTP and n-gram) token-identical, a batch mixing LoRA adapters equal to the merged
models, a grammar-constrained row beside a free one, and ``serve --device cuda``'s engine-core process answering the
OpenAI client. fp32 throughout (the parity references are fp32 on the CPU)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from megapipe.checkpoint.load import load_model
from megapipe.inference import LLMEngine, SamplingParams
from megapipe.inference.engine import EngineConfig
from megapipe.inference.structured import Constraint
from tests.helpers.hf_tiny import hf_greedy, make_hf_dir
from tests.inference.test_engine import GREEDY, PROMPTS, run_staggered

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("hf_llama"), "llama")


@pytest.fixture(autouse=True, scope="module")
def exact_fp32():
    """fp32 matmuls in full precision (no TF32), as the CPU references compute them."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gpt2", "mixtral", "qwen2_moe"])
def test_greedy_equals_transformers(arch, tmp_path):
    path, hf = make_hf_dir(tmp_path, arch)
    want = {i: hf_greedy(hf, p, 12) for i, p in enumerate(PROMPTS)}
    engine = LLMEngine.from_pretrained(path, device=DEVICE)
    assert engine.device.type == "cuda"
    assert run_staggered(engine, PROMPTS, SamplingParams(max_tokens=12, **GREEDY)) == want
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [want[i] for i in range(len(PROMPTS))]
    chunked = LLMEngine.from_pretrained(path, device=DEVICE, max_num_batched_tokens=8, prefix_caching=False)
    assert run_staggered(chunked, PROMPTS, SamplingParams(max_tokens=12, **GREEDY), every=1) == want
    assert engine.blocks.usage() == 0 and chunked.blocks.usage() == 0


def test_preemption_and_prefix_hits(hf_llama):
    path, hf = hf_llama
    want = {i: hf_greedy(hf, p, 20) for i, p in enumerate(PROMPTS)}
    engine = LLMEngine.from_pretrained(path, device=DEVICE, block_size=4, num_blocks=16, max_model_len=64,
                                       max_num_batched_tokens=16)
    assert run_staggered(engine, PROMPTS, SamplingParams(max_tokens=20, **GREEDY), every=1) == want
    assert engine.scheduler.num_preemptions > 0
    system = list(range(10, 58))
    prompts = [system + [i, i + 1, i + 2] for i in (100, 120, 140)]
    cached = LLMEngine.from_pretrained(path, device=DEVICE)
    first = cached.generate(prompts[:1], SamplingParams(max_tokens=10, **GREEDY))
    rest = cached.generate(prompts[1:], SamplingParams(max_tokens=10, **GREEDY))
    assert [o.num_cached_tokens for o in rest] == [48, 48]
    assert [o.outputs[0].token_ids for o in first + rest] == [hf_greedy(hf, p, 10) for p in prompts]


def test_logprobs_and_seeded_sampling(hf_llama):
    path = hf_llama[0]
    cpu, gpu = (LLMEngine.from_pretrained(path, device=d) for d in ("cpu", DEVICE))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    for a, b in zip(cpu.generate(PROMPTS, params), gpu.generate(PROMPTS, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for (la, ta), (lb, tb) in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(la - lb) < 1e-4 and [i for i, _ in ta] == [i for i, _ in tb]
    sampled = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
               for s in (1, 1, 2)]
    outs = [gpu.generate([PROMPTS[0]], p)[0].outputs[0].token_ids for p in sampled]
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_speculative_decoding_is_token_identical():
    from tests.inference.test_ngram_speculative import CFG as NGRAM_CFG
    from tests.inference.test_speculative import CFG, assert_same_greedy, engine, periodic_model

    for cfg, method in ((CFG, "mtp"), (NGRAM_CFG, "ngram")):
        model = periodic_model(cfg).to(DEVICE)
        config = {"speculative_method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1} \
            if method == "ngram" else {}
        spec = engine(model, 3, max_num_seqs=3, **config)
        assert spec.device.type == "cuda"
        assert_same_greedy(engine(model, max_num_seqs=3), spec)
        assert spec.stats()["spec_decode_acceptance_rate"] > 0.5, method
        assert spec.blocks.usage() == 0.0


def test_lora_batch_equals_the_merged_models(hf_llama, tmp_path):
    from tests.inference import test_multi_lora as ml

    paths, _ = ml.make_adapters(hf_llama, tmp_path)
    hf_dir = hf_llama[0]
    want = {name: ml.merged_engine(hf_dir, paths.get(name)).generate(ml.PROMPTS, ml.GREEDY)
            for name in (None, "peft", "run")}
    loaded = load_model(hf_dir, torch.device(DEVICE), torch.float32)
    engine = LLMEngine(loaded.model, None, EngineConfig(block_size=4, num_blocks=256, max_loras=2),
                       eos_token_ids=[0])
    for name, path in paths.items():
        engine.load_lora(name, path)
    requests = [(p, name) for p in ml.PROMPTS for name in (None, "peft", "run")]
    for (prompt, name), out in zip(requests, ml.run(engine, requests), strict=True):
        got, ref = out, want[name][ml.PROMPTS.index(prompt)].outputs[0]
        assert got.token_ids == ref.token_ids, name
        for (lg, _), (lw, _) in zip(got.logprobs, ref.logprobs, strict=True):
            assert abs(lg - lw) <= 1e-4 * max(1.0, abs(lw))


def test_constrained_row_beside_a_free_one(hf_llama):
    engine = LLMEngine.from_pretrained(hf_llama[0], device=DEVICE)
    regex = Constraint("regex", r"[a-c]{3}-\d{2}")
    free = SamplingParams(max_tokens=10, temperature=0)
    held = SamplingParams(max_tokens=10, temperature=0, structured=regex)
    alone = [engine.generate(["hello world"], p)[0].outputs[0] for p in (free, held)]
    both = engine.generate(["hello world", "hello world"], [free, held])
    assert [o.outputs[0].token_ids for o in both] == [a.token_ids for a in alone]
    assert re.fullmatch(r"[a-c]{3}-\d{2}", alone[1].text)


def test_serve_on_cuda_answers_the_openai_client(hf_llama):
    from tests.inference.test_server import LiveServer

    server = LiveServer(hf_llama[0], engine_process=True, device=DEVICE)
    try:
        client = server.client()
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="hello", max_tokens=8, temperature=0, stream=True))
        assert text == r.choices[0].text
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "give a"}], max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        assert isinstance(json.loads(r.choices[0].message.content)["a"], int)
    finally:
        server.stop()


def test_the_kv_cache_takes_what_gpu_memory_utilization_leaves():
    """Without --kv-cache-memory / --num-blocks the pool gets --gpu-memory-utilization of the GPU less what is in use
    and a step's reserve (vLLM's sizing), where the batch wants more; the process stays inside that share while it
    decodes; a share too small for one sequence is refused with the figures."""
    import gc

    from megapipe.config import ModelConfig
    from megapipe.errors import ConfigError
    from megapipe.inference.device_memory import step_reserve
    from megapipe.inference.runner import widest_linear
    from megapipe.models import build_model

    # 4 layers x 2 x 8 kv heads x 128 x 2 bytes = 16 KiB of KV per token: 256 sequences of 32768 want 128 GiB
    cfg = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                      num_kv_heads=8, head_dim=128, max_position_embeddings=32768)
    model = build_model(cfg, seed=0).to(DEVICE, torch.bfloat16)
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization 0.001 allows .* leaving 0.00 GiB for the KV"):
        LLMEngine(model, None, EngineConfig(gpu_memory_utilization=0.001), eos_token_ids=[])
    share = 0.5
    free, total = torch.cuda.mem_get_info()
    reserve = step_reserve(256, widest_linear(model)[0], 1024, 2048, 256, 2)
    expected = int(share * total) - (total - free) - reserve
    engine = LLMEngine(model, None, EngineConfig(gpu_memory_utilization=share), eos_token_ids=[])
    try:
        pool = engine.pool
        kv = sum(t.numel() * t.element_size() for t in [*pool.k.values(), *pool.v.values()])
        assert 60 << 30 < kv <= expected + (64 << 20) and kv > expected - (64 << 20), (kv, expected)
        outs = engine.generate([[5, 6, 7] * 300] * 64, SamplingParams(max_tokens=16, **GREEDY))
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        free, total = torch.cuda.mem_get_info()
        assert total - free <= share * total
    finally:
        del engine
        gc.collect()
        torch.cuda.empty_cache()
