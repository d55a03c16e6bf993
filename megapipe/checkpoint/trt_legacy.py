"""The legacy TensorRT-LLM checkpoint (``trtllm-build``, TRT-LLM <= 1.2): config.json + ``rank{N}.safetensors``.

Names and layout are those of NVIDIA ModelOpt's ``export_tensorrt_llm_checkpoint`` (checked against it by the
oracle tests): ``transformer.vocab_embedding``, ``transformer.layers.{i}.input_layernorm``, ``attention.qkv``
(q, k, v concatenated per rank), ``attention.dense``, ``post_layernorm``, ``mlp.fc`` (gate_proj / c_fc), ``mlp.gate``
(up_proj), ``mlp.proj`` (down_proj / c_proj), ``transformer.ln_f``, ``lm_head``; scales as
``activation_scaling_factor`` / ``weights_scaling_factor(_2)`` / ``prequant_scaling_factor`` and the KV cache's
``{k,v,kv}_cache_scaling_factor`` (at least 1). Rank N = pp_rank * tp + tp_rank holds its layers, numbered from 0.

Tensor parallelism: column layers (qkv, fc, gate, lm_head, embeddings) split their rows (padded to a multiple of
tp: the vocabulary), row layers (dense, proj) their columns (INT4 block scales and pre_quant_scale with them);
with fewer KV heads than ranks the KV heads are duplicated first. Weights are quantized per rank after the split.

Where ModelOpt's config is wrong without TensorRT-LLM installed (it then writes its fallback), the fields that
TensorRT-LLM's own ``from_hugging_face`` writes are used instead: ``rotary_base`` / ``rotary_scaling`` always,
``qwen_type``, ``attn_bias`` / ``mlp_bias``, GPT-2's ``learned_absolute`` positions. Tied embeddings get an
``lm_head`` of their own (``share_embedding_table`` false), as ModelOpt writes Hugging Face models.

Mixtral, Qwen2-MoE and Qwen3-MoE (every layer MoE): ``mlp.router`` (float32, whole on every rank), ``mlp.fc``
[E, 2F, H] with each expert's up projection (w3) before its gate (w1), ``mlp.proj`` [E, H, F]; TP splits every
expert's F (w3 and w1 each, then concatenated), as ModelOpt does (``moe_tp_size`` = tp, ``moe_ep_size`` = 1: its
exporter has no expert parallel split). The config adds ``moe`` (num_experts, top_k, normalization_mode: 1
renormalises the top-k weights, 0 keeps them, as the routing does) and ``hidden_act`` "swiglu" (TensorRT-LLM's MoE
takes the gated activation explicitly); the Qwen ones also ``moe_intermediate_size`` (the expert width
TensorRT-LLM's Qwen model reads). Qwen2-MoE's shared expert is ``mlp.shared_expert.fc`` ([up | gate] of each rank)
and ``.proj``, split by TP like a dense MLP, and its sigmoid gate ``mlp.shared_expert_gate`` [1, H] whole on every
rank, with ``moe_shared_expert_intermediate_size`` in the config. ModelOpt's config has no ``moe`` section for
Qwen2-MoE (its config map knows only ``num_local_experts``): the fields are those of TensorRT-LLM's converter.

Quantized MoE (fp8 only: TensorRT-LLM's MoE plugin has FP8 and weight-only modes, no SmoothQuant): ``mlp.fc`` /
``mlp.proj`` in FP8 with one ``weights_scaling_factor`` per expert [E, 1] and one ``activation_scaling_factor`` [1]
for all, the routers and shared-expert gates unquantized and listed in ``exclude_modules``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megapipe.checkpoint import quantized_linear as ql
from megapipe.checkpoint.hf.base import adapter_for_arch
from megapipe.checkpoint.hf.files import HF_DTYPE_NAMES
from megapipe.checkpoint.trt_files import save_safetensors, write_json
from megapipe.checkpoint.trt_source import AWQ, LAYER_LINEARS, QUANT_ALGO, Source
from megapipe.errors import ConfigError, MegapipeError

DECODER = {"llama": "llama", "mistral": "llama", "qwen2": "qwen", "qwen3": "qwen", "gpt2": "gpt", "mixtral": "llama",
           "qwen2_moe": "qwen", "qwen3_moe": "qwen"}
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")  # MoE architectures with legacy names
# TensorRT-LLM's MoeConfig.ExpertScaleNormalizationMode: top-k of the softmax as is, or renormalised over the k
NONE, RENORMALIZE = 0, 1
AWQ_VOCAB_MULTIPLE = 64  # ModelOpt pads the vocabulary of AWQ exports to this


@dataclass
class Linear:
    """A linear layer as the legacy checkpoint stores it (before the per-rank split and quantization)."""

    q: ql.QLinear
    column: bool
    activation_scaling_factor: Optional[torch.Tensor] = None
    weights_scaling_factor: Optional[torch.Tensor] = None
    weights_scaling_factor_2: Optional[torch.Tensor] = None
    prequant_scaling_factor: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, q: ql.QLinear, column: bool) -> "Linear":
        if q.fmt is None:
            return cls(q, column)
        kind = ql.WEIGHT_KIND[q.fmt]
        shape = {"fp8": "tensor", "int8": "channel", "int4": "block"}[kind]
        return cls(q, column,
                   activation_scaling_factor=ql.input_scale(q),
                   weights_scaling_factor=ql.scale(q.weight_amax, kind, shape, q.weight.shape[0]),
                   weights_scaling_factor_2=ql.weight_scale_2(q),
                   prequant_scaling_factor=None if q.pre_quant_scale is None else q.pre_quant_scale.squeeze())

    def replace(self, **kw) -> "Linear":
        return dataclasses.replace(self, **kw)


# --------------------------------------------------------------------------------------------------- checks


def check_legacy(src: Source, tp: int, pp: int) -> None:
    cfg, where = src.cfg, src.where
    if cfg.arch not in DECODER:
        raise MegapipeError(f"{where}: model.arch = {cfg.arch!r} has no legacy TensorRT-LLM names "
                            f"(legacy: {', '.join(DECODER)}): use --format unified")
    if src.fmt is not None and src.fmt not in QUANT_ALGO:
        raise MegapipeError(f"{where}: quantization format {src.fmt!r} has no legacy TensorRT-LLM export in megapipe "
                            f"(exported: {', '.join(QUANT_ALGO)})")
    if cfg.is_moe:
        check_moe(src)
    if cfg.sliding_window is not None:
        raise MegapipeError(f"{where}: model.sliding_window = {cfg.sliding_window} has no field in the legacy "
                            f"checkpoint (trtllm-build takes it as --max_attention_window_size): use --format unified")
    heads, kv = cfg.num_heads, cfg.kv_heads
    inter = cfg.expert_ffn if cfg.is_moe else cfg.intermediate_size
    if heads % tp:
        raise MegapipeError(f"--tp {tp} does not divide the model's {heads} attention heads")
    if kv % tp and tp % kv:
        raise MegapipeError(f"--tp {tp} cannot split the model's {kv} KV heads (one must divide the other)")
    if inter % tp:
        what = "expert FFN size (moe_ffn_hidden_size)" if cfg.is_moe else "intermediate_size"
        raise MegapipeError(f"--tp {tp} does not divide the model's {what} {inter}")
    shared = cfg.moe_shared_expert_intermediate_size if cfg.is_moe else None
    if shared and shared % tp:
        raise MegapipeError(f"--tp {tp} does not divide the model's moe_shared_expert_intermediate_size {shared}")
    if tp > kv and src.fmt == "int8_sq":
        raise MegapipeError(f"--tp {tp} > {kv} KV heads duplicates KV heads, which the per-channel INT8 scales of "
                            "int8_sq cannot follow (neither in ModelOpt): use --tp <= the KV heads")
    if cfg.num_layers % pp:
        raise MegapipeError(f"--pp {pp} does not divide the model's {cfg.num_layers} layers")
    if src.fmt in AWQ:
        block = src.block_size()
        for name, width in (("the attention output (heads x head_dim)", heads * cfg.dim_per_head),
                            ("intermediate_size", inter)):
            if (width // tp) % block:
                raise MegapipeError(f"{src.fmt} with --tp {tp}: {name} {width} / {tp} ranks is not a multiple of "
                                    f"the {block}-wide INT4 blocks")


def check_moe(src: Source) -> None:
    """A legacy MoE checkpoint routes as the HF architecture does (what its adapter can express: no sigmoid scores,
    expert bias, scaling or shared expert beyond it), with every layer MoE."""
    cfg, where = src.cfg, src.where
    if cfg.arch not in MOE_ARCHS:
        raise MegapipeError(f"{where}: model.arch = {cfg.arch!r} (MoE) has no legacy TensorRT-LLM names in megapipe "
                            f"(legacy MoE: {', '.join(MOE_ARCHS)}): use --format unified")
    adapter = adapter_for_arch(cfg.arch)
    try:
        adapter.hf_config(cfg)
    except ConfigError as e:
        raise MegapipeError(f"{where}: the routing cannot be expressed by TensorRT-LLM's {adapter.architecture} MoE: "
                            f"{e}") from None
    if src.fmt not in (None, "fp8"):
        raise MegapipeError(f"{where}: an MoE checkpoint quantized with {src.fmt} has no legacy TensorRT-LLM layout: "
                            "the legacy MoE plugin quantizes experts in FP8 or weight-only modes, not "
                            f"{QUANT_ALGO[src.fmt]}: use --format unified")
    dense = [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]
    if dense:
        raise MegapipeError(f"{where}: layers {dense} are dense (model.moe_layer_freq = {cfg.moe_layer_freq!r}, "
                            f"model.moe_first_k_dense_replace = {cfg.moe_first_k_dense_replace}): the legacy "
                            "TensorRT-LLM MoE models route every layer: use --format unified")


# --------------------------------------------------------------------------------------------------- layers


def _layer(src: Source, i: int, dtype: torch.dtype) -> dict:
    """Layer i as legacy parts: {"qkv": [q, k, v], "dense", "fc", "gate", "proj": Linear, norms, kv scales}."""
    state = src.layer(i)
    pre = f"layers.{i}."
    lin = {n: src.linear(state, pre + n, dtype) for n in LAYER_LINEARS}
    qkv = ql.fuse_group([lin["attention.wq"], lin["attention.wk"], lin["attention.wv"]])
    parts = {"qkv": [Linear.of(q, True) for q in qkv], "dense": Linear.of(lin["attention.wo"], False)}
    if f"{pre}moe.gate.weight" in state:
        # the router as a model loaded in the export dtype holds it, computed in fp32 by TensorRT-LLM
        parts["moe"] = {"router": state[f"{pre}moe.gate.weight"].to(dtype).float(), **_experts(src, state, pre, dtype)}
        if f"{pre}moe.shared_experts.w1.weight" in state:
            gate, up = ql.fuse_group([src.linear(state, f"{pre}moe.shared_experts.{w}", dtype) for w in ("w1", "w3")])
            parts["moe"]["shared"] = {"up": Linear.of(up, True), "gate": Linear.of(gate, True),
                                      "proj": Linear.of(src.linear(state, f"{pre}moe.shared_experts.w2", dtype), False),
                                      "shared_gate": state[f"{pre}moe.shared_gate.weight"].to(dtype)}
    else:
        fc, gate = lin["feed_forward.w1"], lin["feed_forward.w3"]
        if gate is not None and src.fmt == "fp8":  # TensorRT-LLM may fuse gate and fc for FP8
            fc, gate = ql.fuse_group([fc, gate])
        parts.update(fc=Linear.of(fc, True), proj=Linear.of(lin["feed_forward.w2"], False))
        if gate is not None:
            parts["gate"] = Linear.of(gate, True)
    norms = {"input_layernorm": "attention_norm", "post_layernorm": "ffn_norm",
             "attention.q_layernorm": "attention.q_norm", "attention.k_layernorm": "attention.k_norm"}
    for trt, ours in norms.items():
        for p in ("weight", "bias"):
            if f"{pre}{ours}.{p}" in state:
                parts[f"{trt}.{p}"] = state[f"{pre}{ours}.{p}"].to(dtype)
    k_amax, v_amax = src.kv_amax(state, i)
    if k_amax is not None:
        k, v = ql.kv_scale_legacy(k_amax), ql.kv_scale_legacy(v_amax)
        parts.update({"attention.k_cache_scaling_factor": k, "attention.v_cache_scaling_factor": v,
                      "attention.kv_cache_scaling_factor": torch.maximum(v, k)})
    return parts


def _experts(src: Source, state: dict, pre: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A layer's experts stacked: ``w1`` / ``w3`` [E, F, H], ``w2`` [E, H, F]; quantized (fp8), also the per-expert
    ``{fc,proj}.weights_scaling_factor`` [E, 1] and the one ``activation_scaling_factor`` [1] TensorRT-LLM's MoE
    plugin takes for all experts (ModelOpt's ``_build_stacked_linear``: the max over the experts)."""
    if f"{pre}moe.experts.gate_up_proj" not in state:
        return {w: state[f"{pre}moe.experts.{w}"].to(dtype) for w in ("w1", "w2", "w3")}
    experts = src.experts(state, f"{pre}moe.experts", dtype)
    out = {w: torch.stack([e[w].weight for e in experts]) for w in ("w1", "w2", "w3")}
    for name, w in (("fc", "w1"), ("proj", "w2")):
        linears = [Linear.of(e[w], True) for e in experts]
        out[f"{name}.weights_scaling_factor"] = torch.stack([lin.weights_scaling_factor for lin in linears])
        out[f"{name}.activation_scaling_factor"] = torch.stack(
            [lin.activation_scaling_factor for lin in linears]).max().unsqueeze(0)
    return out


def _dup_kv(t: Optional[torch.Tensor], head_size: int, kv: int, tp: int) -> Optional[torch.Tensor]:
    """Repeat each KV head (rows of ``head_size``) so that every one of ``tp`` ranks has one."""
    if t is None or tp <= kv:
        return t
    reps = tp // kv
    if t.dim() == 1:
        return t.view(-1, head_size, 1).repeat_interleave(reps, dim=0).reshape(-1).contiguous()
    return t.view(-1, head_size, t.shape[-1]).repeat_interleave(reps, dim=0).view(-1, t.shape[-1]).contiguous()


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended up to a multiple of ``multiple`` (a vocabulary split over ranks)."""
    extra = -t.shape[0] % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, extra)) if extra else t


def _split(lin: Linear, tp: int, r: int) -> Linear:
    """Rank r's part of a column or row linear (ModelOpt's split rules)."""
    if tp == 1:
        return lin
    q = lin.q
    if lin.column:
        weight = _pad_rows(q.weight, tp).chunk(tp, dim=0)[r]
        bias = q.bias.chunk(tp, dim=0)[r] if q.bias is not None else None
        wsf = lin.weights_scaling_factor
        if wsf is not None and wsf.numel() != 1:
            wsf = wsf.chunk(tp, dim=0)[r]
        return lin.replace(q=q.replace(weight=weight, bias=bias), weights_scaling_factor=wsf)
    weight = q.weight.chunk(tp, dim=1)[r]
    wsf = lin.weights_scaling_factor
    if wsf is not None and q.block_size:
        wsf = wsf.chunk(tp, dim=1)[r]
    pqs = lin.prequant_scaling_factor
    if pqs is not None:
        pqs = pqs.chunk(tp, dim=0)[r]
    return lin.replace(q=q.replace(weight=weight), weights_scaling_factor=wsf, prequant_scaling_factor=pqs)


def _merge(parts: list[Linear]) -> Linear:
    """Column linears of one rank that read one input (q, k, v; a shared expert's up and gate) -> the fused linear."""
    q = parts[0]

    def cat(name):
        values = [getattr(p.q, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    def top(name):
        values = [getattr(p, name) for p in parts]
        return None if any(x is None for x in values) else torch.stack(values).max(dim=0).values

    wsf = q.weights_scaling_factor
    if wsf is not None:
        wsf = torch.cat([p.weights_scaling_factor for p in parts]) if wsf.numel() != 1 else top("weights_scaling_factor")
    pqs = q.prequant_scaling_factor
    if pqs is not None and not all(torch.equal(pqs, p.prequant_scaling_factor) for p in parts):
        raise MegapipeError("fused linears do not share one pre_quant_scale after fusion")
    return Linear(q.q.replace(weight=cat("weight"), bias=cat("bias")), True,
                  activation_scaling_factor=top("activation_scaling_factor"), weights_scaling_factor=wsf,
                  weights_scaling_factor_2=top("weights_scaling_factor_2"), prequant_scaling_factor=pqs)


def _tensors(prefix: str, lin: Linear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The rank's tensors of one linear: the weight quantized now, float tensors in the export dtype."""
    q = lin.q
    weight = q.weight
    if q.fmt is not None and lin.weights_scaling_factor is not None:
        weight = ql.quantize_weight(q, lin.weights_scaling_factor)
        if q.fmt in AWQ:
            weight = weight.view(torch.int8)  # what trtllm-build reads (ModelOpt: "uint8 in a later release")
    out = {"weight": weight, "bias": q.bias, "activation_scaling_factor": lin.activation_scaling_factor,
           "weights_scaling_factor": lin.weights_scaling_factor,
           "weights_scaling_factor_2": lin.weights_scaling_factor_2,
           "prequant_scaling_factor": lin.prequant_scaling_factor}
    cast = ("weight", "bias", "prequant_scaling_factor")
    return {f"{prefix}.{k}": (v.to(dtype) if k in cast and v.is_floating_point() and v.element_size() > 1 else v)
            for k, v in out.items() if v is not None}


def _rank_layer(parts: dict, cfg, tp: int, r: int, dtype: torch.dtype, prefix: str) -> dict[str, torch.Tensor]:
    head, kv = cfg.dim_per_head, cfg.kv_heads
    q, k, v = parts["qkv"]
    k = k.replace(q=k.q.replace(weight=_dup_kv(k.q.weight, head, kv, tp), bias=_dup_kv(k.q.bias, head, kv, tp)),
                  weights_scaling_factor=_dup_kv(k.weights_scaling_factor, head, kv, tp)
                  if k.weights_scaling_factor is not None and k.weights_scaling_factor.numel() > 1
                  else k.weights_scaling_factor)
    v = v.replace(q=v.q.replace(weight=_dup_kv(v.q.weight, head, kv, tp), bias=_dup_kv(v.q.bias, head, kv, tp)),
                  weights_scaling_factor=_dup_kv(v.weights_scaling_factor, head, kv, tp)
                  if v.weights_scaling_factor is not None and v.weights_scaling_factor.numel() > 1
                  else v.weights_scaling_factor)
    out = _tensors(f"{prefix}.attention.qkv", _merge([_split(x, tp, r) for x in (q, k, v)]), dtype)
    out.update(_tensors(f"{prefix}.attention.dense", _split(parts["dense"], tp, r), dtype))
    for name in ("fc", "gate", "proj"):
        if name in parts:
            out.update(_tensors(f"{prefix}.mlp.{name}", _split(parts[name], tp, r), dtype))
    if "moe" in parts:
        out.update(_rank_experts(parts["moe"], tp, r, f"{prefix}.mlp", dtype))
    out.update({f"{prefix}.{k}": t for k, t in parts.items() if isinstance(t, torch.Tensor)})
    return out


def _rank_experts(moe: dict, tp: int, r: int, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rank r's experts: every expert's F split (w3 and w1 each, so each rank holds [its w3 | its w1]); quantized,
    each expert's weights by its own scale."""
    w1, w2, w3 = (moe[w].chunk(tp, dim=2 if w == "w2" else 1)[r] for w in ("w1", "w2", "w3"))
    out = {f"{prefix}.router.weight": moe["router"]}
    for name, weight in (("fc", torch.cat([w3, w1], dim=1)), ("proj", w2.contiguous())):
        scale = moe.get(f"{name}.weights_scaling_factor")
        if scale is not None:
            weight = (weight / scale.view(-1, 1, 1)).to(torch.float8_e4m3fn)
            out[f"{prefix}.{name}.weights_scaling_factor"] = scale
            out[f"{prefix}.{name}.activation_scaling_factor"] = moe[f"{name}.activation_scaling_factor"]
        out[f"{prefix}.{name}.weight"] = weight
    shared = moe.get("shared")
    if shared:
        fc = _merge([_split(shared["up"], tp, r), _split(shared["gate"], tp, r)])
        out.update(_tensors(f"{prefix}.shared_expert.fc", fc, dtype))
        out.update(_tensors(f"{prefix}.shared_expert.proj", _split(shared["proj"], tp, r), dtype))
        out[f"{prefix}.shared_expert_gate.weight"] = shared["shared_gate"]
    return out


def _embedding(t: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    return _pad_rows(t, tp).chunk(tp, dim=0)[r] if tp > 1 else t


# --------------------------------------------------------------------------------------------------- writing


def _vocab_table(src: Source, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The embedding or output table, padded as ModelOpt pads AWQ exports (to a multiple of 64 rows)."""
    table = src.read([name])[name].to(dtype)
    return _pad_rows(table, AWQ_VOCAB_MULTIPLE) if src.fmt in AWQ else table


def write_legacy(src: Source, out: Path, dtype: torch.dtype, tp: int = 1, pp: int = 1, progress=None, **_) -> dict:
    cfg = src.cfg
    per_stage = cfg.num_layers // pp
    vocab = -(-cfg.vocab_size // AWQ_VOCAB_MULTIPLE) * AWQ_VOCAB_MULTIPLE if src.fmt in AWQ else cfg.vocab_size
    # tied: the output projection is the embedding, written out as ModelOpt does for Hugging Face models
    head = "output.weight" if "output.weight" in src.stored else "tok_embeddings.weight"
    total, count, done = 0, 0, 0
    world = tp * pp
    for p in range(pp):
        for r in range(tp):  # one rank file in memory at a time; each layer is read again for each rank
            tensors: dict[str, torch.Tensor] = {}
            if p == 0:
                tensors["transformer.vocab_embedding.weight"] = _embedding(
                    _vocab_table(src, "tok_embeddings.weight", dtype), tp, r)
                if "pos_embeddings.weight" in src.stored:
                    tensors["transformer.position_embedding.weight"] = _embedding(
                        src.read(["pos_embeddings.weight"])["pos_embeddings.weight"].to(dtype), tp, r)
            for j in range(per_stage):
                parts = _layer(src, p * per_stage + j, dtype)
                tensors.update(_rank_layer(parts, cfg, tp, r, dtype, f"transformer.layers.{j}"))
                del parts
            if p == pp - 1:
                final = src.read([n for n in ("norm.weight", "norm.bias") if n in src.stored])
                tensors.update({f"transformer.ln_f.{k.split('.')[-1]}": v.to(dtype) for k, v in final.items()})
                tensors["lm_head.weight"] = _embedding(_vocab_table(src, head, dtype), tp, r)
            save_safetensors(tensors, out / f"rank{p * tp + r}.safetensors")
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            count += len(tensors)
            done += 1
            if progress:
                progress(done, world)
            del tensors
    write_json(out / "config.json", trt_config(src, dtype, tp, pp, vocab))
    if src.fmt is None:
        write_json(out / "quant_cfg.json", {"quant_algo": None, "kv_cache_quant_algo": None, "quantized_layers": {}})
    return {"tensors": count, "ranks": world, "bytes": total}


def trt_config(src: Source, dtype: torch.dtype, tp: int, pp: int, vocab: int) -> dict:
    cfg = src.cfg
    decoder = DECODER[cfg.arch]
    name = HF_DTYPE_NAMES[dtype]
    config = {
        "producer": {"name": "modelopt", "version": src.producer_version or _installed_modelopt()},
        "architecture": adapter_for_arch(cfg.arch).architecture,
        "dtype": name,
        "logits_dtype": "float16" if name == "bfloat16" else name,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "hidden_size": cfg.hidden_size,
        "norm_epsilon": cfg.norm_eps,
        "vocab_size": vocab,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": ("swiglu" if cfg.is_moe else "silu") if cfg.activation == "swiglu" else "gelu",
        "use_parallel_embedding": True,
        "embedding_sharding_dim": 0,
        "head_size": cfg.dim_per_head,
        "intermediate_size": cfg.expert_ffn if cfg.is_moe else cfg.intermediate_size,
        "position_embedding_type": "rope_gpt_neox" if cfg.position_embedding == "rope" else "learned_absolute",
        "share_embedding_table": False,
        "residual_mlp": False,
        "bias": cfg.attn_out_bias,
        "rotary_pct": 1.0,
        "rank": tp * pp - 1,
        "decoder": decoder,
        "rmsnorm": cfg.norm_type == "rmsnorm",
        "lm_head_bias": False,
    }
    if cfg.position_embedding == "rope":
        config["rotary_base"] = float(cfg.rope_theta)
        if cfg.rope_scaling:
            config["rotary_scaling"] = {"rope_type": "llama3", **cfg.rope_scaling}
    if decoder in ("llama", "qwen"):
        config.update(attn_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if decoder == "qwen":
        config["qwen_type"] = adapter_for_arch(cfg.arch).model_type
    config["mapping"] = {"world_size": tp * pp, "tp_size": tp, "pp_size": pp}
    if cfg.is_moe:
        config["mapping"].update(moe_tp_size=tp, moe_ep_size=1)
    if src.fmt is None:
        config["quantization"] = {"quant_algo": None, "kv_cache_quant_algo": None}
    else:
        quant = {"quant_algo": QUANT_ALGO[src.fmt], "kv_cache_quant_algo": "FP8" if src.kv_cache == "fp8" else None}
        if src.fmt in AWQ:
            quant.update(group_size=src.block_size(), has_zero_point=False, pre_quant_scale=True)
        quant["exclude_modules"] = ["lm_head", *_unquantized_moe_modules(cfg, pp)]
        config["quantization"] = quant
    if cfg.is_moe:
        # megapipe.models.moe.route: a softmax over the k chosen logits, or the top-k of the softmax renormalised
        renormalised = not cfg.moe_router_pre_softmax or (cfg.moe_router_norm_topk_prob and cfg.moe_router_topk > 1)
        config["moe"] = {"num_experts": cfg.num_experts, "top_k": cfg.moe_router_topk,
                         "normalization_mode": RENORMALIZE if renormalised else NONE}
        if decoder == "qwen":
            config["moe_intermediate_size"] = cfg.expert_ffn
            if cfg.moe_shared_expert_intermediate_size:
                config["moe_shared_expert_intermediate_size"] = cfg.moe_shared_expert_intermediate_size
    return config


def _unquantized_moe_modules(cfg, pp: int) -> list[str]:
    """The routers and shared-expert gates, named as ModelOpt lists them: those of one stage, numbered in it."""
    if not cfg.is_moe:
        return []
    gates = ("router", "shared_expert_gate") if cfg.moe_shared_expert_gate else ("router",)
    return [f"transformer.layers.{j}.mlp.{g}" for j in range(cfg.num_layers // pp) for g in gates]


def _installed_modelopt() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-modelopt")
    except importlib.metadata.PackageNotFoundError:
        return ""
