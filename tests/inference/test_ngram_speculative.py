"""N-gram speculative decoding (``--speculative-method ngram``, megapipe/inference/speculative.py): prompt lookup
drafts, verified by the same rule as the MTP drafts; greedy output token-identical to decoding without drafts on a
model that accepts many of them, sampled output with the target distribution, the counts in /metrics, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.inference import LLMEngine, SamplingParams
from megapipe.inference.engine import EngineConfig
from megapipe.inference.speculative import accept_sampled, lookup
from megapipe.models import build_model
from tests.inference.test_speculative import CFG as SPEC_CFG
from tests.inference.test_speculative import (
    PERIOD,
    SAMPLES,
    V,
    assert_same_greedy,
    check_sampled_marginals,
    periodic_model,
)

CFG = replace(SPEC_CFG, mtp_num_layers=0)


@pytest.fixture(scope="module")
def copier():
    """A Llama without MTP modules trained to continue one periodic sequence: its greedy output repeats what the
    prompt holds, so most prompt-lookup drafts are accepted."""
    return periodic_model(CFG)


def engine(model, k=0, **config):
    config = {"block_size": 4, "num_blocks": 256, "max_n": 512, "speculative_method": "ngram",
              "prompt_lookup_max": 3, "prompt_lookup_min": 1, **config}
    return LLMEngine(model, None, EngineConfig(speculative_tokens=k, **config), eos_token_ids=[0])


def test_lookup_takes_the_longest_suffix_seen_before():
    # the 3-token suffix [1, 2, 3] occurred at 0 and 5; the latest with 2 tokens after it is 5
    assert lookup([1, 2, 3, 8, 9, 1, 2, 3, 7, 6, 1, 2, 3], 2, 3, 1) == [7, 6]
    assert lookup([1, 2, 3, 8, 9, 1, 2, 3, 7, 6, 1, 2, 3], 6, 3, 1) == [8, 9, 1, 2, 3, 7]  # 5: 5 after it
    assert lookup([5, 6, 7, 1, 9, 6, 7], 3, 3, 2) == [1, 9, 6]  # no 3-gram match: the 2-gram [6, 7]
    assert lookup([5, 6, 7, 1, 9, 6, 7], 3, 3, 3) == []  # nothing as long as prompt_lookup_min
    assert lookup([4, 4, 4], 5, 2, 1) == [4]  # the suffix itself is no match: only what follows an earlier one
    assert lookup([4], 3, 2, 1) == [] and lookup([1, 2, 1], 0, 2, 1) == []


def test_one_hot_drafts_keep_the_target_distribution():
    """A deterministic draft x (q one-hot) is kept with probability p(x), else the token is drawn from p without x:
    the emitted token follows p."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    n, first, kept = 8000, torch.zeros(4), 0
    for _ in range(n):
        out = accept_sampled([1], q, p, gen)
        first[out[0]] += 1
        kept += len(out) == 2
    assert 0.5 * float((first / n - p[0]).abs().sum()) < 0.03
    assert abs(kept / n - 0.3) < 0.02


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_token_identical(copier, k):
    """A continuous batch with penalties, min_tokens, stop ids and logprobs: the same tokens, finish reasons and
    logprobs as without drafts, in fewer steps (most drafts accepted), every block given back."""
    plain, spec = engine(copier, max_num_seqs=3), engine(copier, k, max_num_seqs=3)
    assert_same_greedy(plain, spec)
    assert spec.stats()["spec_decode_acceptance_rate"] > 0.5
    assert spec.num_steps < plain.num_steps
    assert spec.blocks.usage() == 0.0


def test_sampled_output_has_the_target_distribution(copier):
    """Many samples of the first three tokens of a prompt that repeats itself: with n-gram drafts (many kept, many
    rejected) the frequencies of tokens 2 and 3 match the model's exact marginals, as without drafts."""
    s = check_sampled_marginals(copier, lambda k: engine(copier, k, max_num_seqs=512, max_num_batched_tokens=4096),
                                PERIOD + PERIOD[:4], 2.0)
    assert s["spec_decode_num_draft_tokens"] > SAMPLES // 4 and 0.2 < s["spec_decode_acceptance_rate"] < 0.95, s


def test_acceptance_rate_reaches_the_metrics(copier):
    from prometheus_client import generate_latest

    from megapipe.inference.metrics import ServerMetrics

    e = engine(copier, 3)
    e.generate([PERIOD * 2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    s = e.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    text = generate_latest(ServerMetrics(e.stats, "m", e.max_model_len).registry).decode()
    assert (f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
            f'{float(s["spec_decode_num_accepted_tokens"])}') in text
    assert 'vllm:spec_decode_draft_acceptance_rate{model_name="m",position="all"} ' in text


def test_refusals():
    from megapipe.presets import PRESETS

    hybrid = build_model(ModelConfig(**{**PRESETS["nemotron-h-tiny"], "vocab_size": V}), seed=0)
    with pytest.raises(ConfigError, match="--speculative-method ngram verifies drafts by computing them and rolling "
                                          "back the rejected ones, which the recurrent state of this Nemotron-H"):
        engine(hybrid, 2)
    model = build_model(CFG, seed=0)
    with pytest.raises(ConfigError, match="--speculative-method = 'eagle' is not one of mtp, ngram"):
        engine(model, 2, speculative_method="eagle")
    with pytest.raises(ConfigError, match="--prompt-lookup-min = 4 exceeds --prompt-lookup-max = 3"):
        engine(model, 2, prompt_lookup_min=4)
    with pytest.raises(ConfigError, match="--prompt-lookup-max = 0 must be an integer >= 1"):
        engine(model, 2, prompt_lookup_max=0)
