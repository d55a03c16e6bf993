"""Test helper: copy a small random Hugging Face model's weights into megapipe's names (a name map, not the bridge)."""

from __future__ import annotations

import re

import torch

from megapipe.models import Transformer

_LLAMA_NAMES = [  # HF (Llama / Qwen2 / Qwen3 / Mistral) -> megapipe
    (r"model\.embed_tokens\.", "tok_embeddings."),
    (r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.", r"layers.\1.attention.w\2."),
    (r"model\.layers\.(\d+)\.self_attn\.([qk])_norm\.", r"layers.\1.attention.\2_norm."),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.feed_forward.w1."),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.feed_forward.w3."),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.feed_forward.w2."),
    (r"model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attention_norm."),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    (r"model\.norm\.", "norm."),
    (r"lm_head\.", "output."),
]
_GPT2_NAMES = [  # Conv1D weights are stored [in, out]: transposed below
    (r"transformer\.wte\.", "tok_embeddings."),
    (r"transformer\.wpe\.", "pos_embeddings."),
    (r"transformer\.h\.(\d+)\.ln_1\.", r"layers.\1.attention_norm."),
    (r"transformer\.h\.(\d+)\.attn\.c_attn\.", r"layers.\1.attention.wqkv."),
    (r"transformer\.h\.(\d+)\.attn\.c_proj\.", r"layers.\1.attention.wo."),
    (r"transformer\.h\.(\d+)\.ln_2\.", r"layers.\1.ffn_norm."),
    (r"transformer\.h\.(\d+)\.mlp\.c_fc\.", r"layers.\1.feed_forward.w1."),
    (r"transformer\.h\.(\d+)\.mlp\.c_proj\.", r"layers.\1.feed_forward.w2."),
    (r"transformer\.ln_f\.", "norm."),
    (r"lm_head\.", "output."),
]


def _rename(name: str, table) -> str:
    for pattern, repl in table:
        new, n = re.subn("^" + pattern, repl, name)
        if n:
            return new
    raise KeyError(f"no megapipe name for {name}")


def copy_hf_weights(hf_model, model: Transformer) -> None:
    """Load ``hf_model``'s weights into ``model``; every megapipe parameter must receive exactly one tensor."""
    gpt2 = type(hf_model).__name__.startswith("GPT2")
    table = _GPT2_NAMES if gpt2 else _LLAMA_NAMES
    out = {}
    for name, t in hf_model.state_dict().items():
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            continue  # GPT-2's causal mask buffers in some versions
        new = _rename(name, table)
        if new.startswith("output.") and model.output is None:
            continue  # tied to the embedding
        if gpt2 and new.endswith(".weight") and (".attention.w" in new or ".feed_forward.w" in new):
            t = t.t()
        if ".wqkv." in new:
            for part, chunk in zip("qkv", t.chunk(3, dim=0), strict=True):
                out[new.replace("wqkv", "w" + part)] = chunk
        else:
            out[new] = t
    model.load_state_dict({k: v.clone() for k, v in out.items()}, strict=True)


def random_tokens(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
