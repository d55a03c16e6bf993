"""generate / generate_ids (the engine under a batch API): greedy == transformers, batched == one by one, seeds, stops."""

from __future__ import annotations

import pytest
import torch
import transformers

from megapipe.config import ModelConfig
from megapipe.dtypes import resolve_device
from megapipe.errors import MegapipeError
from megapipe.inference import generate, generate_ids
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


@pytest.mark.parametrize("shape", ["llama-gqa", "gpt2"])
def test_batched_equals_one_by_one(shape):
    model = make_model(**SHAPES[shape])
    for kw in (dict(), dict(temperature=1.0, seed=3)):
        batched = generate_ids(model, PROMPTS, 10, **kw)
        alone = [generate_ids(model, [p], 10, **kw)[0] for p in PROMPTS]
        assert batched == alone


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


def test_rope_length_limit_and_bad_devices_are_refused():
    model = make_model()  # RoPE: max_position_embeddings is a limit too (the model never saw later positions)
    assert model.cfg.position_embedding == "rope"
    with pytest.raises(MegapipeError, match=r"prompt 1 \(3 tokens\) \+ --max-new-tokens \(62\) exceeds .* = 64"):
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
