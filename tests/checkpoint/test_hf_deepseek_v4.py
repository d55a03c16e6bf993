"""HF bridge for DeepseekV4ForCausalLM (sliding / CSA / HCA attention, hyper-connections, hash-routed and
sqrt-softplus MoE): a random transformers model -> import -> megapipe logits == transformers logits (fp32) -> export
-> the same tensors under the same names, and transformers reads the export back to the same logits.

Tolerance: the logits agree to 1e-5 of their largest magnitude (max |diff| 2.2e-5 on logits up to 9.5 here):
megapipe's attention runs through SDPA (sink_attention), transformers' V4 through an eager softmax; with an eager
softmax in its place the logits are bitwise equal, so what is left is the fused kernel's summation order."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from megapipe.checkpoint.hf.bridge import load_hf_model
from megapipe.cli import main
from tests.helpers.hf_tiny import make_hf_dir


def close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert (ours - reference).abs().max() <= 1e-5 * reference.abs().max()


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("v4") / "hf", "deepseek_v4")


@pytest.mark.parametrize("length", [24, 23], ids=["whole-blocks", "a-partial-block"])
def test_import_logits_equal_transformers(hf_pair, length):
    hf_dir, hf_model = hf_pair
    tokens = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
    loaded = load_hf_model(hf_dir)
    assert loaded.cfg.attention_layer_types[1:3] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    assert loaded.cfg.moe_hash_layers == 1 and loaded.cfg.hc_mult == 3
    with torch.no_grad():
        close(loaded.model(tokens), hf_model(tokens).logits)


def test_export_writes_the_same_tensors_and_transformers_reads_them(hf_pair, tmp_path):
    import transformers

    hf_dir, hf_model = hf_pair
    ckpt, out = tmp_path / "ckpt", tmp_path / "again"
    assert main(["import", "hf", str(hf_dir), str(ckpt), "--quiet"]) == 0
    assert main(["export", "hf", str(ckpt), str(out), "--dtype", "fp32", "--quiet"]) == 0
    source, again = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == again.keys()
    assert all(torch.equal(t, again[name]) for name, t in source.items())
    tokens = torch.arange(20)[None] * 5 % 128
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, hf_model(tokens).logits, atol=0, rtol=0)


def test_hub_names_and_mtp_layer(hf_pair, tmp_path):
    """The Hub's own spelling (no ``model.`` prefix, ``embed`` / ``hc_head_fn``) imports the same; its MTP layer is
    left out with a note."""
    hf_dir, hf_model = hf_pair
    hub = tmp_path / "hub"
    hub.mkdir()
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            (hub / f.name).write_bytes(f.read_bytes())
    renames = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
               "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
               "model.hc_head.hc_scale": "hc_head_scale"}
    tensors = {renames.get(k, k.removeprefix("model.")): v for k, v in load_file(hf_dir / "model.safetensors").items()}
    tensors["mtp.0.enorm.weight"] = torch.ones(64)
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    loaded = load_hf_model(hub)
    assert any("mtp.0" in note for note in loaded.notes)
    tokens = torch.arange(16)[None]
    with torch.no_grad():
        close(loaded.model(tokens), hf_model(tokens).logits)
