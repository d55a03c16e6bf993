"""The engine on DeepSeek-V4 (a tiny random DeepseekV4ForCausalLM: sliding, CSA and HCA layers, hyper-connections,
a hash-routed layer): the pool keeps each token's attention input and every step recomputes the layers' attention
over the sequence's history (PagedBatch.attend_inputs). Its greedy output is transformers' in a continuous batch of
mixed lengths with staggered arrivals, and with chunked prefill (8 tokens a step, prompts longer than the window and
than several compression blocks); prefix caching is off, as the capability table says."""

from __future__ import annotations

import pytest

from megapipe.inference import LLMEngine, SamplingParams
from megapipe.inference.kv_cache import eviction_window, kv_layout
from tests.helpers.hf_tiny import hf_greedy, make_hf_dir
from tests.inference.test_engine import GREEDY, PROMPTS, run_staggered


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("deepseek_v4"), "deepseek_v4")


def test_greedy_equals_transformers_staggered_and_chunked(v4, one_thread):
    path, hf = v4
    greedy = SamplingParams(max_tokens=8, **GREEDY)
    want = {i: hf_greedy(hf, p, 8) for i, p in enumerate(PROMPTS)}
    engine = LLMEngine.from_pretrained(path, device="cpu")
    cfg = engine.model_config
    assert kv_layout(cfg) == dict(kv_heads=1, head_dim=cfg.hidden_size, latent=True)
    assert eviction_window(cfg) is None and not engine.prefix_caching
    assert run_staggered(engine, PROMPTS, greedy) == want
    chunked = LLMEngine.from_pretrained(path, device="cpu", max_num_batched_tokens=8, pack_weights=False,
                                        cpu_kernels=False)
    assert run_staggered(chunked, PROMPTS, greedy, every=1) == want
    assert engine.blocks.usage() == chunked.blocks.usage() == 0
