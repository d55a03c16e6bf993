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


V4_MTP = "mtp.0."


def make_v4_mtp_dir(root: Path):
    """A DeepSeek-V4 directory of 4 main layers + 1 MTP layer as the Hub holds it (``mtp.0.*``), and (the 5-layer
    transformers model whose last decoder layer is the MTP layer's block, sliding-window and score-routed as the
    published MTP layers; the MTP layer's own tensors: random norms, projections and hyper-connection head)."""
    kinds = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
             "compressed_sparse_attention"]
    hf_dir, full = make_hf_dir(root, "deepseek_v4", num_hidden_layers=5, layer_types=[*kinds, "sliding_attention"],
                               mlp_layer_types=["hash_moe"] + ["moe"] * 4)
    tensors = load_file(hf_dir / "model.safetensors")
    block = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("model.layers.4.")]}
    tensors.update({V4_MTP + k.removeprefix("model.layers.4."): v for k, v in block.items()})
    g, h, n = torch.Generator().manual_seed(7), full.config.hidden_size, full.config.hc_mult
    own = {"enorm.weight": 1 + 0.3 * torch.randn(h, generator=g), "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=g),
           "norm.weight": 1 + 0.3 * torch.randn(h, generator=g), "e_proj.weight": 0.2 * torch.randn(h, h, generator=g),
           "h_proj.weight": 0.2 * torch.randn(h, h, generator=g), "hc_head_fn": 0.3 * torch.randn(n, n * h, generator=g),
           "hc_head_base": 0.5 * torch.randn(n, generator=g), "hc_head_scale": 1 + 0.3 * torch.randn(1, generator=g)}
    tensors.update({V4_MTP + k: v for k, v in own.items()})
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(num_hidden_layers=4, num_nextn_predict_layers=1, layer_types=kinds,
                  mlp_layer_types=config["mlp_layer_types"][:4])
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir, full, own
