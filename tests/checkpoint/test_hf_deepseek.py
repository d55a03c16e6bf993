"""HF bridge for DeepseekV3ForCausalLM (multi-latent attention, YaRN, sigmoid group-limited MoE with its
score-correction bias): a random transformers model -> import -> megapipe logits == transformers logits (fp32, 1e-5)
-> export -> the same tensors under the Hub's names, with and without the q bottleneck; DeepSeek's FP8 block-scaled
weights import dequantized; its MTP layers are left out with a note; a Kimi-K2 config imports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megapipe.checkpoint.hf.bridge import load_hf_model
from megapipe.checkpoint.hf.fp8_blocks import dequantize
from megapipe.cli import main
from tests.helpers.hf_tiny import make_hf_dir

TOKENS = torch.tensor([[5, 17, 9, 33, 2, 71, 8, 19, 44, 3, 120, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
PLAIN_Q = dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               rope_interleave=False)


def cli(*args) -> int:
    return main([str(a) for a in args])


@pytest.mark.parametrize("variant", [{}, PLAIN_Q], ids=["q_lora+yarn+interleaved", "plain_q"])
def test_import_logits_and_export_tensors_equal_transformers(tmp_path, variant, capsys):
    hf_dir, hf_model = make_hf_dir(tmp_path / "hf", "deepseek_v3", **variant)
    ckpt, out = tmp_path / "ckpt", tmp_path / "again"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    loaded = load_hf_model(hf_dir)
    assert (loaded.cfg.q_lora_rank is None) == ("q_lora_rank" in variant)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(TOKENS), hf_model(TOKENS).logits, atol=1e-5, rtol=1e-5)
    assert cli("export", "hf", ckpt, out, "--dtype", "fp32", "--quiet") == 0
    source, again = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == again.keys()
    assert all(torch.equal(t, again[name]) for name, t in source.items())
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(TOKENS).logits, hf_model(TOKENS).logits, atol=1e-5, rtol=1e-5)


def _block_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP8 layout, block by block: scale_inv = amax / 448, weight = w / scale_inv in e4m3."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = part.abs().max() / 448.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_block_scaled_weights_import_dequantized_and_mtp_layers_are_left_out(tmp_path, capsys):
    hf_dir, hf_model = make_hf_dir(tmp_path / "hf", "deepseek_v3")
    tensors = load_file(hf_dir / "model.safetensors")
    block, expected = 16, {}
    for name in [n for n in tensors if ".self_attn." in n or ".mlp." in n]:
        if tensors[name].dim() == 2 and ".gate." not in name and "layernorm" not in name:
            q, scale = _block_quantize(tensors[name], block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            expected[name] = q.float() * scale.repeat_interleave(block, 0)[:q.shape[0]].repeat_interleave(
                block, 1)[:, :q.shape[1]]
    mtp = 2  # the MTP layer DeepSeek ships as the next layer index
    tensors.update({f"model.layers.{mtp}.{name}": torch.zeros(4, 4) for name in ("enorm.weight", "eh_proj.weight")})
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (hf_dir / "config.json").write_text(json.dumps(config))

    loaded = load_hf_model(hf_dir)
    assert any("dequantized" in n for n in loaded.notes) and any("multi-token-prediction" in n for n in loaded.notes)
    state = loaded.model.state_dict()
    assert torch.equal(state["layers.0.attention.wkv_b.weight"], expected["model.layers.0.self_attn.kv_b_proj.weight"])
    assert torch.equal(state["layers.1.moe.experts.w2"][3], expected["model.layers.1.mlp.experts.3.down_proj.weight"])
    with torch.no_grad():  # e4m3 keeps ~2 significant digits: the logits stay close to the unquantized model's
        assert torch.nn.functional.cosine_similarity(loaded.model(TOKENS).flatten(), hf_model(TOKENS).logits.flatten(),
                                                     dim=0) > 0.98
    capsys.readouterr()
    assert cli("import", "hf", hf_dir, tmp_path / "ckpt") == 0
    err = capsys.readouterr().err
    assert "note: The FP8 weights" in err and "model.layers.2.*) were not imported" in err


def test_dequantize_handles_partial_blocks():
    w, scale = torch.arange(6.0).view(2, 3).to(torch.float8_e4m3fn), torch.tensor([[2.0, 3.0]])
    assert torch.equal(dequantize(w, scale, (2, 2)), torch.tensor([[0.0, 2.0, 6.0], [6.0, 8.0, 15.0]]))


def test_kimi_k2_config_imports(tmp_path: Path):
    """Kimi-K2's config.json: architectures DeepseekV3ForCausalLM, model_type kimi_k2, one expert group."""
    hf_dir, hf_model = make_hf_dir(tmp_path / "hf", "deepseek_v3", n_group=1, topk_group=1)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    loaded = load_hf_model(hf_dir)
    assert loaded.cfg.moe_router_num_groups is None
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(TOKENS), hf_model(TOKENS).logits, atol=1e-5, rtol=1e-5)
