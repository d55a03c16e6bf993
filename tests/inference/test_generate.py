"""Generation: KV cache == full recompute, batched == one by one, greedy == transformers, sampling filters, stops."""

from __future__ import annotations

import pytest
import torch
import transformers

from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError
from megapipe.inference import KVCache, filter_logits, generate, generate_ids, pick_next, resolve_device
from megapipe.models import build_model
from tests.helpers.hf_reference import copy_hf_weights

V = 300
PROMPTS = [[5, 17, 9, 33, 2, 71, 8], [44, 3], [100, 101, 102, 7]]
SHAPES = {  # large init_std: peaked logits, so argmax is not decided by round-off
    "llama-gqa": dict(num_kv_heads=2),
    "mistral-window": dict(num_kv_heads=2, sliding_window=3),
    "qwen3": dict(num_kv_heads=2, qk_norm=True, head_dim=12, qkv_bias=True),
    "gpt2": dict(norm_type="layernorm", activation="gelu_tanh", position_embedding="learned", qkv_bias=True,
                 attn_out_bias=True, mlp_bias=True, tie_embeddings=True),
}


def make_model(**kw):
    base = dict(vocab_size=V, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, init_std=0.3,
                max_position_embeddings=64)
    return build_model(ModelConfig(**{**base, **kw}), seed=0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from megapipe.data.tokenizer import train_tokenizer

    texts = ["The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine.",
             "To be, or not to be, that is the question."] * 20
    return train_tokenizer(texts, vocab_size=V, output=tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cache_equals_full_recompute(shape):
    model = make_model(**SHAPES[shape])
    for kw in (dict(), dict(temperature=0.9, top_k=50, top_p=0.95, seed=7)):
        cached = generate_ids(model, PROMPTS, 12, **kw)
        recomputed = generate_ids(model, PROMPTS, 12, use_cache=False, **kw)
        assert cached == recomputed
        assert all(len(c) == 12 for c in cached)


@pytest.mark.parametrize("shape", ["llama-gqa", "gpt2"])
def test_batched_equals_one_by_one(shape):
    model = make_model(**SHAPES[shape])
    for kw in (dict(), dict(temperature=1.0, seed=3)):
        batched = generate_ids(model, PROMPTS, 10, **kw)
        alone = [generate_ids(model, [p], 10, **kw)[0] for p in PROMPTS]
        assert batched == alone


@pytest.mark.parametrize("shape", ["llama-gqa", "mistral-window"])
def test_cache_in_chunks_matches_full_forward(shape):
    """Prefill, one token, then a chunk of three: the unmasked fast path and the masked path."""
    model = make_model(**SHAPES[shape])
    seq = torch.tensor([PROMPTS[0] + [11, 12]])
    cache = KVCache.for_model(model, 1, 12)
    with torch.no_grad():
        full = model(seq)
        parts = [model(seq[:, :5], cache=cache), model(seq[:, 5:6], cache=cache), model(seq[:, 6:], cache=cache)]
    assert (torch.cat(parts, dim=1) - full).abs().max() < 1e-4


def test_cache_logits_match_full_forward_with_left_padding():
    model = make_model(**SHAPES["mistral-window"])
    seq = torch.tensor([PROMPTS[0] + [11, 12, 13]])
    full = model(seq)[0]
    cache = KVCache.for_model(model, 2, 16)  # logits are O(5) here (init_std 0.3): 1e-4 is fp32 round-off
    tokens = torch.tensor([[0, 0, 0] + PROMPTS[0][:4], PROMPTS[0]])  # row 0: 3 pads, then 4 tokens
    real = tokens != 0
    real[1] = True
    cache.set_padding(real)
    with torch.no_grad():
        first = model(tokens, (real.cumsum(1) - 1).clamp(min=0), cache)
        assert (first[0, 3:] - full[:4]).abs().max() < 1e-4
        assert (first[1] - full[:7]).abs().max() < 1e-4
        nxt = model(torch.tensor([[PROMPTS[0][4]], [11]]), torch.tensor([[4], [7]]), cache)
        assert (nxt[0, 0] - full[4]).abs().max() < 1e-4
        assert (nxt[1, 0] - full[7]).abs().max() < 1e-4


def test_greedy_matches_transformers_generate():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.3, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    model = make_model(num_kv_heads=2)
    copy_hf_weights(hf, model)
    ours = generate_ids(model, PROMPTS, 15)
    for prompt, mine in zip(PROMPTS, ours, strict=True):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=15, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ref[0, len(prompt):].tolist() == mine


def test_filter_logits_by_hand():
    logits = torch.tensor([[0.5, 0.05, 0.3, 0.15]]).log()
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw))[0].nonzero().flatten().tolist()  # noqa: E731
    assert kept(top_k=2) == [0, 2]
    assert kept(top_k=0) == [0, 1, 2, 3]
    assert kept(top_p=0.4) == [0]
    assert kept(top_p=0.75) == [0, 2]
    assert kept(top_p=0.85) == [0, 2, 3]
    assert kept(top_k=1, top_p=0.99) == [0]
    assert kept(top_k=3, top_p=0.99) == [0, 2, 3]
    two_rows = filter_logits(torch.stack([logits[0], logits[0].flip(0)]), top_k=1)
    assert torch.isfinite(two_rows).nonzero().tolist() == [[0, 0], [1, 3]]


def test_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([[0.5, 0.05, 0.3, 0.15]]).log()
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([pick_next(logits, 1.0, 2, 1.0, [g]) for _ in range(2000)])
    assert set(draws.tolist()) == {0, 2}
    assert (draws == 0).float().mean().item() == pytest.approx(0.5 / 0.8, abs=0.04)
    assert pick_next(logits, 0.0, 0, 1.0, []).tolist() == [0]


def test_seed_reproducibility():
    model = make_model()
    a = generate_ids(model, PROMPTS, 10, temperature=1.5, seed=1)
    assert a == generate_ids(model, PROMPTS, 10, temperature=1.5, seed=1)
    assert a != generate_ids(model, PROMPTS, 10, temperature=1.5, seed=2)


def test_eos_and_stop_strings_end_generation(tokenizer):
    model = make_model(**SHAPES["gpt2"])
    prompt = "The quick brown"
    full = generate(model, tokenizer, [prompt], 20)[0]
    full_ids = generate_ids(model, [tokenizer.encode(prompt)], 20)[0]
    assert tokenizer.decode(full_ids) == full and len(full_ids) == 20
    eos = full_ids[5]
    assert generate_ids(model, [tokenizer.encode(prompt)], 20, eos_ids=[eos])[0] == full_ids[:full_ids.index(eos)]
    k = next(i for i in range(2, len(full) - 1) if full[i:i + 2].isalpha())
    stop = full[k:k + 2]
    assert generate(model, tokenizer, [prompt, prompt], 20, stop=[stop])[0] == full[:full.find(stop)]
    assert generate(model, tokenizer, [prompt], 20, stop=stop)[0] == full[:full.find(stop)]
    calls = []
    generate_ids(model, [tokenizer.encode(prompt)], 20, stop=lambda row, ids: calls.append(len(ids)) or len(ids) == 4)
    assert calls == [1, 2, 3, 4]  # stopped early, not only truncated


def test_bad_arguments_are_refused():
    model = make_model(**SHAPES["gpt2"])
    with pytest.raises(MegapipeError, match="--top-p = 0"):
        generate_ids(model, PROMPTS, 3, temperature=1.0, top_p=0.0)
    with pytest.raises(MegapipeError, match="--temperature = -1"):
        generate_ids(model, PROMPTS, 3, temperature=-1.0)
    with pytest.raises(MegapipeError, match="--top-k = -2"):
        generate_ids(model, PROMPTS, 3, top_k=-2)
    with pytest.raises(MegapipeError, match="prompt 2 has no tokens"):
        generate_ids(model, [[1], []], 3)
    with pytest.raises(MegapipeError, match="max_position_embeddings = 64"):
        generate_ids(model, PROMPTS, 60)
    cache = KVCache.for_model(model, 1, 4)
    with pytest.raises(MegapipeError, match="KV cache holds 4 tokens; 5"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


def test_rope_length_limit_and_bad_devices_are_refused():
    model = make_model()  # RoPE: max_position_embeddings is a limit too (the model never saw later positions)
    assert model.cfg.position_embedding == "rope"
    with pytest.raises(MegapipeError, match=r"prompt \(3 tokens\) \+ --max-new-tokens \(62\) exceeds .* = 64"):
        generate_ids(model, [[1, 2, 3]], 62)
    assert len(generate_ids(model, [[1, 2, 3]], 61)[0]) == 61
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(MegapipeError, match="--device 'bogus' is not a device"):
        resolve_device("bogus")
    if not torch.cuda.is_available():
        with pytest.raises(MegapipeError, match="--device 'cuda:1': no cuda device is available"):
            resolve_device("cuda:1")
    else:
        with pytest.raises(MegapipeError, match="this machine has"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
