"""Model structure: preset sizes (meta device), initialisation, FLOPs, and the hooks parallelism relies on."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig, from_dict
from megapipe.errors import ConfigError
from megapipe.models import build_model, count_params, flops_per_token

KNOWN_SIZES = {  # parameter counts of the published checkpoints
    "llama3-1b": 1_235_814_400,  # Llama-3.2-1B
    "llama3-8b": 8_030_261_248,  # Llama-3.1-8B
    "llama3-70b": 70_553_706_496,  # Llama-3.1-70B
    "qwen2.5-0.5b": 494_032_768,  # Qwen2.5-0.5B
    "gpt2-124m": 124_439_808,  # GPT-2 small
}


def small_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("name", list(KNOWN_SIZES))
def test_preset_parameter_counts_on_meta(name):
    model = build_model(from_dict(ModelConfig, {"preset": name}), device="meta")
    assert next(model.parameters()).device.type == "meta"
    assert count_params(model) == KNOWN_SIZES[name]


def test_tiny_preset_builds_and_runs():
    model = build_model(from_dict(ModelConfig, {"preset": "tiny", "vocab_size": 256}), seed=0)
    assert model.output is None  # tied
    assert model(torch.randint(0, 256, (2, 5))).shape == (2, 5, 256)


def test_build_needs_vocab_size():
    with pytest.raises(ConfigError, match="model.vocab_size"):
        build_model(ModelConfig())


def test_unknown_rope_scaling_type_is_refused():
    with pytest.raises(ConfigError, match="rope_type = 'yarn'"):
        build_model(small_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0}), device="meta")
    with pytest.raises(ConfigError, match="missing the key 'low_freq_factor'"):
        build_model(small_cfg(rope_scaling={"factor": 4.0}), device="meta")


def test_init_statistics_and_seed():
    cfg = small_cfg(hidden_size=256, intermediate_size=512, num_layers=8, qkv_bias=True, init_std=0.02)
    model = build_model(cfg, seed=1)
    layer = model.layers["3"]
    assert layer.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.attention.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert layer.feed_forward.w2.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert layer.feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(layer.attention.wq.bias, torch.zeros(cfg.hidden_size))
    assert torch.equal(model.norm.weight, torch.ones(cfg.hidden_size))
    same = build_model(cfg, seed=1)
    other = build_model(cfg, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters(), strict=True))
    assert not torch.equal(model.layers["0"].attention.wq.weight, other.layers["0"].attention.wq.weight)
    torch.manual_seed(5)
    model.init_weights()
    first = copy.deepcopy(model.state_dict())
    torch.manual_seed(5)
    model.init_weights()
    assert all(torch.equal(first[k], v) for k, v in model.state_dict().items())


def test_module_names_follow_the_interface():
    names = set(dict(build_model(small_cfg(qk_norm=True), device="meta").named_parameters()))
    for expected in ["tok_embeddings.weight", "layers.0.attention_norm.weight", "layers.2.attention.wq.weight",
                     "layers.0.attention.wk.weight", "layers.0.attention.wv.weight", "layers.0.attention.wo.weight",
                     "layers.0.attention.q_norm.weight", "layers.0.attention.k_norm.weight",
                     "layers.0.ffn_norm.weight", "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
                     "layers.0.feed_forward.w3.weight", "norm.weight", "output.weight"]:
        assert expected in names
    gpt2 = build_model(small_cfg(norm_type="layernorm", activation="gelu_tanh", position_embedding="learned",
                                 tie_embeddings=True), device="meta")
    assert gpt2.pos_embeddings is not None and gpt2.output is None and gpt2.layers["0"].feed_forward.w3 is None
    assert "layers.0.attention_norm.bias" in dict(gpt2.named_parameters())


def test_flops_per_token_by_hand():
    cfg = small_cfg(num_layers=2)
    hd = 16
    attn = 64 * (4 + 2 * 2) * hd + 4 * hd * 64
    mlp = 3 * 64 * 96
    n = 2 * (attn + mlp) + 64 * 101
    assert flops_per_token(cfg, 10) == 6 * n + 12 * 2 * 4 * hd * 10
    # the weight part equals 6x the non-embedding parameters plus the (tied) output head, minus norms
    model = build_model(cfg, device="meta")
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert flops_per_token(cfg, 0) == 6 * (count_params(model, exclude_embeddings=True) - norms)


def test_tensor_parallel_head_sharding_works_with_local_heads():
    """Attention sharded by heads (as a TP plan does): the shard outputs sum to the full output."""
    torch.manual_seed(0)
    model = build_model(small_cfg(qkv_bias=True, qk_norm=True), seed=0)
    attn = model.layers["0"].attention
    x = torch.randn(2, 7, 64)
    positions = torch.arange(7)
    from megapipe.models.rope import inv_frequencies, rope_cos_sin

    rope = rope_cos_sin(positions, inv_frequencies(16, 10000.0, None), x.dtype)
    full = attn(x, rope)
    total = torch.zeros_like(full)
    for shard in range(2):  # 2 query heads and 1 kv head per shard
        part = copy.deepcopy(attn)
        q_rows, kv_rows = slice(32 * shard, 32 * (shard + 1)), slice(16 * shard, 16 * (shard + 1))
        with torch.no_grad():
            for lin, rows in ((part.wq, q_rows), (part.wk, kv_rows), (part.wv, kv_rows)):
                lin.weight = torch.nn.Parameter(lin.weight[rows])
                lin.bias = torch.nn.Parameter(lin.bias[rows])
            part.wo.weight = torch.nn.Parameter(part.wo.weight[:, q_rows])
        total += part(x, rope)
    assert (total - full).abs().max().item() < 1e-6


def test_pipeline_stages_compose_to_the_full_model():
    cfg = small_cfg(tie_embeddings=False)
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 101, (2, 6))
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["2"]
    first.norm = first.output = None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = None
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 6, 64)
        assert (last(hidden) - model(tokens)).abs().max().item() < 1e-6


def test_last_only_logits():
    model = build_model(small_cfg(), seed=0)
    tokens = torch.randint(0, 101, (2, 6))
    with torch.no_grad():
        assert (model(tokens, last_only=True) - model(tokens)[:, -1:]).abs().max().item() < 1e-6


def test_sdpa_is_replaceable():
    model = build_model(small_cfg(), seed=0)
    tokens = torch.randint(0, 101, (2, 6))
    ref = model(tokens)
    calls = []

    def math_attention(q, k, v):
        calls.append(q.shape)
        assert k.shape == v.shape == (2, 2, 6, 16) and q.shape == (2, 4, 6, 16)  # GQA: k/v keep 2 heads
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
        return F.softmax(scores, dim=-1) @ v

    for layer in model.layers.values():
        layer.attention.sdpa = math_attention
    assert (model(tokens) - ref).abs().max().item() < 1e-5
    assert len(calls) == 3


def test_bf16_autocast_runs_and_backward():
    model = build_model(small_cfg(), seed=0)
    tokens = torch.randint(0, 101, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3}, {"arch": "gpt2", "position_embedding": "learned",
                                                             "norm_type": "layernorm", "activation": "gelu_tanh"}])
def test_packed_documents_equal_each_document_alone(kw):
    """A row holding three documents: each document's logits (and summed loss) equal the document run alone."""
    model = build_model(small_cfg(**kw), seed=0).double()
    lengths = [5, 2, 7]
    docs = [torch.randint(0, 101, (n,)) for n in lengths]
    packed = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    logits = model(packed, document_ids=doc_ids)
    alone = [model(d[None]) for d in docs]
    assert (logits[0] - torch.cat(alone, dim=1)[0]).abs().max().item() < 1e-10
    loss_packed = sum(F.cross_entropy(part[:-1], d[1:], reduction="sum")
                      for part, d in zip(logits[0].split(lengths), docs, strict=True))
    loss_alone = sum(F.cross_entropy(a[0, :-1], d[1:], reduction="sum") for a, d in zip(alone, docs, strict=True))
    assert abs(loss_packed.item() - loss_alone.item()) < 1e-9
    # without document ids the second document would see the first: a different result
    assert (model(packed)[0, 5:7] - alone[1][0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 4}])
def test_completions_after_a_shared_prefix_equal_each_continuation_alone(kw):
    """A row holding a prompt and then two continuations of it (prefix_ids: each continuation sees the prompt and
    itself, at the positions after the prompt): each continuation's logits equal prompt + continuation run alone."""
    model = build_model(small_cfg(**kw), seed=0).double()
    prompt, conts = torch.randint(0, 101, (4,)), [torch.randint(0, 101, (n,)) for n in (3, 5)]
    row = torch.cat([prompt, *conts])[None]
    doc_ids = torch.tensor([[0] * 4 + [1] * 3 + [2] * 5])
    prefix_ids = torch.zeros_like(doc_ids)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]])
    logits = model(row, positions=positions, document_ids=doc_ids, prefix_ids=prefix_ids)[0]
    alone = [model(torch.cat([prompt, c])[None])[0] for c in conts]
    assert (logits[:4] - alone[0][:4]).abs().max().item() < 1e-10
    assert (logits[4:7] - alone[0][4:]).abs().max().item() < 1e-10
    assert (logits[7:] - alone[1][4:]).abs().max().item() < 1e-10
    with pytest.raises(ValueError, match="prefix_ids name documents: give document_ids with them"):
        model(row, prefix_ids=prefix_ids)


def test_positions_restart_at_each_document():
    from megapipe.models.attention import positions_from_documents

    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [4, 4, 4, 4, 4, 4]])
    assert positions_from_documents(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
