"""N-gram speculative decoding (``--speculative-method ngram``, megapipe/inference/speculative.py): prompt lookup
drafts, verified by the same rule as the MTP drafts; greedy output token-identical to decoding without drafts on a
model that accepts many of them, sampled output with the target distribution, the counts in /metrics, refusals."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.inference import LLMEngine, SamplingParams
from megapipe.inference.engine import EngineConfig
from megapipe.inference.speculative import accept_sampled, lookup
from megapipe.models import build_model

V = 16
CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  init_std=0.3, max_position_embeddings=256)
PERIOD = [3, 9, 4, 12, 1, 7, 14]


@pytest.fixture(scope="module")
def copier():
    """A Llama without MTP modules trained to continue one periodic sequence: its greedy output repeats what the
    prompt holds, so most prompt-lookup drafts are accepted."""
    from megapipe.parallel.dims import ParallelDims
    from megapipe.parallel.step import train_step

    torch.manual_seed(0)
    model = build_model(CFG, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    row = torch.tensor(PERIOD * 5)
    mb = {"tokens": row[None, :-1].repeat(2, 1), "labels": row[None, 1:].repeat(2, 1)}
    for _ in range(60):
        train_step(model, [mb], ParallelDims())
        opt.step()
        opt.zero_grad()
    return model.eval()


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


PROMPTS = [PERIOD * 2, PERIOD[:3], [5, 6, 7, 8, 9, 10, 11, 2, 3], [2], PERIOD * 2 + [1, 1, 2]]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_token_identical(copier, k):
    """A continuous batch with penalties, min_tokens, stop ids and logprobs: the same tokens, finish reasons and
    logprobs as without drafts, in fewer steps (most drafts accepted), every block given back."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=17, temperature=0, repetition_penalty=1.3, min_tokens=5),
              SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[11], frequency_penalty=0.5),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=0)]
    plain = engine(copier, max_num_seqs=3)
    want = plain.generate(PROMPTS, params)
    spec = engine(copier, k, max_num_seqs=3)
    got = spec.generate(PROMPTS, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        if w.outputs[0].logprobs is not None:
            for (lw, tw), (lg, tg) in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert abs(lw - lg) < 1e-4 and [i for i, _ in tw] == [i for i, _ in tg]
    stats = spec.stats()
    assert stats["spec_decode_acceptance_rate"] > 0.5
    assert spec.num_steps < plain.num_steps
    assert spec.blocks.usage() == 0.0


def exact_marginals(model, prompt: list[int], temperature: float) -> list[torch.Tensor]:
    """P(t2), P(t3) [V] of the second and third sampled tokens, from the model's logits."""
    with torch.no_grad():
        t12 = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        seqs = torch.cat([torch.tensor(prompt).repeat(V * V, 1), t12], dim=1)
        probs = (model(seqs)[:, -3:] / temperature).softmax(dim=-1)
    joint = probs[0, 0][:, None, None] * probs[::V, 1][:, :, None] * probs[:, 2].view(V, V, V)
    return [joint.sum(dim=(0, 2)), joint.sum(dim=(0, 1))]


def test_sampled_output_has_the_target_distribution(copier):
    """Many samples of the first three tokens of a prompt that repeats itself: with n-gram drafts (many kept, many
    rejected) the frequencies of tokens 2 and 3 match the model's exact marginals, as without drafts."""
    prompt, temperature, n = PERIOD + PERIOD[:4], 2.0, 2048
    marginals = exact_marginals(copier, prompt, temperature)
    params = [SamplingParams(n=512, max_tokens=3, temperature=temperature, seed=r * 512, ignore_eos=True)
              for r in range(n // 512)]
    for k in (0, 2):
        e = engine(copier, k, max_num_seqs=512, max_num_batched_tokens=4096)
        counts = torch.zeros(2, V)
        for out in e.generate([prompt] * len(params), params):
            for o in out.outputs:
                counts[0, o.token_ids[1]] += 1
                counts[1, o.token_ids[2]] += 1
        # TV of 2048 draws over 16 ids is ~0.035; keeping every draft, or dropping the residual, is off by far more
        for c, m in zip(counts, marginals, strict=True):
            assert 0.5 * float((c / n - m).abs().sum()) < 0.075
        if k:
            s = e.stats()
            assert s["spec_decode_num_draft_tokens"] > n // 4 and 0.2 < s["spec_decode_acceptance_rate"] < 0.95, s


def test_acceptance_rate_reaches_the_metrics(copier):
    from prometheus_client import generate_latest

    from megapipe.inference.metrics import ServerMetrics

    e = engine(copier, 3)
    e.generate([PERIOD * 2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    s = e.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0
    text = generate_latest(ServerMetrics(e.stats, "m").registry).decode()
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
