"""The engine on a hybrid Transformer-Mamba model (a tiny random Nemotron-H pattern, fp32): KV blocks for its
attention layers only, a recurrent-state slot per sequence for its Mamba layers (megapipe.inference.state_cache),
and greedy output equal to the model's own full forward (no cache, token by token) at batch 1, in a continuous
batch of mixed lengths, with prompts prefilled in several chunks and with sequences preempted and recomputed, on the
torch path and on megapipe's CPU attention kernel; slots come back on finish and abort; no prefix caching."""

from __future__ import annotations

import copy

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.inference import EngineConfig, LLMEngine, SamplingParams, kernels
from megapipe.models import build_model
from tests.inference.test_engine import GREEDY, PROMPTS, run_staggered

TINY = dict(arch="nemotron_h", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4,
            num_kv_heads=2, activation="relu2", position_embedding="none", hybrid_override_pattern="M*-M*M",
            mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=4, max_position_embeddings=128,
            init_std=0.1)
KERNELS = [False, pytest.param(True, id="cpu_kernels")]
STEPS = 12


@pytest.fixture(scope="module")
def hybrid():
    """(model, greedy continuations of PROMPTS by its full forward, for STEPS and 20 tokens)."""
    model = build_model(ModelConfig(**TINY), seed=0).eval()
    want = {i: full_greedy(model, p, 20) for i, p in enumerate(PROMPTS)}
    return model, want


def full_greedy(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def engine_on(model, cpu_kernels: bool = False, **config) -> LLMEngine:
    if cpu_kernels and kernels.attention_kernel_for(model.cfg.dim_per_head, torch.float32, "cpu") is None:
        pytest.skip("megapipe's CPU attention kernel is not built here")
    engine = LLMEngine(copy.deepcopy(model), config=EngineConfig(cpu_kernels=cpu_kernels, **config), eos_token_ids=[])
    assert (engine.runner.attention_kernel is not None) == cpu_kernels
    return engine


def test_state_slots_beside_kv_blocks_of_the_attention_layers_only(hybrid):
    model, _ = hybrid
    engine = engine_on(model, max_num_seqs=4)
    assert sorted(engine.pool.k) == [1, 4]  # the '*' layers of M*-M*M: Mamba and MLP layers get no KV memory
    states = engine.states
    channels = 16 * 8 + 2 * 2 * 8  # x (heads 2 * 64 / 8 = 16, head dim 8) | B | C (2 groups of 8)
    for layer in (0, 3, 5):
        assert states.conv[layer].shape == (4, channels, 3) and states.conv[layer].dtype == torch.float32
        assert states.ssm[layer].shape == (4, 16, 8, 8) and states.ssm[layer].dtype == torch.float32
    per_seq = 3 * (channels * 3 + 16 * 8 * 8) * 4
    assert states.bytes_per_sequence() == per_seq
    kv = 2 * 2 * 2 * 16 * 4  # 2 layers x k, v x 2 kv heads x 16 dims x 4 bytes
    assert engine.kv_cache_line() == f"32 KV blocks of 16, {kv} KV bytes/token, {per_seq} state bytes/sequence x 4 sequences"
    assert engine.runner.layers is None  # the model's own forward (DecoderLayer knows no hybrid blocks)
    assert engine.runner.packed  # its linears packed: the mixer calls its projections as modules
    assert not engine.prefix_caching and not engine.blocks.prefix_caching
    with pytest.raises(Exception, match="--kv-cache-memory = 1000 bytes does not hold the recurrent state of "
                                        "--max-num-seqs 4 sequences"):
        engine_on(model, max_num_seqs=4, kv_cache_memory=1000)


def test_default_memory_caps_the_sequences_decoded_at_once_by_their_state(hybrid, monkeypatch, capsys):
    """Without --kv-cache-memory, states of --max-num-seqs sequences beyond STATE_MEMORY are not allocated: fewer
    sequences run at once (said on stderr), the rest wait, and every output is still the full forward's."""
    from megapipe.inference import engine as engine_module
    from megapipe.inference.state_cache import state_bytes_per_sequence

    model, want = hybrid
    per_seq = state_bytes_per_sequence(model, torch.float32)
    monkeypatch.setattr(engine_module, "STATE_MEMORY", 2 * per_seq + 1)
    engine = engine_on(model, max_num_seqs=64)
    assert engine.states.num_slots == 2 and engine.scheduler.max_num_seqs == 2
    assert "decoding 2 at once (set --kv-cache-memory to choose)" in capsys.readouterr().err
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=STEPS, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [want[i][:STEPS] for i in range(len(PROMPTS))]
    assert engine_on(model, max_num_seqs=64, kv_cache_memory=1 << 24).states.num_slots == 64  # as asked


def test_bf16_keeps_the_conv_window_in_the_model_dtype_and_the_ssm_state_in_fp32(hybrid):
    engine = LLMEngine(copy.deepcopy(hybrid[0]).to(torch.bfloat16), config=EngineConfig(max_num_seqs=2, cpu_kernels=False),
                       eos_token_ids=[])
    assert engine.states.conv[0].dtype == torch.bfloat16 and engine.states.ssm[0].dtype == torch.float32
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, **GREEDY))[0].outputs[0].token_ids
    assert len(out) == 4


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_greedy_equals_the_full_forward_in_any_batch_composition(hybrid, cpu_kernels, one_thread):
    model, want = hybrid
    short = {i: w[:STEPS] for i, w in want.items()}
    greedy = SamplingParams(max_tokens=STEPS, **GREEDY)
    engine = engine_on(model, cpu_kernels)
    assert engine.generate([PROMPTS[3]], greedy)[0].outputs[0].token_ids == short[3]  # batch 1
    assert run_staggered(engine, PROMPTS, greedy) == short  # decodes beside prefills of mixed lengths
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)] == list(short.values())
    same = [[9, 8, 7, 6, 5, 4, 3], PROMPTS[4], [1, 2, 3, 4, 5, 6, 7]]  # new prompts of one length: one batched scan
    assert [o.outputs[0].token_ids for o in engine.generate(same, greedy)] == [full_greedy(model, p, STEPS)
                                                                               for p in same]
    # 8 tokens a step: the long prompts are prefilled in several chunks, each from the state the last one left
    chunked = engine_on(model, cpu_kernels, max_num_batched_tokens=8)
    assert run_staggered(chunked, PROMPTS, greedy, every=1) == short
    # 16 blocks of 4 tokens: five sequences together do not fit, the newest are preempted and their state recomputed
    small = engine_on(model, cpu_kernels, block_size=4, num_blocks=16, max_model_len=64, max_num_batched_tokens=16)
    assert run_staggered(small, PROMPTS, SamplingParams(max_tokens=20, **GREEDY), every=1) == want
    assert small.scheduler.num_preemptions > 0
    for e in (engine, chunked, small):
        assert e.blocks.usage() == 0 and e.states.num_free() == e.config.max_num_seqs


def test_slots_are_taken_on_admission_and_returned_on_abort(hybrid, one_thread):
    engine = engine_on(hybrid[0], max_num_seqs=2)
    params = SamplingParams(max_tokens=30, **GREEDY)
    for i in range(3):
        engine.add_request(str(i), PROMPTS[i], params)
    engine.step()
    running = [s for r in engine.requests.values() for s in r.seqs if s.state_slot is not None]
    assert len(running) == 2 and engine.states.num_free() == 0
    assert engine.requests["2"].seqs[0].state_slot is None  # waiting: max_num_seqs are running
    engine.abort("0")
    assert engine.states.num_free() == 1 and "0" not in engine.requests
    engine.step()  # the waiting one is admitted into the freed slot
    assert engine.requests["2"].seqs[0].state_slot is not None and engine.states.num_free() == 0
    engine.abort("1")
    engine.abort("2")
    assert engine.states.num_free() == 2 and engine.blocks.usage() == 0


def test_no_prefix_cache_hits_and_no_kv_for_a_model_without_attention(hybrid, one_thread):
    """Shared prompts are recomputed (no state snapshots at block boundaries); a Mamba + MLP model runs with an
    empty KV pool."""
    model, _ = hybrid
    system = list(range(10, 58))  # three full blocks of 16
    prompts = [system + [i, i + 1] for i in (100, 120)]
    engine = engine_on(model, prefix_caching=True)
    greedy = SamplingParams(max_tokens=6, **GREEDY)
    outs = [engine.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert outs == [full_greedy(model, p, 6) for p in prompts]
    assert engine.stats()["prefix_cache_hits"] == 0
    no_attention = build_model(ModelConfig(**{**TINY, "hybrid_override_pattern": "M-M-", "num_layers": 4}), seed=1)
    engine = engine_on(no_attention.eval())
    assert engine.pool.num_layers == 0 and engine.pool.bytes_per_token() == 0
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == [
        full_greedy(no_attention, p, 6) for p in prompts]


def test_load_weights_reaches_the_packed_mixers(hybrid, one_thread):
    """New weights (an RL update) replace the Mamba mixers' packed projections (their five in-projections one
    matmul) and their conv / SSM parameters."""
    from megapipe.inference.runner import PackedMambaIn
    from megapipe.models.mamba import Mamba2Mixer

    model, _ = hybrid
    other = build_model(ModelConfig(**TINY), seed=3).eval()
    engine = engine_on(model)
    mixers = [m for m in engine.runner.model.modules() if isinstance(m, Mamba2Mixer)]
    assert mixers and all(isinstance(m.project, PackedMambaIn) and m.in_z is None for m in mixers)
    engine.load_weights(other.state_dict())
    greedy = SamplingParams(max_tokens=8, **GREEDY)
    assert engine.generate([PROMPTS[0]], greedy)[0].outputs[0].token_ids == full_greedy(other, PROMPTS[0], 8)


@pytest.mark.parametrize("arch", ["nemotron_h", "falcon_h1"])
def test_greedy_equals_transformers(arch, tmp_path, one_thread):
    """A tiny random NemotronHForCausalLM / FalconH1ForCausalLM (attention beside Mamba in one layer, its multipliers
    off 1) through the Hugging Face bridge: the engine's greedy tokens are transformers' generate's, at batch 1 and
    in a continuous batch of mixed prompt lengths with chunked prefill, on the default (packed) and the torch path."""
    from tests.helpers import hf_tiny

    path, hf = hf_tiny.make_hf_dir(tmp_path, arch)
    want = {i: hf_tiny.hf_greedy(hf, p, 10) for i, p in enumerate(PROMPTS)}
    greedy = SamplingParams(max_tokens=10, **GREEDY)
    for torch_path in (False, True):
        plain = dict(pack_weights=False, cpu_kernels=False) if torch_path else {}
        engine = LLMEngine.from_pretrained(path, device="cpu", **plain)
        assert engine.generate([PROMPTS[3]], greedy)[0].outputs[0].token_ids == want[3]
        chunked = LLMEngine.from_pretrained(path, device="cpu", max_num_batched_tokens=8, **plain)
        assert run_staggered(chunked, PROMPTS, greedy, every=1) == want
