"""Speculative decoding with the model's MTP modules (megapipe/inference/speculative.py): the acceptance rule keeps
the target distribution, greedy output is token-identical to decoding without drafts, sampled output has the same
distribution, the drafts are the MTP modules' (their KV cache kept exact across steps), and the refusals."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError, MegapipeError
from megapipe.inference import LLMEngine, SamplingParams
from megapipe.inference.engine import EngineConfig
from megapipe.inference.speculative import accept_greedy, accept_sampled
from megapipe.models import build_model
from megapipe.models.capabilities import require
from tests.dist.parallel_cases import MODELS

V = 16
CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  init_std=0.3, mtp_num_layers=2, max_position_embeddings=256)
PERIOD = [3, 9, 4, 12, 1, 7, 14]


@pytest.fixture(scope="module")
def random_model():
    return build_model(CFG, seed=0).eval()


@pytest.fixture(scope="module")
def mla_model():
    """DeepSeek-V3-shaped: multi-latent attention (its latent KV cache, the MTP blocks' too) and MoE, 2 MTP modules."""
    from megapipe.presets import PRESETS

    shape = {**PRESETS["deepseek-v3-tiny"], "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
             "num_heads": 4, "moe_ffn_hidden_size": 16, "moe_shared_expert_intermediate_size": 16,
             "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 8, "v_head_dim": 8}
    return build_model(ModelConfig(**{**shape, "vocab_size": V, "init_std": 0.3, "mtp_num_layers": 2,
                                      "max_position_embeddings": 256}), seed=0).eval()


@pytest.fixture(scope="module")
def trained_model():
    """Trained a few dozen steps on one periodic sequence: main model and MTP modules predict it, so most drafts are
    accepted (the paths where a whole draft and its bonus token are emitted)."""
    return periodic_model(CFG)


def periodic_model(cfg: ModelConfig):
    """A model of ``cfg`` trained 60 steps to continue PERIOD."""
    from megapipe.parallel.dims import ParallelDims
    from megapipe.parallel.step import train_step

    torch.manual_seed(0)
    model = build_model(cfg, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    row = torch.tensor(PERIOD * 5)
    mb = {"tokens": row[None, :-1].repeat(2, 1), "labels": row[None, 1:].repeat(2, 1)}
    for _ in range(60):
        train_step(model, [mb], ParallelDims())
        opt.step()
        opt.zero_grad()
    return model.eval()


def engine(model, k=0, **config):
    config = {"block_size": 4, "num_blocks": 256, "max_n": 512, **config}
    return LLMEngine(model, None, EngineConfig(speculative_tokens=k, **config), eos_token_ids=[0])


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_acceptance_rule_keeps_the_target_distribution():
    """Drafts from q, accepted by the rule against p: the first token follows p[0], the next (after an accepted
    draft) p[1]; and the first draft is accepted with probability sum(min(p, q))."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.1, 0.1, 0.2, 0.3, 0.3], [0.2] * 5])
    q = torch.tensor([[0.05, 0.05, 0.1, 0.4, 0.4], [0.6, 0.1, 0.1, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(0)
    n, first, second, accepted = 8000, torch.zeros(5), torch.zeros(5), 0
    for _ in range(n):
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = accept_sampled(draft, q, p, gen)
        first[out[0]] += 1
        if len(out) > 1:
            accepted += 1
            second[out[1]] += 1
    # TV of 8000 draws over 5 ids is ~0.015; a rule that dropped the residual or the ratio is off by > 0.2
    assert tv(first / n, p[0]) < 0.04
    assert tv(second / second.sum(), p[1]) < 0.05
    assert abs(accepted / n - float(torch.minimum(p[0], q[0]).sum())) < 0.025
    assert accept_greedy([1, 2, 3], [1, 2, 5, 9]) == [1, 2, 5] and accept_greedy([1, 2], [1, 2, 4]) == [1, 2, 4]
    assert accept_greedy([], [7]) == [7] and accept_greedy([4], [5, 6]) == [5]


PROMPTS = [PERIOD * 2, PERIOD[:3], [5, 6, 7, 8, 9, 10, 11, 2, 3], [2], PERIOD * 2 + [1, 1, 2]]


@pytest.mark.parametrize("model_name", ["random_model", "trained_model", "mla_model"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_output_is_token_identical(model_name, k, request):
    """A continuous batch of mixed prompt lengths (two sharing a cached prefix, staggered by max_num_seqs), with
    penalties, min_tokens, EOS and stop ids, logprobs; k = 4 reuses the last of the 2 MTP modules."""
    model = request.getfixturevalue(model_name)
    spec = engine(model, k, max_num_seqs=3)
    assert_same_greedy(engine(model, max_num_seqs=3), spec)
    stats = spec.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    assert spec.blocks.usage() == 0.0  # every block rolled back or returned
    if model_name == "trained_model":  # the drafts are worth something, and steps emit several tokens
        assert stats["spec_decode_acceptance_rate_per_pos"][0] > 0.5
        assert spec.num_steps < engine_steps(model, MIXED)


MIXED = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
         SamplingParams(max_tokens=17, temperature=0, repetition_penalty=1.3, min_tokens=5),
         SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[11], frequency_penalty=0.5),
         SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, presence_penalty=0.7, logprobs=0)]


def assert_same_greedy(plain, spec) -> None:
    """PROMPTS with the MIXED parameters through both engines: the same tokens, finish reasons and logprobs."""
    want, got = plain.generate(PROMPTS, MIXED), spec.generate(PROMPTS, MIXED)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        if w.outputs[0].logprobs is not None:
            for (lw, tw), (lg, tg) in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert abs(lw - lg) < 1e-4 and [i for i, _ in tw] == [i for i, _ in tg]


def engine_steps(model, params) -> int:
    e = engine(model, max_num_seqs=3)
    e.generate(PROMPTS, params)
    return e.num_steps


def test_drafts_are_the_mtp_chain_of_the_full_sequence(random_model):
    """Every draft at depth d equals what the training path's MTP depth d predicts from the whole sequence (accepted
    tokens + the drafts before it): the MTP modules' KV cache stays exact through rejections and rollbacks."""
    e = engine(random_model, 3)
    seen = []
    propose = e.speculator.propose

    def spy(seqs, tables):
        propose(seqs, tables)
        seen.extend((list(s.tokens), list(s.draft.tokens)) for s in seqs)

    e.speculator.propose = spy
    e.generate(PROMPTS[:3], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert len(seen) > 20
    with torch.no_grad():
        for tokens, draft in seen:
            for depth in range(1, min(len(draft), CFG.mtp_num_layers) + 1):
                _, full = random_model(torch.tensor([tokens + draft[:depth - 1]]), mtp=True)
                assert draft[depth - 1] == int(full[depth - 1][0, len(tokens) - 2].argmax())


def exact_pair_distribution(model, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] of the first three sampled tokens, from the model's logits."""
    with torch.no_grad():
        t12 = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        seqs = torch.cat([torch.tensor(prompt).repeat(V * V, 1), t12], dim=1)
        probs = (model(seqs)[:, -3:] / temperature).softmax(dim=-1)
    p1 = probs[0, 0]
    p2 = probs[::V, 1]  # [t1, t2]
    p3 = probs[:, 2].view(V, V, V)  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def test_sampled_output_has_the_target_distribution(random_model):
    """Many samples of the first three tokens of one prompt (tokens 2 and 3 are the first the drafts verify): the
    frequencies of t2 and of t3 match the model's exact marginals with speculation as without it."""
    stats = check_sampled_marginals(random_model, lambda k: engine(random_model, k, max_num_seqs=512,
                                                                    max_num_batched_tokens=4096), [3, 1, 4, 1, 5], 1.5)
    assert stats["spec_decode_num_draft_tokens"] >= SAMPLES


SAMPLES = 2048


def check_sampled_marginals(model, make_engine, prompt: list[int], temperature: float) -> dict:
    """SAMPLES draws of the first three tokens from ``make_engine(k)`` without drafts (k = 0) and with 2: the
    frequencies of t2 and t3 within sampling noise of the model's exact marginals; the speculating engine's stats."""
    exact = exact_pair_distribution(model, prompt, temperature)
    marginals = [exact.sum(dim=(0, 2)), exact.sum(dim=(0, 1))]
    params = [SamplingParams(n=512, max_tokens=3, temperature=temperature, seed=r * 512, ignore_eos=True)
              for r in range(SAMPLES // 512)]  # sample i of request r seeded r * 512 + i: every draw its own
    for k in (0, 2):
        e = make_engine(k)
        counts = torch.zeros(2, V)
        for out in e.generate([prompt] * len(params), params):
            for o in out.outputs:
                counts[0, o.token_ids[1]] += 1
                counts[1, o.token_ids[2]] += 1
        # TV of 2048 draws over 16 ids is ~0.035 (sd ~0.008); accepting every draft, or dropping the residual, is
        # off by far more
        for c, m in zip(counts, marginals, strict=True):
            assert tv(c / SAMPLES, m) < 0.075, (k, tv(c / SAMPLES, m))
    return e.stats()


def test_refusals_and_stats(random_model):
    plain = build_model(ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                    num_kv_heads=2), seed=0)
    with pytest.raises(ConfigError, match="--speculative-tokens 2 drafts with the model's multi-token prediction "
                                          "modules, and this Llama model has none"):
        engine(plain, 2)
    with pytest.raises(MegapipeError, match="generate of Llama models does not support engine speculative"):
        require(plain.cfg, "generate", engine=["speculative"])
    v32 = build_model(ModelConfig(**{**MODELS["dsa"], "vocab_size": V, "mtp_num_layers": 1}), seed=0)
    with pytest.raises(ConfigError, match="prediction modules, which DeepSeek-V3.2 .+ with MTP models cannot draft with yet"):
        engine(v32, 2)
    require(CFG, "serve", engine=["speculative"])
    with pytest.raises(ConfigError, match="--speculative-tokens = -1 must be an integer >= 0"):
        engine(random_model, -1)
    assert "spec_decode_acceptance_rate" not in engine(random_model).stats()


def test_acceptance_counts_reach_the_metrics(trained_model):
    from prometheus_client import generate_latest

    from megapipe.inference.metrics import ServerMetrics

    e = engine(trained_model, 3)
    e.generate([PERIOD * 2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    s = e.stats()
    assert s["spec_decode_num_accepted_tokens"] == sum(s["spec_decode_num_accepted_tokens_per_pos"]) > 0
    assert s["spec_decode_num_draft_tokens"] == sum(s["spec_decode_num_draft_tokens_per_pos"])
    assert s["spec_decode_acceptance_rate"] == s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_draft_tokens"]
    text = generate_latest(ServerMetrics(e.stats, "m", e.max_model_len).registry).decode()
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(s["spec_decode_num_accepted_tokens"])}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"}' in text
    assert 'vllm:spec_decode_draft_acceptance_rate{model_name="m",position="all"}' in text
    assert "spec_decode" not in generate_latest(ServerMetrics(engine(trained_model).stats, "m", 64).registry).decode()


def test_structured_output_is_not_drafted(trained_model):
    """A request with a grammar decodes without drafts (drafts are not checked against its grammar); a free request
    in the same batch still drafts, and the constrained output matches its regex."""
    import re

    import xgrammar as xgr

    from megapipe.inference.structured import Constraint, Grammars

    eng = engine(trained_model, 2)
    eng._grammars = Grammars(xgr.TokenizerInfo(["<eos>"] + [chr(ord("a") + i) for i in range(V - 1)],
                                               stop_token_ids=[0]))
    held = SamplingParams(max_tokens=8, temperature=0, structured=Constraint("regex", "[a-f]{4}"))
    (alone,) = eng.generate([PERIOD * 2], held)
    assert eng.stats()["spec_decode_num_drafts"] == 0
    assert re.fullmatch("[a-f]{4}", "".join(chr(ord("a") + t - 1) for t in alone.outputs[0].token_ids))
    free = SamplingParams(max_tokens=8, temperature=0)
    mixed = eng.generate([PERIOD * 2, PERIOD * 2], [held, free])
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert eng.stats()["spec_decode_num_drafts"] > 0
