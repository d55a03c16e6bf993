"""Hybrid Transformer-Mamba (megapipe.models.mamba, ssd, hybrid): the Mamba-2 mixer against transformers'
NemotronHMamba2Mixer, the SSD scan against itself (chunked from a state, single steps, packed documents), a tiny
Nemotron-H-shaped model (trains a step, packed documents), the layer pattern and its config errors, and the
parameter count of the published 8B shape against transformers'."""

from __future__ import annotations

import pytest
import torch

from megapipe.config import ModelConfig, allocate_hybrid_layers, load_config
from megapipe.errors import ConfigError
from megapipe.models import build_model, count_params
from megapipe.models.mamba import Mamba2Mixer
from megapipe.models.ssd import causal_conv1d, ssd_chunked, ssd_step
from megapipe.parallel.plan import param_counts

MIXER = dict(arch="nemotron_h", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, hybrid_override_pattern="M",
             mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, mamba_num_heads=8, mamba_chunk_size=8,
             mamba_dt_limit_min=0.05, mamba_dt_limit_max=2.0)  # a clamp on dt both ends, as time_step_limit
TINY = dict(arch="nemotron_h", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=4,
            num_kv_heads=2, activation="relu2", position_embedding="none", hybrid_override_pattern="M*-M*M",
            mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=4)


def _mixer(seed: int = 0, **over) -> Mamba2Mixer:
    cfg = ModelConfig(**{**MIXER, **over})
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(cfg, 0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.3)
        mixer.init_weights()
        mixer.D.normal_(1, 0.3)
        mixer.norm.weight.normal_(1, 0.1)
    return mixer


def _hf_mixer(ours: Mamba2Mixer):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    m = ModelConfig(**MIXER)
    hf_cfg = NemotronHConfig(
        vocab_size=64, hidden_size=m.hidden_size, num_hidden_layers=1, hybrid_override_pattern="M",
        mamba_num_heads=m.mamba_heads, mamba_head_dim=m.mamba_head_dim, n_groups=m.mamba_num_groups,
        ssm_state_size=m.mamba_state_dim, chunk_size=m.mamba_chunk_size, conv_kernel=m.mamba_conv_kernel,
        layer_norm_epsilon=m.norm_eps, time_step_limit=m.mamba_dt_limit, use_conv_bias=True, mamba_proj_bias=False)
    hf = NemotronHMamba2Mixer(hf_cfg, 0).eval()
    with torch.no_grad():
        hf.in_proj.weight.copy_(torch.cat([ours.in_z.weight, ours.in_x.weight, ours.in_B.weight, ours.in_C.weight,
                                           ours.in_dt.weight]))
        weight, bias = ours.conv_params()
        hf.conv1d.weight.copy_(weight[:, None, :])
        hf.conv1d.bias.copy_(bias)
        for name in ("A_log", "D", "dt_bias"):
            getattr(hf, name).copy_(getattr(ours, name))
        hf.norm.weight.copy_(ours.norm.weight)
        hf.out_proj.weight.copy_(ours.out_proj.weight)
    return hf


@pytest.mark.parametrize("length", [1, 5, 8, 23])
def test_mixer_equals_transformers(length):
    ours = _mixer()
    hf = _hf_mixer(ours)
    x = torch.randn(2, length, 32, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)


def _ssm_inputs(b=2, s=21, h=4, p=3, g=2, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, p, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(b, s, h, generator=gen))
    A = -torch.rand(h, generator=gen) * 2 - 0.1
    B, C = torch.randn(b, s, g, n, generator=gen), torch.randn(b, s, g, n, generator=gen)
    D = torch.randn(h, generator=gen)
    return x, dt, A, B, C, D


def _reference_scan(x, dt, A, B, C, D, state=None):
    """The recurrence token by token, written out (float64)."""
    b, s, h, p = x.shape
    rep = h // B.shape[2]
    Bh, Ch = B.double().repeat_interleave(rep, 2), C.double().repeat_interleave(rep, 2)
    state = torch.zeros(b, h, p, B.shape[-1], dtype=torch.float64) if state is None else state.double()
    ys = []
    for t in range(s):
        decay = torch.exp(dt[:, t].double() * A.double())[..., None, None]
        state = decay * state + (dt[:, t].double()[..., None] * x[:, t].double())[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]) + D.double()[:, None] * x[:, t].double())
    return torch.stack(ys, 1), state


@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 7, 8, 32])
def test_chunked_scan_equals_the_recurrence(chunk, with_state):
    """21 tokens: chunks of 1, 4 (+3 padding), 7, 8 (evened out to 3 x 7) and 32 (one chunk of 21)."""
    x, dt, A, B, C, D = _ssm_inputs()
    init = torch.randn(2, 4, 3, 5) if with_state else None
    y, state = ssd_chunked(x, dt, A, B, C, chunk, D, init)
    ref_y, ref_state = _reference_scan(x, dt, A, B, C, D, init)
    torch.testing.assert_close(y.double(), ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, atol=1e-5, rtol=1e-5)


def test_chunked_scan_from_a_state_equals_one_shot():
    x, dt, A, B, C, D = _ssm_inputs(s=30)
    whole, final = ssd_chunked(x, dt, A, B, C, 8, D)
    first, mid = ssd_chunked(x[:, :11], dt[:, :11], A, B[:, :11], C[:, :11], 8, D)
    second, end = ssd_chunked(x[:, 11:], dt[:, 11:], A, B[:, 11:], C[:, 11:], 8, D, initial_state=mid)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)


def test_single_steps_equal_the_chunked_scan():
    x, dt, A, B, C, D = _ssm_inputs(s=13)
    whole, final = ssd_chunked(x, dt, A, B, C, 4, D)
    state = torch.zeros(2, 4, 3, 5)
    steps = []
    for t in range(13):
        y, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, 1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, final, atol=1e-5, rtol=1e-5)


def test_mixer_prefill_then_decode_equals_whole_sequence():
    mixer = _mixer()
    x = torch.randn(2, 19, 32)
    with torch.no_grad():
        z, xbc, dt = mixer.project(x)
        whole, conv_end, ssm_end = mixer.ssm(xbc, dt)
        y, conv, ssm = mixer.ssm(xbc[:, :10], dt[:, :10])  # a prefill in two chunks, then single tokens
        parts = [y]
        y, conv, ssm = mixer.ssm(xbc[:, 10:15], dt[:, 10:15], conv, ssm)
        parts.append(y)
        for t in range(15, 19):
            y, conv, ssm = mixer.ssm(xbc[:, t:t + 1], dt[:, t:t + 1], conv, ssm)
            parts.append(y)
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv, conv_end, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ssm, ssm_end, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [2, 3, 9])
@pytest.mark.parametrize("with_state", [False, True])
def test_conv_values_and_gradients_equal_torch_conv1d(length, with_state):
    """causal_conv1d's own forward and backward (input, incoming window, weight, bias) against autograd through
    F.conv1d (depthwise, the window or zeros in front), fp64; sequences shorter than the window (K-1 = 3) too."""
    g = torch.Generator().manual_seed(3)
    b, c, k = 2, 6, 4
    leaves = [t.double().requires_grad_() for t in (torch.randn(b, length, c, generator=g),
                                                    torch.randn(b, c, k - 1, generator=g),
                                                    torch.randn(c, k, generator=g), torch.randn(c, generator=g))]
    x, state, weight, bias = leaves
    weights = torch.randn(b, length, c, generator=g).double()
    y, _ = causal_conv1d(x, weight, bias, state if with_state else None)
    (y * weights).sum().backward()
    ours = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    front = state if with_state else torch.zeros_like(state)
    full = torch.cat([front, x.transpose(1, 2)], dim=-1)
    ref = torch.nn.functional.conv1d(full, weight[:, None], bias, groups=c).transpose(1, 2)
    torch.testing.assert_close(y, ref)
    (ref * weights).sum().backward()
    for i, (got, want) in enumerate(zip(ours, [t.grad for t in leaves], strict=True)):
        if i == 1 and not with_state:
            assert got is None
        else:
            torch.testing.assert_close(got, want, msg=f"input {i}")


# document lengths: boundaries inside chunks and on them, documents shorter than the conv window
DOCS = [[5, 1, 2, 9, 4], [8, 8, 5]]


def _doc_ids(lengths):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def test_packed_documents_equal_each_document_alone():
    x, dt, A, B, C, D = _ssm_inputs(b=1, s=21)
    for lengths in DOCS:
        ids = _doc_ids(lengths)[None]
        packed, final = ssd_chunked(x, dt, A, B, C, 4, D, initial_state=None, document_ids=ids)
        conv_in = torch.randn(1, 21, 6)
        weight, bias = torch.randn(6, 4), torch.randn(6)
        conv_packed, conv_state = causal_conv1d(conv_in, weight, bias, document_ids=ids)
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            alone, last = ssd_chunked(x[:, sl], dt[:, sl], A, B[:, sl], C[:, sl], 4, D)
            torch.testing.assert_close(packed[:, sl], alone, atol=1e-5, rtol=1e-5)
            conv_alone, conv_last = causal_conv1d(conv_in[:, sl], weight, bias)
            torch.testing.assert_close(conv_packed[:, sl], conv_alone, atol=1e-6, rtol=1e-6)
            start += n
        torch.testing.assert_close(final, last, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_state, conv_last, atol=1e-6, rtol=1e-6)


def test_document_reset_is_exact_under_fast_decay():
    """A document after one whose decays underflow: nothing of the first leaks into the second, bit for bit."""
    x, dt, A, B, C, D = _ssm_inputs(b=1, s=16)
    dt = dt * 1e4  # exp(dt * A) underflows within the first document
    ids = _doc_ids([7, 9])[None]
    packed, _ = ssd_chunked(x, dt, A, B, C, 16, D, document_ids=ids)
    x2 = x.clone()
    x2[:, :7] = 1e6  # the first document's inputs must not matter to the second's outputs
    other, _ = ssd_chunked(x2, dt, A, B, C, 16, D, document_ids=ids)
    assert torch.equal(packed[:, 7:], other[:, 7:])


def test_tiny_hybrid_model_trains_a_step_and_packs_documents():
    cfg = ModelConfig(**TINY)
    model = build_model(cfg, seed=0)
    kinds = [type(layer).__name__ for layer in model.layers.values()]
    assert kinds == ["MambaBlock", "AttentionBlock", "MLPBlock", "MambaBlock", "AttentionBlock", "MambaBlock"]
    tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient for {missing}"

    model.eval()
    a, b, c = tokens[:1, :6], tokens[1:, :5], tokens[:1, 6:9]
    with torch.no_grad():
        packed = model(torch.cat([a, b, c], 1), document_ids=_doc_ids([6, 5, 3])[None])
        alone = torch.cat([model(a), model(b), model(c)], 1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_documents_continuing_a_shared_prompt_equal_prompt_plus_document_alone():
    """RL's shared prompts: a prompt once, then completions that continue it (``prefix_ids``), each equal to the prompt
    and that completion as one sequence (the Mamba state and conv window forked at the prompt's end), gradients too."""
    model = build_model(ModelConfig(**TINY), seed=0)
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    prompt, first, second = tokens[:, :7], tokens[:, 7:12], tokens[:, 12:13]  # a one-token completion steps once
    documents = torch.tensor([[0] * 7 + [1] * 5 + [2] + [-1] * 3])
    prefixes = torch.tensor([[0] * 13 + [-1] * 3])
    positions = torch.tensor([list(range(7)) + list(range(7, 12)) + [7] + [0, 1, 2]])
    packed = model(tokens, document_ids=documents, prefix_ids=prefixes, positions=positions)
    alone = [model(torch.cat([prompt, c], 1))[:, 7:] for c in (first, second)]
    torch.testing.assert_close(packed[:, 7:13], torch.cat(alone, 1), atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(packed[:, 7:13].sum(), list(model.parameters()))
    want = torch.autograd.grad(sum(a.sum() for a in alone), list(model.parameters()))
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n, attention, mlp, pattern", [
    (8, 0.25, 0.25, "MM*-M*M-"), (8, 0.25, 0.0, "MM*MM*MM"), (10, 0.2, 0.0, "MMM*MM*MMM"), (4, 0.25, 0.25, "MM*-"),
    (8, 0.0, 0.5, "M-M-M-M-"), (48, 0.25, 0.25, "MM-*MM-*MM*-MM*-MM*-MM*-M*M-M*M-M*M-M*M-*MM-*MM-"),
])
def test_ratio_allocation_is_megatrons(n, attention, mlp, pattern):
    assert allocate_hybrid_layers(n, attention, mlp) == pattern
    cfg = ModelConfig(arch="nemotron_h", num_layers=n, hybrid_attention_ratio=attention, hybrid_mlp_ratio=mlp)
    assert cfg.layer_kinds == pattern


def test_published_8b_shape_counts_as_transformers():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = load_config(None, {"model.preset": "nemotron-h-8b"}).model
    hf_cfg = NemotronHConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        hybrid_override_pattern=cfg.hybrid_override_pattern, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        mamba_num_heads=cfg.mamba_heads, mamba_head_dim=cfg.mamba_head_dim, n_groups=cfg.mamba_num_groups,
        ssm_state_size=cfg.mamba_state_dim, tie_word_embeddings=False)
    with torch.device("meta"):
        hf = NemotronHForCausalLM(hf_cfg)
    hf_count = sum(p.numel() for p in hf.parameters())
    ours = build_model(cfg, device="meta")
    assert count_params(ours) == hf_count  # the same tensors, split differently
    assert param_counts(cfg).total == pytest.approx(hf_count, rel=0.01)
    assert 8.0e9 < hf_count < 8.3e9


@pytest.mark.parametrize("over, words", [
    (dict(hybrid_override_pattern="M*x-"), "symbol 'x' at position 2"),
    (dict(hybrid_override_pattern="M*-"), "has 3 layers but model.num_layers = 4"),
    (dict(hybrid_override_pattern="M*-E"), "has MoE layers (E) but model.num_experts = 0"),
    (dict(hybrid_attention_ratio=1.5), "hybrid_attention_ratio (--hybrid-attention-ratio) = 1.5 must be within"),
    (dict(hybrid_attention_ratio=0.6, hybrid_mlp_ratio=0.6), "must be <= 1"),
    (dict(hybrid_override_pattern="M*-M", hybrid_mlp_ratio=0.25), "cannot be combined"),
    (dict(mamba_num_heads=6, mamba_num_groups=4), "mamba_num_heads = 6 is not divisible by model.mamba_num_groups"),
    (dict(mamba_head_dim=48), "does not divide 2 * model.hidden_size = 512"),
    (dict(mamba_chunk_size=0), "mamba_chunk_size = 0 must be >= 1"),
    (dict(mamba_num_heads=0), "mamba_num_heads = 0 must be >= 1"),
    (dict(mamba_dt_min=0.5, mamba_dt_max=0.1), "mamba_dt_min = 0.5 must be within (0, model.mamba_dt_max = 0.1]"),
    (dict(mamba_dt_limit_min=0.1, mamba_dt_limit_max=0.01), "must satisfy 0 <= min < max"),
    (dict(num_experts=4), "has no MoE layer (E)"),
    (dict(mtp_num_layers=1), "not defined for hybrid"),
])
def test_config_errors_name_the_culprit(over, words):
    base = {"model.arch": "nemotron_h", "model.num_layers": 4, "model.hybrid_override_pattern": "M*-M"}
    base.update({f"model.{k}": v for k, v in over.items()})
    with pytest.raises(ConfigError) as e:
        load_config(None, base)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_tiny_preset_builds_and_splits_by_tp_plan():
    cfg = load_config(None, {"model.preset": "nemotron-h-tiny", "model.vocab_size": 128}).model
    assert cfg.layer_kinds.count("M") >= 2 and cfg.layer_kinds.count("*") >= 2 and "-" in cfg.layer_kinds
    counts = param_counts(cfg)
    assert counts.total == count_params(build_model(cfg, device="meta"))
    assert set(counts.by_kind()) == {"mamba", "attention", "mlp"}
