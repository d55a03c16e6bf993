"""The unified (Hugging Face layout) TensorRT-LLM checkpoint of a quantized megapipe checkpoint.

Tensor names are the HF bridge's (``model.layers.0.self_attn.q_proj.weight`` ...); next to each quantized weight
sit ``weight_scale`` / ``input_scale`` / ``weight_scale_2`` / ``pre_quant_scale``, and the KV-cache scales are
``self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` (amax / 448), as ModelOpt's ``export_hf_checkpoint`` writes them.
Layers that share an input are prepared for the runtime's fused GEMMs first (not for FP8, as ModelOpt does); with
AWQ their common ``pre_quant_scale`` is folded into the RMSNorm in front of them.

MoE layers: each expert's ``w1`` / ``w3`` / ``w2`` under the Hub's per-expert names with its own scales, split out of
the fused experts as ModelOpt's ``_export_fused_experts`` splits them (Source.experts); the routers and the shared
expert's gate unquantized and listed in ``exclude_modules``; the shared expert like a dense MLP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megapipe.checkpoint import quantized_linear as ql
from megapipe.checkpoint.hf.base import adapter_for_arch
from megapipe.checkpoint.hf.bridge import _token_ids, _tokenizer, _write_tokenizer
from megapipe.checkpoint.hf.files import HF_DTYPE_NAMES
from megapipe.checkpoint.quant_state import is_quantizer_tensor
from megapipe.checkpoint.trt_files import ShardWriter, write_json
from megapipe.checkpoint.trt_source import AWQ, LAYER_LINEARS, QUANT_ALGO, Source
from megapipe.errors import CheckpointError, MegapipeError

FUSED = (("attention_norm", ("attention.wq", "attention.wk", "attention.wv")),
         ("ffn_norm", ("feed_forward.w1", "feed_forward.w3")),
         ("ffn_norm", ("moe.shared_experts.w1", "moe.shared_experts.w3")))  # in the order the HF forward calls them
SHARED_EXPERT = ("moe.shared_experts.w1", "moe.shared_experts.w2", "moe.shared_experts.w3")
MLA = ("attention.wq_a", "attention.wq_b", "attention.wkv_a", "attention.wkv_b")  # multi-latent attention (fp8 only)
EXCLUDED = {"output": "lm_head", "tok_embeddings": "model.embed_tokens"}
ROUTERS = ("moe.gate", "moe.shared_gate")  # unquantized, listed per layer among the excluded modules


def check_unified(src: Source) -> None:
    if src.fmt not in QUANT_ALGO:
        raise MegapipeError(f"{src.where}: quantization format {src.fmt!r} has no TensorRT-LLM export in megapipe "
                            f"(exported: {', '.join(QUANT_ALGO)})")
    if src.cfg.arch == "gpt2":
        raise MegapipeError(f"{src.where}: a quantized GPT-2 has no unified TensorRT-LLM layout (TensorRT-LLM's "
                            "PyTorch backend has no GPT-2 model): use --format legacy")


def _names(src: Source) -> dict[str, str]:
    """megapipe tensor name -> HF name (the bridge's 1:1 renames for the Llama-shaped architectures); an MoE
    layer's ``moe.experts.w1`` is E HF tensors: ``moe.experts.w1.{e}`` -> expert e's."""
    out = {}
    for conv in adapter_for_arch(src.cfg.arch).conversions(src.cfg):
        if len(conv.mp) == 1 and len(conv.hf) > 1 and ".moe.experts." in conv.mp[0]:
            out.update({f"{conv.mp[0]}.{e}": hf for e, hf in enumerate(conv.hf)})
            continue
        if len(conv.hf) != 1 or len(conv.mp) != 1:
            raise MegapipeError(f"{src.cfg.arch}: tensor {conv.mp} has no 1:1 Hugging Face name")
        out[conv.mp[0]] = conv.hf[0]
    return out


def linear_tensors(q: ql.QLinear) -> dict[str, torch.Tensor]:
    """One linear's exported tensors (suffix -> tensor), as ModelOpt's ``_export_quantized_weight`` lays them out."""
    out: dict[str, torch.Tensor] = {}
    if q.fmt is None:
        out["weight"] = q.weight
    else:
        if q.fmt == "fp8":
            # a 0-d scale: the division runs in the weight dtype
            scale = ql.positive_amax(q.weight_amax.float(), "fp8") / ql.MAXBOUND["fp8"]
        else:
            scale = ql.weight_scale(q)
        out["weight"] = ql.quantize_weight(q, scale)
        out["weight_scale"] = scale
        inputs = ql.input_scale(q)
        if inputs is not None:
            out["input_scale"] = inputs.squeeze()
        second = ql.weight_scale_2(q)
        if second is not None:
            out["weight_scale_2"] = second.squeeze()
        if q.pre_quant_scale is not None:
            out["pre_quant_scale"] = q.pre_quant_scale
    if q.bias is not None:
        out["bias"] = q.bias
    return out


def layer_tensors(src: Source, i: int, dtype: torch.dtype, names: dict[str, str]) -> dict[str, torch.Tensor]:
    state = src.layer(i)
    pre = f"layers.{i}."
    linears = {n: src.linear(state, pre + n, dtype) for n in (*LAYER_LINEARS, *SHARED_EXPERT, *MLA)}
    norms = {n: (state[f"{pre}{n}.weight"].to(dtype), _opt(state.get(f"{pre}{n}.bias"), dtype))
             for n, _ in FUSED}
    if src.fmt != "fp8":
        for norm, members in FUSED:
            present = [m for m in members if linears[m] is not None]
            if not present:
                continue
            group = ql.fuse_group([linears[m] for m in present])
            if src.fmt in AWQ:
                group, *norms[norm] = ql.fold_into_norm(group, *norms[norm])
            linears.update(zip(present, group, strict=True))
    if f"{pre}moe.experts.gate_up_proj" in state:
        for e, expert in enumerate(src.experts(state, f"{pre}moe.experts", dtype)):
            linears.update({f"moe.experts.{w}.{e}": q for w, q in expert.items()})
    out = {}
    for name, q in linears.items():
        if q is None:
            continue
        hf = names[f"{pre}{name}" if ".experts." in name else f"{pre}{name}.weight"]
        out.update({f"{hf.removesuffix('.weight')}.{k}": v for k, v in linear_tensors(q).items()})
    for norm, (weight, bias) in norms.items():
        out[names[f"{pre}{norm}.weight"]] = weight
        if bias is not None:
            out[names[f"{pre}{norm}.bias"]] = bias
    handled = tuple(f"{pre}{n}." for n in (*LAYER_LINEARS, *SHARED_EXPERT, *MLA, *norms, "moe.experts"))
    fp32 = tuple(pre + n for n in adapter_for_arch(src.cfg.arch).fp32_tensors)
    for key, tensor in state.items():  # the rest: q_norm / k_norm, MLA's latent norms, routers, the expert bias
        if not is_quantizer_tensor(key) and not key.startswith(handled):
            out[names[key]] = tensor.to(torch.float32 if key in fp32 else dtype)
    k_amax, v_amax = src.kv_amax(state, i)
    if k_amax is not None:
        out[names[f"{pre}attention.wk.weight"].removesuffix("weight") + "k_scale"] = ql.kv_scale_unified(k_amax)
        out[names[f"{pre}attention.wv.weight"].removesuffix("weight") + "v_scale"] = ql.kv_scale_unified(v_amax)
    return out


def _opt(t: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def quant_config(src: Source, names: dict[str, str]) -> tuple[dict, dict]:
    """(hf_quant_config.json, config.json's quantization_config), as ModelOpt writes them."""
    routers = [names[f"layers.{i}.{r}.weight"].removesuffix(".weight") for i in range(src.cfg.num_layers)
               for r in ROUTERS if f"layers.{i}.{r}.weight" in src.stored]
    exclude = sorted([*EXCLUDED.values(), *routers])
    details = {"quant_algo": QUANT_ALGO[src.fmt], "kv_cache_quant_algo": "FP8" if src.kv_cache == "fp8" else None}
    if src.fmt in AWQ:
        details.update(group_size=src.block_size(), has_zero_point=False, pre_quant_scale=True)
    details["exclude_modules"] = exclude
    producer = {"name": "modelopt", "version": src.producer_version}
    hf_quant = {"producer": producer, "quantization": details}
    config: dict = {}
    if src.fmt == "fp8":
        config["config_groups"] = {"group_0": {
            "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
            "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
            "targets": ["Linear"],
        }}
    config["ignore"] = exclude
    config["quant_algo"] = details["quant_algo"]
    if details["kv_cache_quant_algo"] == "FP8":
        config["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    config.update(producer=producer, quant_method="modelopt")
    return hf_quant, config


def write_unified(src: Source, out: Path, dtype: torch.dtype, max_shard_size="5GB", progress=None, **_) -> dict:
    adapter = adapter_for_arch(src.cfg.arch)
    hf_cfg = adapter.hf_config(src.cfg)
    names = _names(src)
    tok_dir = src.path / "tokenizer"
    if not tok_dir.exists():
        raise CheckpointError(f"{src.path} holds no tokenizer/ directory: a unified checkpoint ships its tokenizer")
    tok = _tokenizer(tok_dir, src.cfg, str(tok_dir))

    shards = ShardWriter(out, max_shard_size)
    top = [n for n in src.stored if not n.startswith("layers.") and not is_quantizer_tensor(n)]
    first = src.read([n for n in top if n.startswith("tok_embeddings.")])  # in the order HF models list them
    shards.add({names[k]: v.to(dtype) for k, v in first.items()})
    count = len(first)
    del first
    for i in range(src.cfg.num_layers):
        tensors = layer_tensors(src, i, dtype, names)
        count += len(tensors)
        shards.add(tensors)
        if progress:
            progress(i + 1, src.cfg.num_layers)
    final = src.read([n for n in top if not n.startswith("tok_embeddings.")])
    shards.add({names[k]: v.to(dtype) for k, v in final.items()})
    count += len(final)
    n_shards = shards.close()

    hf_quant, quantization_config = quant_config(src, names)
    tokens = _write_tokenizer(tok, out)
    generation = {**tokens, **_token_ids(src.hf_extra.get("generation_config"))}
    config = {"architectures": [adapter.architecture], **hf_cfg, **generation, "dtype": HF_DTYPE_NAMES[dtype],
              "torch_dtype": HF_DTYPE_NAMES[dtype], "quantization_config": quantization_config}
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation)
    write_json(out / "hf_quant_config.json", hf_quant)
    return {"tensors": count, "shards": n_shards, "bytes": shards.total}
