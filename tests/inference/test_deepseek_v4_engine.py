"""The engine on DeepSeek-V4 (a tiny random DeepseekV4ForCausalLM: sliding, CSA and HCA layers, hyper-connections,
a hash-routed layer) through its compressed cache (megapipe.inference.compressed_cache): each token's key = value
head in the paged pool, given back behind the 6-token window, the compressors' entries in blocks of their rate's
pool, taken as the sequence grows, and their carry in a state slot per sequence. Its greedy output is transformers'
(fp32) at batch 1, in a continuous batch of mixed lengths with staggered arrivals, with chunked prefill (5 tokens a
step: chunks end inside the compressors' blocks), and with sequences preempted and recomputed, for want of window
blocks or of entry blocks; the longest prompt (37 tokens: 18 CSA entries, the indexer keeps 2) is longer than the
window and than several blocks. Prefix caching is off, as the capability table says.

The indexer has 8 heads here (the shared tiny config's 2): an entry scores exactly 0 when every head's relu is 0,
and torch's top-k breaks such ties by how many entries a row is ranked over, which differs between one prefill and
chunks of it (README, DeepSeek-V4); with 8 heads such ties are rare enough not to meet these prompts."""

from __future__ import annotations

import copy

import pytest
import torch

from megapipe.checkpoint.load import load_model
from megapipe.errors import ConfigError
from megapipe.inference import EngineConfig, LLMEngine, SamplingParams
from megapipe.inference.compressed_cache import entry_blocks_for, kv_bytes_per_token, sequence_kv_bytes
from megapipe.inference.kv_cache import eviction_window, kv_layout
from megapipe.inference.state_cache import state_bytes_per_sequence
from megapipe.models.transformer import compressed_kv_values, kv_cache_values_per_token
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
    return (engine.blocks.usage() == 0 and engine.states.num_free() == engine.states.num_slots
            and all(b.usage() == 0 for b in engine.scheduler.entry_blocks.values()))


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


def test_entry_blocks_grow_with_the_sequence_and_are_given_back(v4, one_thread):
    """A sequence holds ceil(entries / block_size) blocks per rate for its computed tokens, step by step through
    chunked prefill and decoding; finishing and aborting give them back."""
    engine = engine_on(v4[2], block_size=2, max_model_len=128, max_num_batched_tokens=7)
    pools = engine.scheduler.entry_blocks
    assert sorted(pools) == [2, 4]  # CSA's rate, HCA's
    engine.add_request("long", list(range(1, 60)), SamplingParams(max_tokens=30, **GREEDY))
    engine.add_request("aborted", PROMPTS[3], SamplingParams(max_tokens=30, **GREEDY))
    seq, other = engine.requests["long"].seqs[0], engine.requests["aborted"].seqs[0]
    held = []
    while seq.status != "finished":
        engine.step()
        if seq.status == "finished":
            break
        for rate, blocks in pools.items():
            assert len(seq.entry_ids[rate]) == entry_blocks_for(seq.num_computed, rate, 2) == \
                -(-(seq.num_computed // rate) // 2)
            mine = len(seq.entry_ids[rate]) + len(other.entry_ids.get(rate, []))
            assert blocks.num_blocks - blocks.num_free() == mine
        held.append((seq.num_computed, len(seq.entry_ids[2]), len(seq.entry_ids[4])))
        if other.num_computed >= 12 and "aborted" in engine.requests:
            assert other.entry_ids[2]
            engine.abort("aborted")
            assert other.entry_ids == {} and all(b.num_blocks - b.num_free() == len(seq.entry_ids[r])
                                                 for r, b in pools.items())
    # 7 tokens: 3 CSA entries in 2 blocks of 2, 1 HCA entry; 87: 43 CSA entries in 22 blocks, 21 HCA in 11
    assert held[0] == (7, 2, 1) and held[-1] == (87, 22, 11)
    assert idle(engine)


def test_preempted_for_entry_blocks_and_recomputed(v4, one_thread):
    """--kv-cache-memory that holds the windows of 10 sequences but the entries of 2 of --max-model-len tokens:
    sequences are preempted when a rate's entry blocks run out, and recomputed to transformers' tokens."""
    path, hf, model = v4
    greedy = SamplingParams(max_tokens=STEPS, **GREEDY)
    probe = engine_on(model, block_size=4, max_model_len=52, max_num_seqs=10)
    window_blocks = 10 * (2 + 2) + probe.token_budget // 4  # each sequence's window, and a step's chunks
    assert probe.pool.num_blocks == window_blocks
    per_block = probe.pool.bytes_per_block(4, 4, 1, 32, torch.float32, True)
    one = sum(entry_blocks_for(52, r, 4) * probe.pool.entries.bytes_per_block(r) for r in (2, 4))
    memory = 10 * probe.states.bytes_per_sequence() + window_blocks * per_block + 2 * one
    engine = engine_on(model, block_size=4, max_model_len=52, max_num_seqs=10, kv_cache_memory=memory)
    assert engine.pool.num_blocks == window_blocks and engine.pool.entries.num_blocks == {2: 14, 4: 8}
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS * 2, greedy)] == want * 2
    assert engine.scheduler.num_preemptions > 0 and idle(engine)
    with pytest.raises(ConfigError, match="compressed entries of one sequence of --max-model-len 52"):
        engine_on(model, block_size=4, max_model_len=52, max_num_seqs=10, kv_cache_memory=memory - 2 * one + one - 1)


def test_kv_bytes_per_token_agree_with_plan(v4, one_thread):
    """What a sequence holds in the engine (its blocks in the window's pool, its entry blocks) against ``plan``'s
    ``compressed_kv_values``, from a few tokens to max_model_len: equal but for the window's whole blocks and each
    rate's last partial block (the compressors' carry is per sequence); the engine's default pools hold
    max_num_seqs sequences of max_model_len tokens at plan's bytes per token."""
    engine = engine_on(v4[2], block_size=2, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=9)
    cfg, hd = engine.model_config, engine.model_config.dim_per_head
    window = 6 * 4 * hd * 4  # the last 6 keys of 4 layers, fp32
    engine.add_request("0", list(range(1, 100)), SamplingParams(max_tokens=28, **GREEDY))
    seq = engine.requests["0"].seqs[0]
    seen = set()
    while seq.status != "finished":
        engine.step()
        if seq.status == "finished" or seq.num_computed < 6:
            continue
        n = seq.num_computed
        measured = sequence_kv_bytes(engine, seq)
        entries = (compressed_kv_values(cfg, n) - 4 * 6 * hd) * 4
        # each rate's last block partly filled: CSA (rate 2) entries of 32 + 16 values, HCA (rate 4) of 32
        partial = (n // 2 % 2) * (32 + 16) * 2 * 4 + (n // 4 % 2) * 32 * 4
        assert measured["entries"] == entries + partial
        # the window's keys in whole blocks of 2, the ones behind it given back at the next step's start
        assert window <= measured["window"] <= window + 4 * (2 + 9) * hd * 4
        seen.add(n)
    assert 100 in seen and max(seen) == 125
    # a slot: the carry alone (CSA: kv, gate and the block before, of 2 rows; HCA: kv, gate of 4 rows)
    carry = 2 * (4 * 2 * 64 + 4 * 2 * 32) + 2 * 4 * 32
    assert measured["carry"] == carry * 4
    assert engine.states.bytes_per_sequence() == state_bytes_per_sequence(v4[2], torch.float32) == carry * 4
    # the pools: entries for 4 sequences of 128 tokens (64 CSA, 32 HCA entries each), the window's blocks apart
    pool = engine.pool.entries
    assert pool.num_blocks == {2: 4 * 32, 4: 4 * 16}
    assert sum(n * pool.bytes_per_block(r) for r, n in pool.num_blocks.items()) == \
        4 * (compressed_kv_values(cfg, 128) - 4 * 6 * hd) * 4
    assert engine.pool.num_blocks == 4 * (3 + 2) + 5
    # the startup line's bytes per token at --max-model-len: plan's
    assert kv_bytes_per_token(engine.pool, 6, 128) == kv_cache_values_per_token(cfg, 128)[0] * 4
    assert f"{kv_cache_values_per_token(cfg, 128)[0] * 4:.1f} KV bytes/token at 128 tokens" in engine.kv_cache_line()
