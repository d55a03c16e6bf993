import torch

from megapipe.config import ModelConfig, OptimConfig
from megapipe.models import build_model
from megapipe.training.optim import build_optimizer, param_groups


def test_no_weight_decay_on_biases_and_norms_only():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      norm_type="layernorm", qkv_bias=True)
    model = build_model(cfg, seed=0)
    groups = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in groups[0]["params"])
    plain = sorted(names[id(p)] for p in groups[1]["params"])
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert "tok_embeddings.weight" in decayed and "layers.0.attention.wq.weight" in decayed
    assert all(n.endswith(".bias") or "norm" in n for n in plain)
    assert "layers.0.attention.wq.bias" in plain and "norm.weight" in plain and "norm.bias" in plain
    assert len(decayed) + len(plain) == len(names)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True

