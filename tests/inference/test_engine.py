"""The engine against transformers and against full forward passes: greedy parity under any batch composition
(staggered arrivals, chunked prefill, forced preemption, prefix-cache hits), logprobs, seeds, stops, limits."""

from __future__ import annotations

import pytest
import torch

from megapipe.errors import ConfigError
from megapipe.inference import LLMEngine, ParamError, SamplingParams
from tests.helpers.hf_tiny import hf_greedy, make_hf_dir

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 9, 33, 2, 71, 8, 19, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [44, 3], [100, 101, 102, 7],
           list(range(60, 97)), [250] * 5 + [251, 252]]


def run_staggered(engine: LLMEngine, prompts, params, every: int = 2, pick=lambda out: out.outputs[0].token_ids):
    """Add one request every ``every`` steps while earlier ones decode; returns ``pick(output)`` of each finished
    request (default: its token ids) by prompt index."""
    pending = list(enumerate(prompts))
    done = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = pick(out)
        step += 1
    return done


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral", "gpt2", "mixtral", "qwen2_moe",
                                        "qwen3_moe"])
def arch_dir(request, tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp(request.param), request.param)


def test_greedy_equals_transformers_with_staggered_arrivals(arch_dir, cpu_kernels, one_thread):
    """On both attention paths: mistral's and mixtral's sliding window (8) is shorter than most prompts."""
    path, hf = arch_dir
    want = {i: hf_greedy(hf, p, 12) for i, p in enumerate(PROMPTS)}
    engine = LLMEngine.from_pretrained(path, device="cpu", cpu_kernels=cpu_kernels)
    assert run_staggered(engine, PROMPTS, SamplingParams(max_tokens=12, **GREEDY)) == want
    # all at once, in one batch, and chunked prefill (8 tokens a step): the same tokens
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [want[i] for i in range(len(PROMPTS))]
    chunked = LLMEngine.from_pretrained(path, device="cpu", max_num_batched_tokens=8, prefix_caching=False,
                                        cpu_kernels=cpu_kernels)
    assert run_staggered(chunked, PROMPTS, SamplingParams(max_tokens=12, **GREEDY), every=1) == want
    assert engine.blocks.usage() == 0 and chunked.blocks.usage() == 0


def test_forced_preemption_gives_identical_tokens(hf_llama, cpu_kernels, one_thread):
    path, hf = hf_llama
    want = {i: hf_greedy(hf, p, 20) for i, p in enumerate(PROMPTS)}
    # 12 blocks of 4 tokens: one 57-token sequence fits, five together do not
    engine = LLMEngine.from_pretrained(path, device="cpu", block_size=4, num_blocks=16, max_model_len=64,
                                       max_num_batched_tokens=16, cpu_kernels=cpu_kernels)
    got = run_staggered(engine, PROMPTS, SamplingParams(max_tokens=20, **GREEDY), every=1)
    assert engine.scheduler.num_preemptions > 0
    assert got == want
    assert engine.blocks.usage() == 0


def test_prefix_cache_hits_give_identical_tokens(hf_llama, cpu_kernels, one_thread):
    path, hf = hf_llama
    system = list(range(10, 58))  # 48 tokens: three full blocks of 16
    prompts = [system + [i, i + 1, i + 2] for i in (100, 120, 140)]
    want = [hf_greedy(hf, p, 10) for p in prompts]
    engine = LLMEngine.from_pretrained(path, device="cpu", block_size=16, cpu_kernels=cpu_kernels)
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=10, **GREEDY))
    assert first[0].num_cached_tokens == 0
    rest = engine.generate(prompts[1:], SamplingParams(max_tokens=10, **GREEDY))
    assert [o.num_cached_tokens for o in rest] == [48, 48]
    assert [o.outputs[0].token_ids for o in first + rest] == want
    assert engine.blocks.hit_tokens == 96 and engine.blocks.hit_rate() == pytest.approx(96 / (3 * 51))
    # the whole prompt cached (a repeat): the last token is recomputed for its logits, the output is the same
    again = engine.generate(prompts[:1], SamplingParams(max_tokens=10, **GREEDY))
    assert again[0].num_cached_tokens == 48 and again[0].outputs[0].token_ids == want[0]


def full_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_logprobs_and_prompt_logprobs_equal_a_full_forward(hf_llama, one_thread):
    path, hf = hf_llama
    engine = LLMEngine.from_pretrained(path, device="cpu", max_num_batched_tokens=7)  # prompt in 3 chunks
    prompt = PROMPTS[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=4,
                                                   prompt_logprobs=3, ignore_eos=True))[0]
    gen = out.outputs[0].token_ids
    ref = full_logprobs(hf, prompt + gen)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        lp, top, rank = out.prompt_logprobs[p]
        assert abs(lp - ref[p - 1, prompt[p]].item()) < 1e-4
        assert rank == int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
        values, ids = ref[p - 1].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert max(abs(v - w) for (_, v), w in zip(top, values.tolist(), strict=True)) < 1e-4
    for j, (lp, top) in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + j]
        assert abs(lp - row[gen[j]].item()) < 1e-4  # the raw distribution, not the tempered one
        assert [t for t, _ in top] == row.topk(4).indices.tolist()


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_engine_factory, one_thread):
    engine = tiny_engine_factory()
    params = SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    mixed = [SamplingParams(max_tokens=9, temperature=1.3, ignore_eos=True), params,
             SamplingParams(max_tokens=20, temperature=0.7, top_k=5, seed=4, ignore_eos=True)]
    outs = engine.generate([PROMPTS[3], PROMPTS[0], PROMPTS[1]], mixed)
    assert outs[1].outputs[0].token_ids == alone
    staggered = tiny_engine_factory(max_num_batched_tokens=5)
    got = run_staggered(staggered, [PROMPTS[1], PROMPTS[3], PROMPTS[0]], params, every=3)
    assert got[2] == alone
    other = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=12,
                                                         ignore_eos=True))[0].outputs[0].token_ids
    assert other != alone
    # n samples: sample i uses seed + i, so the first equals the n=1 request
    many = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=11, n=3,
                                                        ignore_eos=True))[0]
    assert [o.index for o in many.outputs] == [0, 1, 2]
    assert many.outputs[0].token_ids == alone and many.outputs[1].token_ids == other
    assert many.num_generated_tokens == 45


def test_n_samples_share_the_prompt_through_the_prefix_cache(tiny_engine_factory):
    engine = tiny_engine_factory(block_size=16)
    prompt = list(range(1, 40))  # two full blocks
    out = engine.generate([prompt], SamplingParams(n=4, max_tokens=3, temperature=1.0, seed=0))[0]
    assert len(out.outputs) == 4
    assert engine.blocks.hit_tokens == 3 * 32  # the three later samples reuse the first one's two blocks


def test_eos_stop_tokens_min_and_max_tokens(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompt = PROMPTS[3]
    full = engine.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_tok = full.token_ids[4]
    first = full.token_ids.index(stop_tok)
    cut = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok]))[0]
    o = cut.outputs[0]
    assert o.token_ids == full.token_ids[:first] and o.finish_reason == "stop" and o.stop_reason == stop_tok
    assert cut.num_generated_tokens == first + 1  # the stop token was generated (usage counts it)
    engine.eos_token_ids = [stop_tok]
    eos = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert eos.token_ids == full.token_ids[:first] and eos.finish_reason == "stop"
    ignored = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert ignored.outputs[0].token_ids == full.token_ids
    late = engine.generate([prompt], SamplingParams(max_tokens=12, min_tokens=first + 2, temperature=0))[0].outputs[0]
    assert stop_tok not in late.token_ids[:first + 2] and len(late.token_ids) >= first + 2
    assert late.token_ids[:first] == full.token_ids[:first]


def test_stop_strings_across_token_boundaries(tiny_engine_factory):
    engine = tiny_engine_factory()
    tok = engine.tokenizer
    prompt = "The quick brown"
    full = engine.generate([prompt], SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0]
    assert full.text == tok.decode(full.token_ids)
    pieces = [tok.decode([t]) for t in full.token_ids]
    ends = [len("".join(pieces[:i + 1])) for i in range(len(pieces))]
    # a stop string made of the last character of one token and the first of the next
    k = next(i for i in range(1, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    stop = full.text[ends[k] - 1:ends[k] + 1]
    at = full.text.find(stop)
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop, "never-there"]))[0]
    o = out.outputs[0]
    assert o.text == full.text[:at] and o.finish_reason == "stop" and o.stop_reason == stop
    assert len(o.token_ids) < len(full.token_ids)
    assert stop not in o.text


def test_pool_accounting_abort_and_errors(tiny_engine_factory):
    engine = tiny_engine_factory()
    engine.add_request("a", PROMPTS[3], SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("b", PROMPTS[0], SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(3):
        engine.step()
    assert engine.blocks.usage() > 0 and engine.num_running() == 2
    aborted = engine.abort("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    engine.abort("b")
    assert engine.blocks.usage() == 0 and not engine.has_unfinished()
    limit = engine.max_model_len
    cut = engine.check_request(PROMPTS[3], SamplingParams(max_tokens=limit, min_tokens=limit))
    assert cut.max_tokens == cut.min_tokens == limit - len(PROMPTS[3])  # the context's room after the prompt
    with pytest.raises(ParamError, match=f"maximum context length is {limit} tokens") as e:
        engine.add_request("c", [1] * limit, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt"
    bad = {"temperature": -1.0, "top_p": 0.0, "top_k": -3, "min_p": 1.5, "n": 0, "max_tokens": 0,
           "repetition_penalty": 0.0, "presence_penalty": 3.0, "logprobs": 21, "seed": -1, "stop_token_ids": [10**6]}
    for name, value in bad.items():
        with pytest.raises(ParamError) as e:
            engine.add_request("d", [1, 2], SamplingParams(**{name: value}))
        assert e.value.param == name, name
    with pytest.raises(ParamError, match="prompt is empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ParamError, match="outside the vocabulary"):
        engine.add_request("f", [1, 10**6], SamplingParams())
    with pytest.raises(ParamError, match="temperature = nan must be a finite number"):
        engine.add_request("g", [1], SamplingParams(temperature=float("nan")))
    with pytest.raises(ConfigError, match="holds 2 blocks of 16 tokens"):
        tiny_engine_factory(block_size=16, num_blocks=2)
    with pytest.raises(ConfigError, match="--max-num-seqs = 0"):
        tiny_engine_factory(max_num_seqs=0)
    with pytest.raises(ConfigError, match=r"cannot allocate the KV cache of 100000000000 blocks \(\d+\.\d GiB\) on "
                                          r"cpu: give a smaller --kv-cache-memory / --num-blocks"):
        tiny_engine_factory(num_blocks=10**11)
    assert not engine.has_unfinished()


def test_a_step_that_can_schedule_nothing_with_work_waiting_raises(tiny_engine_factory):
    """A scheduler bug that leaves a sequence with nothing to compute (the state a prefix hit covering the whole
    prompt would leave) fails loudly instead of spinning forever."""
    from megapipe.inference.engine import EngineStalled

    engine = tiny_engine_factory()
    assert engine.step() == []  # idle: nothing to do is not a stall
    seq = engine.add_request("a", PROMPTS[1], SamplingParams(max_tokens=4)).seqs[0]
    seq.num_computed = len(seq.tokens)
    with pytest.raises(EngineStalled, match="no progress: 0 running and 1 waiting sequences"):
        engine.step()
    seq.num_computed = len(seq.tokens)  # (the failed admission reset it)
    with pytest.raises(EngineStalled):
        engine.run_to_completion([("b", PROMPTS[0], SamplingParams(max_tokens=4))])
    assert "b" not in engine.requests  # aborted on the way out


def test_bf16_packed_weights_give_the_same_tokens_and_logprobs(hf_llama, one_thread):
    """On CPU the engine swaps bf16 linears for oneDNN pre-packed ones, the MLP's SiLU and product fused into its
    matmuls (taken before rounding to bf16): the same tokens, log-probs within bf16 round-off of the plain ones."""
    path, _ = hf_llama
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)
    # the torch decode attention in both: only the matmuls differ
    packed = LLMEngine.from_pretrained(path, device="cpu", dtype="bfloat16", pack_weights=True, cpu_kernels=False)
    plain = LLMEngine.from_pretrained(path, device="cpu", dtype="bfloat16", pack_weights=False, cpu_kernels=False)
    if not packed.runner.packed:
        pytest.skip("oneDNN packed linears are not available in this torch build")
    a, b = packed.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    got = torch.tensor([lp for o in a for lp, _ in o.outputs[0].logprobs])
    want = torch.tensor([lp for o in b for lp, _ in o.outputs[0].logprobs])
    assert not torch.equal(got, want)  # the fused MLP does round differently
    torch.testing.assert_close(got, want, atol=0.1, rtol=0)


def test_a_long_prompt_is_chunked_without_stalling_running_decodes(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=30, **GREEDY)
    engine.add_request("a", PROMPTS[1], params)
    engine.add_request("b", PROMPTS[2], params)
    while len(engine.requests["b"].seqs[0].output_ids) < 2:
        engine.step()
    engine.add_request("long", list(range(1, 61)), SamplingParams(max_tokens=4, **GREEDY))
    steps = 0
    while engine.requests["long"].seqs[0].num_computed < 60:
        before = {r: len(engine.requests[r].seqs[0].output_ids) for r in ("a", "b")}
        engine.step()
        steps += 1
        assert all(len(engine.requests[r].seqs[0].output_ids) == before[r] + 1 for r in ("a", "b"))
    assert steps == 10  # 60 prompt tokens, 6 a step beside the two decodes


def test_prompt_logprobs_survive_preemption(hf_llama, one_thread):
    path, hf = hf_llama
    engine = LLMEngine.from_pretrained(path, device="cpu", block_size=4, num_blocks=16, max_model_len=64,
                                       max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=20, prompt_logprobs=1, **GREEDY)
    outs = run_staggered(engine, PROMPTS, params, every=1, pick=lambda out: out)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(PROMPTS):
        ref = full_logprobs(hf, p)
        got = outs[i].prompt_logprobs
        assert len(got) == len(p) and got[0] is None
        assert max(abs(got[j][0] - ref[j - 1, p[j]].item()) for j in range(1, len(p))) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_weights_replaces_the_model_and_empties_the_prefix_cache(dtype):
    """An engine given other weights decodes exactly as a fresh engine built on them (packed bf16 layers too)."""
    from megapipe.config import ModelConfig
    from megapipe.inference.engine import EngineConfig, LLMEngine
    from megapipe.inference.sampling import SamplingParams
    from megapipe.models import build_model

    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_position_embeddings=64)
    a, b = build_model(cfg, seed=1).to(dtype), build_model(cfg, seed=2).to(dtype)
    prompt = [[3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    engine = LLMEngine(a, None, EngineConfig(block_size=16, num_blocks=16), eos_token_ids=[])
    first = engine.generate(prompt, greedy)[0].outputs[0].token_ids
    assert engine.blocks.evictable  # the prompt's full block is cached
    engine.load_weights({k: v.float() for k, v in b.state_dict().items()})
    assert not engine.blocks.evictable
    again = engine.generate(prompt, greedy)[0].outputs[0].token_ids
    fresh = LLMEngine(build_model(cfg, seed=2).to(dtype), None, EngineConfig(block_size=16, num_blocks=16), eos_token_ids=[])
    assert again == fresh.generate(prompt, greedy)[0].outputs[0].token_ids != first


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_layer_fast_path_equals_the_model_forward(arch, dtype, tmp_path_factory, one_thread):
    """Dense and MoE blocks run through the runner's DecoderLayer: the same tokens and logprobs, bit for bit, as the
    model's own forward, in mixed steps (staggered arrivals: decodes and prefill chunks together), with biases
    (qwen2), q/k norms (qwen3, qwen3_moe), a sliding window (mistral, mixtral) and a gated shared expert beside dense
    layers (qwen2_moe). Without megapipe's CPU kernels, whose RMSNorm sums in its own order
    (tests/inference/test_kernels.py)."""
    path, _ = make_hf_dir(tmp_path_factory.mktemp(f"fast_{arch}"), arch)
    params = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    fast = LLMEngine.from_pretrained(path, device="cpu", dtype=dtype, max_num_batched_tokens=8, cpu_kernels=False)
    slow = LLMEngine.from_pretrained(path, device="cpu", dtype=dtype, max_num_batched_tokens=8, cpu_kernels=False)
    assert fast.runner.layers is not None
    slow.runner.layers = None  # the model's forward through PagedBatch.attend
    outs = [run_staggered(engine, PROMPTS, params, every=1,
                          pick=lambda out: (out.outputs[0].token_ids, out.outputs[0].logprobs))
            for engine in (fast, slow)]
    assert outs[0] == outs[1]


def test_the_fast_path_is_only_taken_by_plain_blocks(arch_dir):
    engine = LLMEngine.from_pretrained(arch_dir[0], device="cpu")
    cfg = engine.model_config
    assert (engine.runner.layers is None) == (cfg.position_embedding != "rope")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_in_bf16_and_at_batch_32(arch, tmp_path_factory, one_thread):
    """MoE on the engine's default path: the router stays a plain fp32 linear beside the packed ones, the experts
    run as one grouped GEMM per layer (in bf16 with megapipe's matmul kernel: PackedExperts); 32 sequences decoding
    together give what each gives alone, and bf16 agrees with fp32 within round-off: fp32's greedy tokens score
    log-probs within 0.05 (median) and 0.1 (mean) of fp32's in bf16. Single positions can differ by ~1 in bf16, plain modules' too: a
    routing decision flips between near-tied experts."""
    from megapipe.inference.runner import PackedLinear
    from megapipe.models.moe import MoE

    path, _ = make_hf_dir(tmp_path_factory.mktemp(f"moe_{arch}"), arch)
    engine = LLMEngine.from_pretrained(path, device="cpu")
    moes = [m for m in engine.runner.model.modules() if isinstance(m, MoE)]
    assert moes and all(type(m.gate) is torch.nn.Linear for m in moes)
    assert any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())
    prompts = [[(7 * i + j) % 300 + 3 for j in range(3 + i % 5)] for i in range(32)]
    greedy = SamplingParams(max_tokens=6, **GREEDY)
    together = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
    assert together[:3] + together[-2:] == [engine.generate([p], greedy)[0].outputs[0].token_ids
                                            for p in prompts[:3] + prompts[-2:]]

    # bf16 scores fp32's greedy continuations (teacher-forced: a near-tie flipped by a rounding would otherwise part
    # the two texts and compare log-probs of different tokens)
    fp32 = engine.generate(prompts[:8], SamplingParams(max_tokens=6, logprobs=0, **GREEDY))
    bf16_engine = LLMEngine.from_pretrained(path, device="cpu", dtype="bfloat16")
    texts = [p + o.outputs[0].token_ids for p, o in zip(prompts[:8], fp32, strict=True)]
    bf16 = bf16_engine.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))
    got = torch.tensor([lp for p, o in zip(prompts[:8], bf16, strict=True) for lp, *_ in o.prompt_logprobs[len(p):]])
    want = torch.tensor([lp for o in fp32 for lp, _ in o.outputs[0].logprobs])
    diff = (got - want).abs()
    assert diff.median() <= 0.05 and diff.mean() <= 0.1, diff


def test_packed_experts_match_the_grouped_gemm_and_take_new_weights(one_thread, monkeypatch):
    """In bf16 with megapipe's matmul kernel the engine runs MoE experts as PackedExperts (each 3-D weight one packed
    matmul, an expert a slice of it, only experts that got rows run): within bf16 round-off of the grouped GEMM
    against the fp32 product, empty experts included; load_weights re-packs them from the model's 3-D tensors, and
    the engine then decodes as a fresh one built on those weights."""
    from megapipe.config import ModelConfig
    from megapipe.inference import kernels
    from megapipe.inference.engine import EngineConfig
    from megapipe.inference.runner import PackedExperts, pack_linears
    from megapipe.models import build_model
    from megapipe.models.moe import GroupedExperts, expert_loop

    if not kernels.bf16_linear_built():
        pytest.skip("megapipe's bf16 matmul kernel is not built here (no AVX512-BF16)")
    torch.manual_seed(0)
    experts = GroupedExperts(4, 64, 96)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, 0.0, 0.1)
    holder = torch.nn.Module()
    holder.experts = experts.to(torch.bfloat16)
    x = torch.randn(11, 64).bfloat16()
    counts = torch.tensor([3, 0, 8, 0])
    with torch.inference_mode():
        exact = expert_loop(x.float(), counts, *(w.float() for w in (experts.w1, experts.w2, experts.w3)))
        grouped = experts(x, counts).float()
        assert pack_linears(holder, own=True) == 3 and isinstance(holder.experts, PackedExperts)
        packed = holder.experts(x, counts).float()
    assert not torch.equal(packed, grouped)  # the SiLU and product are taken before rounding
    assert (packed - exact).abs().max() <= 1.5 * (grouped - exact).abs().max()
    torch.testing.assert_close(packed, exact, atol=0.02, rtol=0.02)
    with torch.inference_mode(), monkeypatch.context() as m:  # gate and up as two calls, where not fused
        m.setattr(holder.experts, "glu", False)
        two_calls = holder.experts(x, counts).float()
    assert (two_calls - exact).abs().max() <= 1.5 * (grouped - exact).abs().max()
    torch.testing.assert_close(two_calls, exact, atol=0.02, rtol=0.02)

    cfg = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=64, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    a, b = (build_model(cfg, seed=s).to(torch.bfloat16) for s in (1, 2))
    greedy = SamplingParams(max_tokens=8, **GREEDY)
    engine = LLMEngine(a, None, EngineConfig(num_blocks=32), eos_token_ids=[])
    assert sum(isinstance(m, PackedExperts) for m in engine.runner.model.modules()) == 2
    first = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)]
    engine.load_weights({k: v.float() for k, v in b.state_dict().items()})
    again = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)]
    fresh = LLMEngine(build_model(cfg, seed=2).to(torch.bfloat16), None, EngineConfig(num_blocks=32), eos_token_ids=[])
    assert again == [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, greedy)] != first


def test_the_step_token_budget_defaults_by_device_and_a_given_one_wins():
    """--max-num-batched-tokens: 1024 by default on a CPU (a 2048-token chunk holds every decode ~0.3 s there), 2048
    elsewhere (vLLM's server's default), the given value on any device; the engine's scheduler plans with it, and a
    prompt longer than the budget is prefilled in chunks of it."""
    from megapipe.config import ModelConfig
    from megapipe.inference.engine import CPU_TOKEN_BUDGET, EngineConfig
    from megapipe.models import build_model

    assert EngineConfig().token_budget("cpu") == CPU_TOKEN_BUDGET == 1024
    assert EngineConfig().token_budget("cuda") == 2048
    assert EngineConfig(max_num_batched_tokens=300).token_budget("cpu") == 300
    with pytest.raises(ConfigError, match="--max-num-batched-tokens = 0 must be an integer >= 1"):
        EngineConfig(max_num_batched_tokens=0).check()
    cfg = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      max_position_embeddings=2048)
    engine = LLMEngine(build_model(cfg, seed=1), None, EngineConfig(num_blocks=160), eos_token_ids=[])
    assert engine.token_budget == engine.scheduler.max_num_batched_tokens == 1024
    engine.add_request("long", list(range(1, 90)) * 15, SamplingParams(max_tokens=1, temperature=0.0))
    chunks = []
    while engine.has_unfinished():
        before = engine.num_prompt_tokens
        engine.step()
        chunks.append(engine.num_prompt_tokens - before)
    assert chunks == [1024, 1335 - 1024]


def test_kv_blocks_are_128_tokens_on_a_cpu_where_every_layer_is_softmax_attention(tiny_engine_factory):
    """The block size's default: vLLM's CPU backend's 128 for plain attention on a CPU (a decode row's keys in runs
    the cores' prefetchers follow), 16 on other devices and for MLA / recurrent-state models (their tests say so:
    test_mla_engine.py, test_mamba_engine.py), the given size anywhere."""
    from megapipe.inference.engine import CPU_BLOCK_SIZE, EngineConfig

    assert EngineConfig().kv_block_size("cpu", plain_attention=True) == CPU_BLOCK_SIZE == 128
    assert EngineConfig().kv_block_size("cpu", plain_attention=False) == 16
    assert EngineConfig().kv_block_size("cuda", plain_attention=True) == 16
    assert EngineConfig(block_size=32).kv_block_size("cpu", plain_attention=True) == 32
    engine = tiny_engine_factory()
    assert engine.blocks.block_size == engine.pool.block_size == 128
    assert engine.kv_cache_line().split(",")[0].endswith("KV blocks of 128")
    with pytest.raises(ConfigError, match="--block-size = 0 must be an integer >= 1"):
        EngineConfig(block_size=0).check()
