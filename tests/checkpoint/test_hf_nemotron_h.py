"""HF bridge for NemotronHForCausalLM (Mamba-2, attention without positions, squared-ReLU MLP layers): a random
transformers model -> import -> megapipe logits == transformers logits (fp32, 1e-5; 21 tokens, not a multiple of the
chunk size 8) -> export -> the same tensors bit for bit and a config.json transformers loads to the same logits; the
``model.`` names of transformers' modules (its files say ``backbone.``, as the Hub's) and legacy config keys import; what megapipe cannot represent is refused in one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megapipe.checkpoint.hf.bridge import load_hf_model
from megapipe.checkpoint.load import load_model
from megapipe.cli import main
from tests.helpers.hf_tiny import make_hf_dir

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parents[1] / "fixtures"
TOKENS = torch.randint(0, 320, (2, 21), generator=torch.Generator().manual_seed(0))
# a dt clamp at 0.5: softplus(dt + dt_bias) falls below it for about a third of the heads, so the clamp matters
CLAMPED = dict(time_step_limit=[0.5, float("inf")], time_step_min=0.5, time_step_max=1.0, use_bias=True,
               mlp_bias=True)


def cli(*args) -> int:
    return main([str(a) for a in args])


def refused(capsys, *args) -> str:
    capsys.readouterr()
    assert cli(*args) != 0
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    return " ".join(err.split())


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return out.logits if hasattr(out, "logits") else out


def _randomize_biases(hf_dir) -> None:
    """transformers initialises the projections' biases to 0: random ones, so their split and copy are checked."""
    tensors = load_file(hf_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith("proj.bias"):
            tensors[name] = 0.3 * torch.randn(t.shape, generator=gen)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("variant", [{}, CLAMPED], ids=["plain", "dt_clamp+biases"])
def test_import_logits_and_export_tensors_equal_transformers(tmp_path, variant):
    hf_dir, _ = make_hf_dir(tmp_path / "hf", "nemotron_h", **variant)
    if variant:
        _randomize_biases(hf_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ckpt, out = tmp_path / "ckpt", tmp_path / "again"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    loaded = load_hf_model(hf_dir)
    cfg = loaded.cfg
    assert (cfg.arch, cfg.layer_kinds, cfg.position_embedding, cfg.activation) == ("nemotron_h", "M*-M-", "none",
                                                                                   "relu2")
    assert cfg.mamba_dt_limit == tuple(variant.get("time_step_limit", (0.0, float("inf"))))
    assert cfg.mamba_proj_bias == bool(variant) and cfg.mlp_bias == bool(variant)
    want = _logits(hf_model)
    torch.testing.assert_close(_logits(loaded.model.eval()), want, atol=1e-5, rtol=0)
    if variant:  # the clamp is what makes them equal
        loaded.model.layers["0"].mixer.dt_limit = (0.0, float("inf"))
        assert (_logits(loaded.model) - want).abs().max() > 1e-3

    assert cli("export", "hf", ckpt, out, "--dtype", "fp32", "--quiet") == 0
    source, again = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == again.keys()
    assert all(torch.equal(t, again[name]) for name, t in source.items())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"] and config["hybrid_override_pattern"] == "M*-M-"
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert exported.config.layers_block_type == hf_model.config.layers_block_type
    torch.testing.assert_close(_logits(exported), want, atol=1e-5, rtol=0)


def test_model_names_and_legacy_config_keys_import(tmp_path):
    """Tensors under transformers' module names (``model.``, not the files' ``backbone.``), config.json with
    hybrid_override_pattern and the older mamba_* keys."""
    hf_dir, hf_model = make_hf_dir(tmp_path / "hf", "nemotron_h")
    tensors = load_file(hf_dir / "model.safetensors")
    assert all(n.startswith(("backbone.", "lm_head.")) for n in tensors)  # what transformers writes, as the Hub
    in_memory = {("model." + n[len("backbone."):] if n.startswith("backbone.") else n): t for n, t in tensors.items()}
    save_file(in_memory, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    for key in ("layers_block_type", "time_step_limit"):
        config.pop(key)
    renamed = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size",
               "use_conv_bias": "mamba_conv_bias", "time_step_min": "mamba_dt_min"}
    for new, old in renamed.items():
        config[old] = config.pop(new)
    config.update(hybrid_override_pattern="M*-M-", num_hidden_layers=5)
    (hf_dir / "config.json").write_text(json.dumps(config))
    loaded = load_hf_model(hf_dir)
    assert loaded.cfg.layer_kinds == "M*-M-" and loaded.cfg.mamba_num_groups == 2
    torch.testing.assert_close(_logits(loaded.model.eval()), _logits(hf_model), atol=1e-5, rtol=0)


def test_a_dt_limit_exports_as_time_step_limit(tmp_path):
    """megapipe's dt limit (both ends here) is transformers' time_step_limit; time_step_min/max stay dt_bias's init
    range, and transformers computes what megapipe does."""
    hf_dir, _ = make_hf_dir(tmp_path / "hf", "nemotron_h", time_step_min=0.5, time_step_max=1.0)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    manifest = json.loads((ckpt / "megapipe.json").read_text())
    assert manifest["model"]["mamba_dt_limit_min"] == 0.0 and manifest["model"]["mamba_dt_min"] == 0.5
    manifest["model"].update(mamba_dt_limit_min=0.6, mamba_dt_limit_max=0.9)
    (ckpt / "megapipe.json").write_text(json.dumps(manifest))
    assert cli("export", "hf", ckpt, out, "--dtype", "fp32", "--quiet") == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["time_step_limit"], config["time_step_min"], config["time_step_max"]) == ([0.6, 0.9], 0.5, 1.0)
    ours = load_model(ckpt).model.eval()
    assert ours.cfg.mamba_dt_limit == (0.6, 0.9)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    want = _logits(exported)
    torch.testing.assert_close(_logits(ours), want, atol=1e-5, rtol=0)
    ours.layers["0"].mixer.dt_limit = (0.0, float("inf"))
    assert (_logits(ours) - want).abs().max() > 1e-3  # the limit is what makes them equal


@pytest.mark.parametrize("change, words", [
    ({"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"]},
     "layers_block_type = \"1 'moe' layers\" cannot be represented by megapipe (Nemotron-H's experts are "
     "squared-ReLU MLPs and megapipe's are SwiGLU)"),
    ({"num_nextn_predict_layers": 1},
     "num_nextn_predict_layers = 1 cannot be represented by megapipe (multi-token prediction is not defined for "
     "hybrid Transformer-Mamba models)"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act = 'gelu' cannot be represented by megapipe"),
    ({"mamba_hidden_act": "relu"}, "mamba_hidden_act = 'relu' cannot be represented by megapipe"),
], ids=["moe", "mtp", "mlp_act", "mamba_act"])
def test_refuses_configs_megapipe_cannot_represent(tmp_path, capsys, change, words):
    hf_dir, _ = make_hf_dir(tmp_path / "hf", "nemotron_h")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    assert words in refused(capsys, "import", "hf", hf_dir, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("field, value, words", [
    ("tie_embeddings", True, "model.tie_embeddings = True cannot be expressed in a Hugging Face "
                             "NemotronHForCausalLM config (it would read back as model.tie_embeddings = False)"),
    ("qkv_bias", True, "model.qkv_bias = True cannot be expressed"),
], ids=["tied", "qkv_bias"])
def test_export_refuses_what_transformers_cannot_express(tmp_path, capsys, field, value, words):
    hf_dir, _ = make_hf_dir(tmp_path / "hf", "nemotron_h")
    ckpt = tmp_path / "ckpt"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    manifest = json.loads((ckpt / "megapipe.json").read_text())
    manifest["model"][field] = value
    (ckpt / "megapipe.json").write_text(json.dumps(manifest))
    assert words in refused(capsys, "export", "hf", ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_lora_adapters_load_into_peft_on_transformers(tmp_path):
    """LoRA on the attention and MLP layers (w1 is the "gate" target, as GPT-2's: the MLP's first projection) ->
    a peft directory under transformers' module names (``model.``) -> peft on the exported model gives our logits."""
    from peft import PeftModel

    from megapipe.checkpoint.hf.peft import peft_targets

    hf_dir, _ = make_hf_dir(tmp_path / "hf", "nemotron_h")
    ckpt, run, base_hf, adapter = tmp_path / "ckpt", tmp_path / "run", tmp_path / "base_hf", tmp_path / "adapter"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    targets = peft_targets(load_model(ckpt).model.cfg)
    assert targets == ["q", "k", "v", "o", "gate", "down"]
    data = tmp_path / "chat.jsonl"  # a copy: the tokenized cache is written beside it
    data.write_text((FIXTURES / "chat_answer_format.jsonl").read_text())
    assert cli("posttrain", "sft", "--load", ckpt, "--data", data, "--seq-length",
               "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2",
               "--lr-warmup-iters", "0", "--eval-iters", "0", "--save", run, "--precision", "fp32", "--quiet",
               "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", ",".join(targets)) == 0
    step = run / "step_00000002"
    assert cli("export", "hf", ckpt, base_hf, "--dtype", "fp32", "--quiet") == 0
    assert cli("export", "hf", step, adapter, "--lora-adapter-only", "--quiet") == 0
    modules = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert r"^(model\.layers\.\d+\.mixer\.down_proj|" in modules and "backbone" not in modules
    peft_model = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base_hf, attn_implementation="eager"), adapter).eval()
    got = _logits(load_model(step).model.eval())  # the adapters folded into the weights
    assert not torch.allclose(got, _logits(load_model(ckpt).model.eval()), atol=1e-3)  # they moved the logits
    torch.testing.assert_close(got, _logits(peft_model.merge_and_unload()), atol=1e-5, rtol=0)


def test_published_8b_config_reads_as_the_preset(tmp_path):
    """nvidia/Nemotron-H-8B-Base-8K's config.json (its legacy keys) is the nemotron-h-8b preset."""
    from megapipe.checkpoint.hf.bridge import read_hf_config
    from megapipe.config import ModelConfig, resolve_preset

    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=4096, num_hidden_layers=52,
        hybrid_override_pattern=pattern, num_attention_heads=32, num_key_value_heads=8, attention_head_dim=128,
        attention_bias=False, intermediate_size=21504, mlp_hidden_act="relu2", hidden_act="relu2", mlp_bias=False,
        mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
        use_conv_bias=True, mamba_proj_bias=False, mamba_hidden_act="silu", expand=2, vocab_size=131072,
        tie_word_embeddings=False, layer_norm_epsilon=1e-5, rms_norm_eps=1e-5, use_bias=False,
        residual_in_fp32=False, rescale_prenorm_residual=True, max_position_embeddings=8192, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, initializer_range=0.02, torch_dtype="bfloat16", num_logits_to_keep=1)))
    _, cfg, _ = read_hf_config(tmp_path)
    preset = ModelConfig(**resolve_preset("nemotron-h-8b"))
    for name in ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "norm_eps", "tie_embeddings", "activation", "position_embedding", "layer_kinds",
                 "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_heads", "mamba_chunk_size",
                 "mamba_conv_kernel", "mamba_conv_bias", "mamba_proj_bias", "qkv_bias", "mlp_bias", "mamba_dt_limit",
                 "mamba_dt_min", "mamba_dt_max"):
        assert getattr(cfg, name) == getattr(preset, name), name
