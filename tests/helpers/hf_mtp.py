"""A tiny DeepSeek-V3 Hugging Face directory with one multi-token-prediction layer, as DeepSeek publishes it (the
MTP module as the next decoder-layer index, with its own norms and projection and copies of the shared tables)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.hf_tiny import make_hf_dir

MTP = "model.layers.2."  # two main layers: the MTP layer is index 2


def make_mtp_dir(root: Path):
    """A DeepSeek-V3 directory of 2 main layers + 1 MTP layer, and (the 3-layer transformers model whose last decoder
    layer is the MTP layer's block, the MTP layer's own tensors): a 3-layer random model saved, then declared as 2
    layers with one MTP layer, its extra tensors added (random norms and projection, copies of the shared tables)."""
    hf_dir, full = make_hf_dir(root, "deepseek_v3", num_hidden_layers=3)
    tensors = load_file(hf_dir / "model.safetensors")
    g, h = torch.Generator().manual_seed(7), full.config.hidden_size
    own = {"enorm.weight": 1 + 0.3 * torch.randn(h, generator=g), "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
           "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
           "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=g)}
    tensors.update({MTP + k: v for k, v in own.items()})
    with torch.no_grad():  # a final norm that is not the identity's scale, so depth 1's input is told apart
        full.model.norm.weight.copy_(1 + 0.3 * torch.randn(h, generator=g))
    tensors["model.norm.weight"] = full.model.norm.weight.detach().clone()
    tensors[MTP + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[MTP + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
    return hf_dir, full, own
