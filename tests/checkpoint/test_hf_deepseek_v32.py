"""HF bridge for DeepseekV32ForCausalLM (DeepSeek-V3's MLA and MoE with the sparse attention's lightning indexer): a
random transformers model whose queries keep 4 of up to 12 keys -> import -> megapipe logits == transformers logits
(fp32, 1e-5) -> export -> the same tensors under the Hub's names, read back by transformers; a published checkpoint's
MTP layer is left out with a note; what a V3.2 config cannot hold is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from megapipe.checkpoint.hf import adapter_for_arch
from megapipe.checkpoint.hf.bridge import load_hf_model
from megapipe.errors import ConfigError, MegapipeError
from tests.checkpoint.test_hf_deepseek import TOKENS
from tests.helpers.hf_tiny import export_round_trip, make_hf_dir


def test_import_logits_and_export_tensors_equal_transformers(tmp_path):
    import transformers

    hf_dir, hf_model = make_hf_dir(tmp_path / "hf", "deepseek_v32")
    loaded = load_hf_model(hf_dir)
    cfg = loaded.cfg
    assert (cfg.arch, cfg.experimental_attention_variant, cfg.dsa_indexer_topk, cfg.rope_interleave) == (
        "deepseek_v32", "dsa", 4, True)
    with torch.no_grad():
        want = hf_model(TOKENS).logits
        torch.testing.assert_close(loaded.model(TOKENS), want, atol=1e-5, rtol=1e-5)
        for layer in hf_model.model.layers:  # every key: a different model, so the selection was exercised
            layer.self_attn.indexer.index_topk = 12
        assert (hf_model(TOKENS).logits - want).abs().max() > 1e-3
    out = export_round_trip(hf_dir, tmp_path)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.index_topk == 4
    with torch.no_grad():
        torch.testing.assert_close(exported(TOKENS).logits, want, atol=1e-5, rtol=1e-5)


def test_mtp_layer_left_out_and_what_v32_cannot_hold_refused(tmp_path):
    hf_dir, _ = make_hf_dir(tmp_path / "hf", "deepseek_v32")
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)  # DeepSeek's MTP layer, the next layer index
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    loaded = load_hf_model(hf_dir)
    assert loaded.cfg.mtp_num_layers is None and any("model.layers.2.*" in n for n in loaded.notes)
    with pytest.raises(MegapipeError, match="--mtp-num-layers 1"):
        load_hf_model(hf_dir, mtp_num_layers=1)
    adapter = adapter_for_arch("deepseek_v32")
    with pytest.raises(ConfigError, match="model.rope_interleave = False cannot be expressed"):
        adapter.hf_config(dataclasses.replace(loaded.cfg, rope_interleave=False))
