"""Tiny megapipe checkpoints of each architecture and their Hugging Face twins, for the quantization oracles.

Shared by tests/posttrain/test_quantize*.py and tests/checkpoint/test_trt*.py (imported by path: test dirs are not
packages). Every weight is random, norms and biases too, so a wrong name map or a fusion applied to the wrong
tensor shows up in the values.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

VOCAB = 512  # the tiny tokenizer's size (tests/conftest.py)
BASE = dict(vocab_size=VOCAB, make_vocab_size_divisible_by=1, hidden_size=128, intermediate_size=256, num_layers=2,
            num_heads=4, num_kv_heads=2, max_position_embeddings=256, norm_eps=1e-6, rope_theta=10000.0)
ARCHS = {
    "llama": dict(BASE, arch="llama"),
    "qwen2": dict(BASE, arch="qwen2", qkv_bias=True, tie_embeddings=True, rope_theta=1000000.0),
    "qwen3": dict(BASE, arch="qwen3", qk_norm=True, head_dim=64),
    "mistral": dict(BASE, arch="mistral", rope_theta=500000.0),
    "gpt2": dict(vocab_size=VOCAB, make_vocab_size_divisible_by=1, arch="gpt2", hidden_size=128,
                 intermediate_size=512, num_layers=2, num_heads=4, max_position_embeddings=256, norm_type="layernorm",
                 activation="gelu_tanh", position_embedding="learned", qkv_bias=True, attn_out_bias=True,
                 mlp_bias=True, tie_embeddings=True),
    # MoE: every layer routed (Mixtral), or a dense layer and a shared expert behind its gate (Qwen2-MoE)
    "mixtral": dict(BASE, arch="mixtral", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64),
    "qwen2_moe": dict(BASE, arch="qwen2_moe", qkv_bias=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                      moe_router_pre_softmax=True, moe_router_norm_topk_prob=False, moe_layer_freq=[1, 0],
                      moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True),
    "qwen3_moe": dict(BASE, arch="qwen3_moe", qk_norm=True, head_dim=64, num_experts=4, moe_router_topk=2,
                      moe_ffn_hidden_size=64, moe_router_pre_softmax=True),
}


def model_config(arch: str, **overrides):
    from megapipe.config import ModelConfig

    return ModelConfig(**{**ARCHS[arch], **overrides})


def make_checkpoint(path: Path, arch: str, tokenizer_dir: Path, seed: int = 0, dead: tuple[str, ...] = (),
                    **overrides) -> Path:
    """A random megapipe checkpoint of ``arch`` (weights N(0, 0.05), norms around 1, biases around 0). ``dead``:
    parameters set to zero, ``NAME`` whole or ``NAME:ROW`` one output row (calibration finds a zero amax there)."""
    from megapipe.checkpoint import write_checkpoint
    from megapipe.models import build_model

    cfg = model_config(arch, **overrides)
    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".attention_norm." in name or ".ffn_norm." in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias") or "norm" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        params = dict(model.named_parameters())
        for spec in dead:
            name, _, row = spec.partition(":")
            (params[name][int(row)] if row else params[name]).zero_()
    return write_checkpoint(path, model, manifest={"model": cfg, "stage": "pretrain"}, tokenizer=tokenizer_dir)


def hf_twin(ckpt: Path, tmp: Path, dtype: torch.dtype = torch.float32):
    """The Hugging Face model with the checkpoint's (unquantized) weights: ``export hf``, then from_pretrained."""
    import transformers

    from megapipe.checkpoint.hf import export_hf

    out = tmp / f"hf-twin-{ckpt.name}"
    if not out.exists():
        export_hf(ckpt, out, dtype="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    return model.eval()


def disabled_quantizers(twin):
    """``twin`` with ModelOpt's quantizer wrappers attached and every quantizer off: how ModelOpt's unified exporter
    takes a transformers >= 5 MoE model (it refuses the fused-expert modules it has not wrapped)."""
    import modelopt.torch.quantization as mtq

    from megapipe.checkpoint.quant_state import quiet

    dummy = torch.randint(0, twin.config.vocab_size, (1, 8))
    with torch.no_grad(), quiet():
        mtq.quantize(twin, {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"},
                     lambda m: m(dummy))
    return twin


def per_expert_layout(twin):
    """``twin`` (a transformers >= 5 Mixtral or Qwen-MoE: fused 3-D experts behind a router module) rebuilt, in
    place and with the same tensors, in the module layout the Hub's files describe and ModelOpt's TensorRT-LLM
    exporter reads: an ``nn.Linear`` router ``gate`` and a ModuleList of experts with ``w1`` (gate) / ``w2`` (down) /
    ``w3`` (up), Qwen's ``gate_proj`` / ``down_proj`` / ``up_proj``.

    Quantized fused experts (ModelOpt's wrapper) become quantized linears holding copies of their quantizers, as
    ModelOpt's own ``_export_fused_experts`` splits them: gate and up each a copy of the expert's one weight quantizer
    (per-tensor formats only: a per-channel amax would need its rows split), every expert the shared input quantizer.
    """
    import copy

    from modelopt.torch.quantization.nn import QuantModuleRegistry
    from torch import nn

    mixtral = twin.config.model_type == "mixtral"
    gate, down, up = ("w1", "w2", "w3") if mixtral else ("gate_proj", "down_proj", "up_proj")

    def linear(weight, weight_quantizer=None, input_quantizer=None):
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(weight)
        if weight_quantizer is None:
            return layer
        assert weight_quantizer.amax.numel() == 1, "per-tensor weight scales only"
        layer = QuantModuleRegistry.get(nn.Linear).convert(layer)
        layer.weight_quantizer, layer.input_quantizer = copy.deepcopy(weight_quantizer), copy.deepcopy(input_quantizer)
        return layer

    for block in twin.model.layers:
        moe = block.mlp
        if not hasattr(moe, "experts"):  # a dense layer
            continue
        experts, f = moe.experts, moe.experts.down_proj.shape[-1]
        quantized = hasattr(experts, "gate_up_proj_weight_quantizers")
        per_expert = nn.ModuleList()
        for e in range(experts.num_experts):
            first = second = ()
            if quantized:
                first = (experts.gate_up_proj_weight_quantizers[e], experts.gate_up_proj_input_quantizer)
                second = (experts.down_proj_weight_quantizers[e], experts.down_proj_input_quantizer)
            expert = nn.Module()
            setattr(expert, gate, linear(experts.gate_up_proj[e, :f], *first))
            setattr(expert, up, linear(experts.gate_up_proj[e, f:], *first))
            setattr(expert, down, linear(experts.down_proj[e], *second))
            per_expert.append(expert)
        moe.experts, moe.gate = per_expert, linear(moe.gate.weight)
    return twin


def windows_of(prefix, count: int, seq_length: int, first: int = 0) -> torch.Tensor:
    from megapipe.posttrain.quantize import token_stream, windows

    stream = token_stream(prefix, None, (first + count) * seq_length + 1)
    return windows(stream, count, seq_length, first)


QUANTIZER_KEY = re.compile(r"^(.*)\.((?:weight|input|output|[qkvp]_bmm)_quantizer(?:\.\d+)?"
                           r"|(?:gate_up|down)_proj_(?:weight_quantizers\.\d+|input_quantizer))\.(_[a-z_]+)$")


def hf_names(cfg) -> dict[str, str]:
    """megapipe tensor name -> HF tensor name (the bridge's conversions, 1:1 for the Llama-shaped models)."""
    from megapipe.checkpoint.hf.base import adapter_for_arch

    return {c.mp[0]: c.hf[0] for c in adapter_for_arch(cfg.arch).conversions(cfg)}


def twin_names(cfg) -> dict[str, str]:
    """megapipe tensor name -> the transformers model's state-dict name: ``hf_names``, but transformers 5's module
    paths for MoE (Mixtral's ``block_sparse_moe`` is ``mlp``; the experts are fused 3-D weights, as megapipe holds
    them once quantized: megapipe.models.fused_experts)."""
    names = {k: v.replace(".block_sparse_moe.", ".mlp.") for k, v in hf_names(cfg).items() if ".moe.experts." not in k}
    for i in cfg.moe_layers:
        names.update({f"layers.{i}.moe.experts.{w}": f"model.layers.{i}.mlp.experts.{w}"
                      for w in ("gate_up_proj", "down_proj")})
    return names


def quantized_twin(quantized_ckpt: Path, tmp: Path, dtype: torch.dtype):
    """The HF twin of a *quantized* megapipe checkpoint: its (smoothed) weights in ``dtype`` and ModelOpt
    quantizers attached the HF way, holding exactly the checkpoint's quantizer tensors (fp32)."""
    import transformers

    from megapipe.checkpoint import quant_state, read_manifest
    from megapipe.checkpoint.hf import export_hf
    from megapipe.checkpoint.load import load_model
    from megapipe.posttrain.quantize import quantize_config

    manifest = read_manifest(quantized_ckpt)
    parent = Path(manifest["parent"])
    ours = load_model(quantized_ckpt).model
    state = ours.state_dict()
    names = twin_names(ours.cfg)
    base = tmp / f"hf-base-{quantized_ckpt.name}"
    if not base.exists():
        export_hf(parent, base, dtype="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype).eval()
    # loading casts each to its parameter's dtype: the model's, or fp32 where transformers keeps it (a router)
    weights = {names[k]: v for k, v in state.items() if not quant_state.is_quantizer_tensor(k)}
    missing, unexpected = twin.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)

    q = manifest["quantization"]
    config = quantize_config(q["format"], q["kv_cache"])
    config["algorithm"] = "max"  # only to build the quantizers; every tensor is replaced below
    dummy = torch.randint(0, ours.cfg.vocab_size, (1, 8))
    with torch.no_grad(), quant_state.quiet():
        quant_state.mtq().quantize(twin, config, lambda m: m(dummy))
    modules = {k.rsplit(".", 1)[0]: v.rsplit(".", 1)[0] for k, v in names.items()}
    for key, tensor in state.items():
        m = QUANTIZER_KEY.match(key)
        if not m:
            continue
        module, quantizer, buffer = m.groups()
        hf_module = modules.get(module) or modules[module + ".wq"].rsplit(".", 1)[0]  # the attention itself
        target = twin.get_submodule(f"{hf_module}.{quantizer}")
        if hasattr(target, buffer):
            delattr(target, buffer)
        # quantizer state in float32, the AWQ/SmoothQuant input scale in the model's dtype (it multiplies activations)
        target.register_buffer(buffer, tensor.to(dtype) if buffer == "_pre_quant_scale" else tensor.clone())
    with torch.no_grad():
        twin.load_state_dict(weights, strict=False)  # max calibration did not touch them; make sure
    return twin


GPT2_MODULES = {"attention.wo": "attn.c_proj", "feed_forward.w1": "mlp.c_fc", "feed_forward.w2": "mlp.c_proj"}


def quantized_gpt2_twin(quantized_ckpt: Path, tmp: Path, dtype: torch.dtype):
    """GPT-2's twin for per-tensor formats (fp8): HF fuses q/k/v into one ``c_attn`` quantizer, which holds the
    max of megapipe's three weight amaxes (the input amax is one value: q, k and v read the same input)."""
    import transformers

    from megapipe.checkpoint import quant_state, read_manifest
    from megapipe.checkpoint.hf import export_hf
    from megapipe.checkpoint.load import load_model
    from megapipe.posttrain.quantize import quantize_config

    manifest = read_manifest(quantized_ckpt)
    q = manifest["quantization"]
    assert q["format"] == "fp8", "only per-tensor scales fuse without re-smoothing"
    base = tmp / f"hf-base-{quantized_ckpt.name}"
    if not base.exists():
        export_hf(Path(manifest["parent"]), base, dtype="fp32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype).eval()
    state = load_model(quantized_ckpt).model.state_dict()
    config = quantize_config(q["format"], q["kv_cache"])
    with torch.no_grad(), quant_state.quiet():
        quant_state.mtq().quantize(twin, config, lambda m: m(torch.randint(0, 100, (1, 8))))

    def put(module, quantizer, tensor):
        target = twin.get_submodule(f"{module}.{quantizer}")
        delattr(target, "_amax")
        target.register_buffer("_amax", tensor.clone())

    for i in range(twin.config.n_layer):
        pre, hf = f"layers.{i}.", f"transformer.h.{i}."
        qkv = [f"{pre}attention.{w}" for w in ("wq", "wk", "wv")]
        put(hf + "attn.c_attn", "weight_quantizer",
            torch.stack([state[f"{n}.weight_quantizer._amax"] for n in qkv]).max())
        put(hf + "attn.c_attn", "input_quantizer", state[f"{qkv[0]}.input_quantizer._amax"])
        for ours, theirs in GPT2_MODULES.items():
            for quantizer in ("weight_quantizer", "input_quantizer"):
                put(hf + theirs, quantizer, state[f"{pre}{ours}.{quantizer}._amax"])
        if q["kv_cache"]:
            for kv in ("k", "v"):
                put(hf + "attn", f"{kv}_bmm_quantizer", state[f"{pre}attention.{kv}_bmm_quantizer._amax"])
    return twin
