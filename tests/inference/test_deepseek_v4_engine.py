"""The engine on DeepSeek-V4 (a tiny random DeepseekV4ForCausalLM: sliding, CSA and HCA layers, hyper-connections,
a hash-routed layer) through its compressed cache (megapipe.inference.compressed_cache): each token's key = value
head in the paged pool, given back behind the 6-token window, and the compressors' entries and carry in a state
slot per sequence. Its greedy output is transformers' (fp32) at batch 1, in a continuous batch of mixed lengths
with staggered arrivals, with chunked prefill (5 tokens a step: chunks end inside the compressors' blocks), and
with sequences preempted and recomputed; the longest prompt (37 tokens: 18 CSA entries, the indexer keeps 2) is
longer than the window and than several blocks. Prefix caching is off, as the capability table says.

The indexer has 8 heads here (the shared tiny config's 2): an entry scores exactly 0 when every head's relu is 0,
and torch's top-k breaks such ties by how many entries a row is ranked over, which differs between one prefill and
chunks of it (README, DeepSeek-V4); with 8 heads such ties are rare enough not to meet these prompts."""

from __future__ import annotations

import copy

import pytest
import torch

from megapipe.checkpoint.load import load_model
from megapipe.inference import EngineConfig, LLMEngine, SamplingParams
from megapipe.inference.kv_cache import eviction_window, kv_layout
from megapipe.models.transformer import compressed_kv_values
from tests.helpers.hf_tiny import hf_greedy, make_hf_dir
from tests.inference.test_engine import GREEDY, PROMPTS, run_staggered

STEPS = 12


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path, hf = make_hf_dir(tmp_path_factory.mktemp("deepseek_v4"), "deepseek_v4", index_n_heads=8)
    return path, hf, load_model(path, torch.device("cpu"), torch.float32).model


def engine_on(model, **config) -> LLMEngine:
    return LLMEngine(copy.deepcopy(model), config=EngineConfig(cpu_kernels=False, pack_weights=False, **config),
                     eos_token_ids=[])


def idle(engine: LLMEngine) -> bool:
    return engine.blocks.usage() == 0 and engine.states.num_free() == engine.states.num_slots


def test_greedy_equals_transformers_batched_chunked_and_preempted(v4, one_thread):
    path, hf, model = v4
    greedy = SamplingParams(max_tokens=STEPS, **GREEDY)
    want = {i: hf_greedy(hf, p, STEPS) for i, p in enumerate(PROMPTS)}
    engine = engine_on(model)
    cfg = engine.model_config
    assert kv_layout(cfg) == dict(kv_heads=1, head_dim=cfg.dim_per_head, latent=True)
    assert eviction_window(cfg) == cfg.sliding_window == 6 and not engine.prefix_caching
    assert engine.generate([PROMPTS[3]], greedy)[0].outputs[0].token_ids == want[3]  # batch 1
    # a one-token prompt: every block, the CSA layers' first (no block before it) too, completed by decodes
    assert engine.generate([[7]], greedy)[0].outputs[0].token_ids == hf_greedy(hf, [7], STEPS)
    assert run_staggered(engine, PROMPTS, greedy) == want
    chunked = engine_on(model, max_num_batched_tokens=5)
    assert run_staggered(chunked, PROMPTS, greedy, every=1) == want
    # 13 blocks of 4 tokens: ten sequences' windows do not fit, the newest are preempted and recomputed from their
    # tokens (their state slots given back and refilled)
    small = engine_on(model, block_size=4, num_blocks=13, max_model_len=52)
    assert [o.outputs[0].token_ids for o in small.generate(PROMPTS * 2, greedy)] == list(want.values()) * 2
    assert small.scheduler.num_preemptions > 0
    assert all(idle(e) for e in (engine, chunked, small))


def test_blocks_behind_the_window_are_given_back_and_aborts_free_the_slot(v4, one_thread):
    engine = engine_on(v4[2], block_size=4, max_model_len=128)
    engine.add_request("long", list(range(60, 120)), SamplingParams(max_tokens=20, **GREEDY))
    engine.add_request("other", PROMPTS[0], SamplingParams(max_tokens=20, **GREEDY))
    for _ in range(6):
        engine.step()
    seq = engine.requests["long"].seqs[0]
    held = len(seq.block_ids) - seq.num_evicted
    assert seq.num_computed > 60 and held <= -(-engine.model_config.sliding_window // 4) + 2
    assert engine.states.num_free() == engine.states.num_slots - 2
    engine.abort("long")
    engine.abort("other")
    assert idle(engine)


def test_kv_bytes_per_token_agree_with_plan(v4, one_thread):
    """What a sequence holds in the engine (its blocks in the window's pool, its entries) against ``plan``'s
    ``compressed_kv_values``: equal but for the window's whole blocks and the compressors' carry."""
    from megapipe.inference.compressed_cache import sequence_kv_bytes
    from megapipe.inference.state_cache import state_bytes_per_sequence

    engine = engine_on(v4[2], block_size=2, max_model_len=128)
    cfg = engine.model_config
    engine.add_request("0", list(range(1, 100)), SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    engine.step()  # gives back the blocks behind the window, computes position 99
    seq = engine.requests["0"].seqs[0]
    assert seq.num_computed == 100
    measured = sequence_kv_bytes(engine, seq)
    assert measured["entries"] == (compressed_kv_values(cfg, 100) - 4 * 6 * cfg.dim_per_head) * 4
    # the last 6 keys (positions 94..99, 3 whole blocks) of 4 layers: what plan counts for the window
    assert measured["window"] == 6 * 4 * cfg.dim_per_head * 4
    # a slot: entries for max_model_len tokens (CSA: 64 of 32 + 16 values, HCA: 32 of 32) and the carry
    carry = 2 * (4 * 2 * 64 + 4 * 2 * 32) + 2 * 4 * 32  # CSA: kv, gate and the block before, of 2 rows
    assert measured["carry"] == carry * 4
    assert engine.states.bytes_per_sequence() == state_bytes_per_sequence(v4[2], torch.float32, 128) == \
        (2 * 64 * (32 + 16) + 32 * 32 + carry) * 4
