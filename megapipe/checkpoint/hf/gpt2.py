"""GPT2LMHeadModel: LayerNorm, learned positions, GELU (tanh) MLP, biases everywhere.

GPT-2 stores its linear layers as ``Conv1D`` ([in, out], the transpose of nn.Linear) and fuses q/k/v into one
``c_attn`` tensor, so those conversions transpose, and split or concatenate.
"""

from __future__ import annotations

from typing import Any

import torch

from megapipe.checkpoint.hf.base import Adapter, Conversion, Tensors, meta_state_keys, refuse, register, renames
from megapipe.config import ModelConfig
from megapipe.errors import MegapipeError
from megapipe.models.dense import DENSE

TOP = {"tok_embeddings": "transformer.wte", "pos_embeddings": "transformer.wpe", "norm": "transformer.ln_f",
       "output": "lm_head"}
_NAMES = DENSE.hf_names["gpt2"]
LAYER = {k: v for k, v in _NAMES.items() if k.endswith("norm")}
CONV1D = {k: v for k, v in _NAMES.items() if k not in LAYER}  # stored transposed
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


def _transpose(tensors: Tensors) -> Tensors:
    return [t.t().contiguous() for t in tensors]


def _split_qkv(tensors: Tensors) -> Tensors:
    (fused,) = tensors
    if fused.dim() == 1:
        return [t.contiguous() for t in fused.chunk(3)]
    return [t.t().contiguous() for t in fused.chunk(3, dim=1)]


def _fuse_qkv(tensors: Tensors) -> Tensors:
    if tensors[0].dim() == 1:
        return [torch.cat(tensors)]
    return [torch.cat([t.t() for t in tensors], dim=1).contiguous()]


@register
class GPT2Adapter(Adapter):
    architecture = "GPT2LMHeadModel"
    model_type = "gpt2"
    arch = "gpt2"

    def config_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        act = hf.get("activation_function", "gelu_new")
        if act not in GELU_TANH:
            raise refuse(where, "activation_function", act, f"supported: {', '.join(GELU_TANH)}")
        for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                            ("add_cross_attention", False)):
            if bool(hf.get(key, wanted)) != wanted:
                raise refuse(where, key, hf.get(key), f"only {wanted} is supported")
        try:
            hidden = int(hf["n_embd"])
            fields = dict(
                arch=self.arch,
                vocab_size=int(hf["vocab_size"]),
                make_vocab_size_divisible_by=1,
                hidden_size=hidden,
                intermediate_size=int(hf.get("n_inner") or 4 * hidden),
                num_layers=int(hf["n_layer"]),
                num_heads=int(hf["n_head"]),
                num_kv_heads=int(hf["n_head"]),
                head_dim=hidden // int(hf["n_head"]),
                max_position_embeddings=int(hf["n_positions"]),
                norm_type="layernorm",
                norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                activation="gelu_tanh",
                position_embedding="learned",
                qkv_bias=True,
                attn_out_bias=True,
                mlp_bias=True,
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            )
        except KeyError as e:
            raise MegapipeError(f"{where}: the field {e.args[0]!r} is missing") from None
        if hf.get("initializer_range") is not None:
            fields["init_std"] = float(hf["initializer_range"])
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return dict(
            model_type=self.model_type,
            vocab_size=cfg.vocab_size,
            n_embd=cfg.hidden_size,
            n_inner=cfg.intermediate_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_positions=cfg.max_position_embeddings,
            layer_norm_epsilon=cfg.norm_eps,
            activation_function="gelu_new",
            tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.init_std,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            reorder_and_upcast_attn=False,
            use_cache=True,
        )

    def conversions(self, cfg: ModelConfig) -> list[Conversion]:
        keys = meta_state_keys(cfg)
        plain = [k for k in keys if not k.startswith("layers.") or k.split(".", 2)[2].rsplit(".", 1)[0] in LAYER]
        out = renames(plain, TOP, LAYER, "transformer.h.")
        for i in range(cfg.num_layers):
            pre, hf = f"layers.{i}.", f"transformer.h.{i}."
            for param in ("weight", "bias"):
                qkv = tuple(f"{pre}attention.{w}.{param}" for w in ("wq", "wk", "wv"))
                out.append(Conversion((f"{hf}attn.c_attn.{param}",), qkv, _split_qkv, _fuse_qkv))
                for mp, conv in CONV1D.items():
                    names = (f"{hf}{conv}.{param}",), (f"{pre}{mp}.{param}",)
                    out.append(Conversion(*names, _transpose, _transpose) if param == "weight" else Conversion(*names))
        return out

    def ignored(self, name: str, cfg: ModelConfig) -> bool:
        # attn.bias / attn.masked_bias: causal-mask buffers that old GPT-2 checkpoints saved
        return super().ignored(name, cfg) or name.endswith((".attn.bias", ".attn.masked_bias"))

    def aliases(self, names: set[str]) -> dict[str, str]:
        """The original GPT-2 checkpoints name the blocks without the ``transformer.`` prefix."""
        return {n: n if n.startswith(("transformer.", "lm_head.")) else f"transformer.{n}" for n in names}
