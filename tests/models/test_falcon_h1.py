"""Falcon-H1 (megapipe.models.parallel_hybrid, megapipe.checkpoint.hf.falcon_h1): tiny random FalconH1ForCausalLM
with every muP multiplier off 1, in each Mamba norm variant -> import -> logits == transformers' (fp32, 1e-5, at a
length that is not a multiple of the chunk) -> export -> the same tensors bit for bit and a config transformers
loads to the same logits; the tiny preset trains a step (fused loss == the logits' loss); what megapipe cannot
represent is refused in one sentence."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from megapipe.checkpoint.hf import adapter_for_arch, export_hf, import_hf  # noqa: E402
from megapipe.checkpoint.load import load_model  # noqa: E402
from megapipe.config import ModelConfig, load_config, validate  # noqa: E402
from megapipe.errors import ConfigError, MegapipeError  # noqa: E402
from megapipe.models import build_model  # noqa: E402
from megapipe.models.capabilities import capabilities, describe  # noqa: E402
from megapipe.models.fused_cross_entropy import fused_linear_cross_entropy  # noqa: E402
from megapipe.models.spec import tp_split_numel  # noqa: E402
from tests.checkpoint import test_hf_bridge  # noqa: E402
from tests.checkpoint.test_hf_bridge import tensors_of  # noqa: E402
from tests.helpers.hf_tiny import VOCAB, _hf_config  # noqa: E402

tokenizer_dir = test_hf_bridge.tokenizer_dir  # the fixture

VARIANTS = {  # the Mamba norm: gated after (Mamba-2's), before the gate (Falcon's), none; biases, a dt limit, tying
    "norm-after-gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
    "norm-before-gate-biases": dict(mamba_rms_norm=True, mamba_norm_before_gate=True, projectors_bias=True,
                                    mamba_proj_bias=True, attention_bias=True, mlp_bias=True),
    "no-norm-dt-limit-tied": dict(mamba_rms_norm=False, time_step_limit=[0.05, 0.8], tie_word_embeddings=True),
}
LENGTH = 21  # chunks of 8: the last one partial
MATTERS = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
           "mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
           "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "projectors_bias", "mamba_rms_norm",
           "mamba_norm_before_gate", "time_step_limit", "ssm_multipliers", "mlp_multipliers", "embedding_multiplier",
           "lm_head_multiplier", "key_multiplier", "attention_in_multiplier", "attention_out_multiplier",
           "ssm_in_multiplier", "ssm_out_multiplier", "attention_bias", "mlp_bias"}


def make_falcon(directory: Path, tokenizer_dir: Path, **config):
    """A random FalconH1ForCausalLM saved in ``directory`` with the tokenizer: every tensor drawn, A and dt as
    Mamba-2 initialises them (A in [1, 16], dt in [0.001, 0.1]: with dt ~ 1 and A ~ -20 the scan's decays reach
    exp(-200) within a chunk and fp32 round-off alone, in transformers' and in megapipe's scan, exceeds 1e-5)."""
    cfg = _hf_config("falcon_h1")
    cfg.update(config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".D")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty_like(p).uniform_(math.log(1e-3), math.log(0.1)).exp()
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(directory)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, directory / f.name)
    return model


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_equals_transformers_and_export_gives_back_the_tensors(variant, tmp_path, tokenizer_dir):
    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "export"
    hf_model = make_falcon(hf_dir, tokenizer_dir, **VARIANTS[variant])
    tokens = ids()
    with torch.no_grad():
        want = hf_model(tokens).logits
    import_hf(hf_dir, ckpt)
    model = load_model(ckpt).model.eval()
    assert [type(b).__name__ for b in model.layers.values()] == ["ParallelHybridBlock"] * 2
    assert model.cfg.arch == "falcon_h1" and model.cfg.key_multiplier == 0.7
    with torch.no_grad():
        got = model(tokens)
    assert (got - want).abs().max().item() <= 1e-5

    export_hf(ckpt, out, dtype="fp32")
    source, exported = tensors_of(hf_dir), tensors_of(out)
    assert source.keys() == exported.keys()
    for name, tensor in source.items():
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name
    original = json.loads((hf_dir / "config.json").read_text())
    again = json.loads((out / "config.json").read_text())
    for key in MATTERS & set(original):
        assert again[key] == original[key], key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, want)


def tiny(**over) -> ModelConfig:
    multipliers = dict(embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.7,
                       attention_in_multiplier=1.1, attention_out_multiplier=0.9, mamba_in_multiplier=1.2,
                       mamba_out_multiplier=0.8, mamba_proj_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9],
                       mlp_multipliers=[1.1, 0.6])
    return load_config(None, {"model.preset": "falcon-h1-tiny", "model.vocab_size": 96,
                              **{f"model.{k}": v for k, v in {**multipliers, **over}.items()}}).model


def test_tiny_preset_trains_a_step_the_fused_loss_sees_the_same_logits_and_documents_pack():
    cfg = tiny()
    assert cfg.layer_kinds == "PPPP" and cfg.mamba_inner != 2 * cfg.hidden_size
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient for {missing}"
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    fused = model(inputs, head=lambda h, w: fused_linear_cross_entropy(h.flatten(0, 1), w, targets.flatten()))
    torch.testing.assert_close(fused, loss, atol=1e-6, rtol=1e-6)
    fused.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-5, msg=n)

    model.eval()  # packed documents: each as if alone (attention masked, the Mamba state reset)
    a, b = tokens[:1, :9], tokens[1:, :13]
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), document_ids=torch.tensor([[0] * 9 + [1] * 13]))
        torch.testing.assert_close(packed, torch.cat([model(a), model(b)], 1), atol=1e-5, rtol=1e-5)


def test_tiny_preset_splits_by_its_tp_plan_and_declares_its_capabilities():
    model = build_model(tiny(), device="meta")
    split, replicated = tp_split_numel(model.layers["0"])
    block = model.layers["0"]
    projections = [block.mixer.in_z, block.mixer.in_x, block.mixer.in_B, block.mixer.in_C, block.mixer.in_dt,
                   block.mixer.out_proj, block.attention.wq, block.attention.wk, block.attention.wv,
                   block.attention.wo, block.feed_forward.w1, block.feed_forward.w2, block.feed_forward.w3]
    mixer = block.mixer  # Megatron's split also shards the convs' channels and the per-head parameters
    per_head = [*mixer.conv_x.parameters(), *mixer.conv_B.parameters(), *mixer.conv_C.parameters(), mixer.A_log,
                mixer.D, mixer.dt_bias]
    assert split == sum(m.weight.numel() for m in projections) + sum(p.numel() for p in per_head)
    assert split + replicated == sum(p.numel() for p in block.parameters())
    row = capabilities(tiny())
    assert describe(tiny()) == "Falcon-H1" and "cp" not in row.layouts and "tp" in row.layouts
    assert "prefix_caching" not in row.engine and "speculative" not in row.engine


@pytest.mark.parametrize("over, words", [
    (dict(arch="llama", key_multiplier=0.5), "model.key_multiplier = 0.5 applies to Falcon-H1's parallel hybrid"),
    (dict(arch="nemotron_h", hybrid_override_pattern="M*", num_layers=2, embedding_multiplier=3.0),
     "model.embedding_multiplier = 3.0 applies to Falcon-H1's"),
    (dict(arch="falcon_h1", mlp_multipliers=[1.0]), "model.mlp_multipliers = [1.0] must have 2 values"),
    (dict(arch="falcon_h1", activation="relu2"), "model.activation = 'relu2': the parallel hybrid layers"),
])
def test_bad_configs_are_refused(over, words):
    from megapipe.config import Config

    cfg = Config(model=ModelConfig(**{**dict(vocab_size=64, hidden_size=64, num_heads=4, mamba_head_dim=16,
                                             mamba_num_groups=2), **over}))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_export_refuses_what_falcon_h1_cannot_express():
    adapter = adapter_for_arch("falcon_h1")
    for over, words in ((dict(qk_norm=True), "model.qk_norm = True cannot be expressed"),
                        (dict(position_embedding="none"), "model.position_embedding = 'none', "),
                        (dict(qkv_bias=True), "model.attn_out_bias = False cannot be expressed")):
        with pytest.raises(ConfigError) as e:
            adapter.hf_config(tiny(**over))
        assert str(e.value).startswith(words) and "FalconH1ForCausalLM" in str(e.value)
    adapter.hf_config(tiny())


@pytest.mark.parametrize("change, words", [
    (dict(hidden_act="gelu"), "hidden_act = 'gelu' cannot be represented by megapipe"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
     "rope_parameters.rope_type = 'linear' cannot be represented by megapipe"),
])
def test_import_refuses_what_megapipe_cannot_represent(change, words, tmp_path, tokenizer_dir):
    hf_dir = tmp_path / "hf"
    make_falcon(hf_dir, tokenizer_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(MegapipeError) as e:
        import_hf(hf_dir, tmp_path / "ckpt")
    assert words in str(e.value) and "\n" not in str(e.value)
