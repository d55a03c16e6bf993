"""`export trt` of mixture-of-experts checkpoints, unquantized and quantized (fp8, int8_sq), against NVIDIA ModelOpt's
own exporters of the HF twin.

- unified: ModelOpt's ``export_hf_checkpoint`` of the transformers twin writes the Hub's per-expert names; ours must
  hold the same tensors, bit for bit, the same config fields and hf_quant_config.json. Unquantized, the twin has
  quantizer wrappers attached, all off (ModelOpt 0.47 refuses transformers 5's fused experts otherwise); quantized,
  it holds the checkpoint's quantizer tensors in ModelOpt's wrapper of its fused experts (quant_twins.quantized_twin).
- legacy: ModelOpt's ``export_tensorrt_llm_checkpoint`` of the twin rebuilt in the Hub's per-expert module layout
  (the one its MoE code reads; transformers 5 fuses the experts when it loads; quantized experts split as ModelOpt's
  unified exporter splits them); every rank file identical, the config identical but for the fields TensorRT-LLM's
  own converter writes (test_trt_legacy's deviations, and the Qwen MoE fields ModelOpt does not write). fp8 only:
  TensorRT-LLM's legacy MoE plugin has no SmoothQuant mode.
- what TensorRT-LLM cannot run from megapipe's MoE (routing it has no mode for, shared experts without legacy
  names, int8_sq experts in the legacy plugin, INT4 experts ModelOpt cannot export) is refused with the culprit
  named, and nothing is left behind.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("modelopt")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "posttrain"))
sys.path.insert(0, str(Path(__file__).parent))

from quant_twins import (  # noqa: E402
    disabled_quantizers,
    hf_twin,
    make_checkpoint,
    model_config,
    per_expert_layout,
    quantized_twin,
)
from test_trt_legacy import _check_deviations, _checkpoint, _rank  # noqa: E402
from test_trt_unified import CONFIG_FIELDS, assert_same_tensors, tensors  # noqa: E402

from megapipe.checkpoint.quant_state import quiet  # noqa: E402
from megapipe.checkpoint.trt import export_trt  # noqa: E402
from megapipe.errors import MegapipeError  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MOE_FIELDS = {"num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
              "router_jitter_noise", "qkv_bias"}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run fastest on one thread (see tests/conftest.py)."""


def twin_of(ckpt: Path, tmp: Path, fmt, dtype: str):
    if fmt is None:
        return disabled_quantizers(hf_twin(ckpt, tmp, DTYPES[dtype]))
    return quantized_twin(ckpt, tmp, DTYPES[dtype])


UNIFIED = [("mixtral", None, None, "bf16"), ("qwen2_moe", None, None, "fp16"), ("qwen3_moe", None, None, "bf16"),
           ("mixtral", "fp8", "fp8", "bf16"), ("mixtral", "int8_sq", None, "bf16"), ("qwen2_moe", "fp8", None, "bf16"),
           ("qwen2_moe", "int8_sq", "fp8", "fp16"), ("qwen3_moe", "fp8", None, "fp16"),
           ("qwen3_moe", "int8_sq", "fp8", "bf16")]


@pytest.mark.parametrize("arch,fmt,kv,dtype", UNIFIED,
                         ids=[f"{a}-{f or 'none'}{'-kv' if k else ''}-{d}" for a, f, k, d in UNIFIED])
def test_unified_moe_export_equals_modelopt_export_hf_checkpoint(tiny_tokenizer_dir, pretrain_data, tmp_path, arch,
                                                                 fmt, kv, dtype):
    from modelopt.torch.export import export_hf_checkpoint

    ckpt = _checkpoint(tmp_path, tiny_tokenizer_dir, pretrain_data[0], arch, fmt, kv, {})
    summary = export_trt(ckpt, tmp_path / "ours", "unified", dtype=dtype)
    twin = twin_of(ckpt, tmp_path, fmt, dtype)
    with quiet():
        export_hf_checkpoint(twin, dtype=DTYPES[dtype], export_dir=tmp_path / "modelopt")

    ours, theirs = tensors(tmp_path / "ours"), tensors(tmp_path / "modelopt")
    assert any(".experts.3." in name for name in ours)  # the Hub's per-expert names
    assert_same_tensors(ours, theirs)
    if fmt is not None:  # quantized experts, unquantized routers
        router = "block_sparse_moe.gate" if arch == "mixtral" else "mlp.gate"
        expert = next(n for n in ours if ".experts.3." in n and n.endswith(".weight"))
        assert ours[expert].dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
        assert ours[expert.removesuffix("weight") + "input_scale"].shape == ()
        quant = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())
        assert quant == json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())
        assert f"model.layers.{model_config(arch).moe_layers[0]}.{router}" in quant["quantization"]["exclude_modules"]
    ours_cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    theirs_cfg = json.loads((tmp_path / "modelopt" / "config.json").read_text())
    for cfg in (ours_cfg, theirs_cfg):  # transformers' Qwen2-MoE config reads "no window" as 0, megapipe writes None
        if cfg.get("use_sliding_window") is False:
            cfg["sliding_window"] = None
    if arch == "qwen3_moe":  # transformers 5 saves the Hub's num_experts under its alias (attribute_map)
        assert ours_cfg["num_experts"] == theirs_cfg.pop("num_local_experts") == 4
        theirs_cfg["num_experts"] = 4
    for field in (CONFIG_FIELDS | MOE_FIELDS) & (set(ours_cfg) | set(theirs_cfg)):
        assert ours_cfg.get(field) == theirs_cfg.get(field), field
    assert summary["quantization"] == (fmt or "none") + (f" + kv {kv}" if kv else "")


# (arch, format, kv, tp, pp, dtype): experts split by TP, with KV heads duplicated at tp 4; layers over two stages
LEGACY = [("mixtral", None, None, 1, 1, "bf16"), ("mixtral", None, None, 2, 1, "fp16"),
          ("mixtral", None, None, 2, 2, "bf16"), ("mixtral", None, None, 4, 1, "bf16"),
          ("qwen3_moe", None, None, 1, 1, "bf16"), ("qwen3_moe", None, None, 2, 2, "fp16"),
          ("qwen2_moe", None, None, 1, 1, "bf16"), ("qwen2_moe", None, None, 2, 1, "fp16"),
          ("mixtral", "fp8", "fp8", 2, 1, "bf16"), ("mixtral", "fp8", None, 4, 1, "bf16"),
          ("qwen3_moe", "fp8", None, 2, 2, "bf16"), ("qwen2_moe", "fp8", "fp8", 2, 1, "fp16")]
DECODER = {"mixtral": "llama", "qwen2_moe": "qwen", "qwen3_moe": "qwen"}
ALL_MOE = {"qwen2_moe": {"moe_layer_freq": 1}}  # TensorRT-LLM's legacy MoE models route every layer


@pytest.mark.parametrize("arch,fmt,kv,tp,pp,dtype", LEGACY,
                         ids=[f"{a}-{f or 'none'}{'-kv' if k else ''}-tp{t}-pp{p}-{d}" for a, f, k, t, p, d in LEGACY])
def test_legacy_moe_equals_modelopt_export_tensorrt_llm_checkpoint(tiny_tokenizer_dir, pretrain_data, tmp_path, arch,
                                                                   fmt, kv, tp, pp, dtype):
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    ckpt = _checkpoint(tmp_path, tiny_tokenizer_dir, pretrain_data[0], arch, fmt, kv, ALL_MOE.get(arch, {}))
    summary = export_trt(ckpt, tmp_path / "ours", "legacy", dtype=dtype, tp=tp, pp=pp)
    twin = per_expert_layout(twin_of(ckpt, tmp_path, fmt, dtype) if fmt else hf_twin(ckpt, tmp_path, DTYPES[dtype]))
    with quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_tensorrt_llm_checkpoint(twin, DECODER[arch], dtype=DTYPES[dtype], export_dir=tmp_path / "modelopt",
                                       inference_tensor_parallel=tp, inference_pipeline_parallel=pp)

    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "modelopt"
    assert sorted(p.name for p in ours_dir.iterdir()) == sorted(p.name for p in theirs_dir.iterdir())
    assert summary["ranks"] == tp * pp
    for rank in range(tp * pp):
        ours = _rank(ours_dir, rank)
        assert_same_tensors(ours, _rank(theirs_dir, rank))
        fc = ours["transformer.layers.0.mlp.fc.weight"]
        assert fc.shape == (4, 2 * 64 // tp, 128)
        assert ours["transformer.layers.0.mlp.router.weight"].dtype == torch.float32
        if fmt:  # one FP8 scale per expert, one activation scale for all (TensorRT-LLM's MoE plugin)
            assert fc.dtype == torch.float8_e4m3fn
            assert ours["transformer.layers.0.mlp.fc.weights_scaling_factor"].shape == (4, 1)
            assert ours["transformer.layers.0.mlp.fc.activation_scaling_factor"].shape == (1,)
    ours_cfg = json.loads((ours_dir / "config.json").read_text())
    theirs_cfg = json.loads((theirs_dir / "config.json").read_text())
    if fmt:  # the routers and gates ModelOpt excludes come from a set, in no particular order
        theirs_cfg["quantization"]["exclude_modules"].sort()
        assert "transformer.layers.0.mlp.router" in ours_cfg["quantization"]["exclude_modules"]
    _check_deviations(ours_cfg, theirs_cfg, arch, tp, pp)
    if arch != "mixtral":  # the expert width TensorRT-LLM's Qwen reads (its converter writes it; ModelOpt does not)
        assert ours_cfg.pop("moe_intermediate_size") == 64
    if arch == "qwen2_moe":  # ModelOpt writes no MoE fields at all here: TensorRT-LLM's converter's
        assert ours_cfg.pop("moe_shared_expert_intermediate_size") == 96
        assert ours_cfg.pop("moe") == {"num_experts": 4, "top_k": 2, "normalization_mode": 0}  # no norm_topk_prob
        assert (ours_cfg["mapping"].pop("moe_tp_size"), ours_cfg["mapping"].pop("moe_ep_size")) == (tp, 1)
    else:
        assert ours_cfg["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": 1}
        assert (ours_cfg["mapping"]["moe_tp_size"], ours_cfg["mapping"]["moe_ep_size"]) == (tp, 1)
    assert ours_cfg == theirs_cfg


def test_legacy_mixtral_rank_files_hold_each_experts_slice(tiny_tokenizer_dir, tmp_path):
    """Independent of ModelOpt: rank r's fc is [w3 rows of r | w1 rows of r] of every expert, its proj w2's columns."""
    from megapipe.checkpoint.load import load_model

    ckpt = make_checkpoint(tmp_path / "ckpt", "mixtral", tiny_tokenizer_dir)
    export_trt(ckpt, tmp_path / "out", "legacy", dtype="bf16", tp=2)
    experts = load_model(ckpt, dtype=torch.bfloat16).model.layers["1"].moe.experts
    for r in range(2):
        rank = _rank(tmp_path / "out", r)
        rows = slice(32 * r, 32 * (r + 1))
        assert torch.equal(rank["transformer.layers.1.mlp.fc.weight"],
                           torch.cat([experts.w3[:, rows], experts.w1[:, rows]], dim=1))
        assert torch.equal(rank["transformer.layers.1.mlp.proj.weight"], experts.w2[:, :, rows])


# --------------------------------------------------------------------------------------------------- errors


def _error(ckpt, out: Path, fmt: str, **kw) -> str:
    with pytest.raises(MegapipeError) as e:
        export_trt(ckpt, out, fmt, **kw)
    assert not out.exists() and not any(".tmp-" in p.name for p in out.parent.iterdir())
    return str(e.value)


@pytest.mark.parametrize("field,value", [
    ("moe_router_score_function", "sigmoid"),
    ("moe_router_enable_expert_bias", True),
    ("moe_router_topk_scaling_factor", 2.5),
    ("moe_shared_expert_intermediate_size", 96),
    ("moe_layer_freq", [1, 0]),  # a dense layer
])
def test_mixtral_routing_trt_cannot_express_is_refused(tiny_tokenizer_dir, tmp_path, field, value):
    ckpt = make_checkpoint(tmp_path / "ckpt", "mixtral", tiny_tokenizer_dir, **{field: value})
    legacy = _error(ckpt, tmp_path / "legacy", "legacy")
    assert "cannot be expressed by TensorRT-LLM's MixtralForCausalLM MoE" in legacy
    assert f"model.{field} = {value!r}" in legacy
    assert f"model.{field} = {value!r}" in _error(ckpt, tmp_path / "unified", "unified")


def test_legacy_normalization_mode_follows_the_routing(tiny_tokenizer_dir, tmp_path):
    """ModelOpt writes 1 (renormalise) for every MoE; Qwen3-MoE without norm_topk_prob keeps the top-k softmax
    weights as they are: TensorRT-LLM's mode 0 (NONE)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", "qwen3_moe", tiny_tokenizer_dir, moe_router_norm_topk_prob=False)
    export_trt(ckpt, tmp_path / "out", "legacy")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["moe"]["normalization_mode"] == 0


def test_legacy_moe_refusals(tiny_tokenizer_dir, tmp_path):
    qwen = make_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe", tiny_tokenizer_dir)  # layer 1 dense
    assert "layers [1] are dense (model.moe_layer_freq = [1, 0]" in _error(qwen, tmp_path / "a", "legacy")
    wide = make_checkpoint(tmp_path / "wide", "qwen2_moe", tiny_tokenizer_dir, moe_layer_freq=1,
                           moe_shared_expert_intermediate_size=98)
    assert "--tp 4 does not divide the model's moe_shared_expert_intermediate_size 98" in _error(
        wide, tmp_path / "e", "legacy", tp=4)
    llama = make_checkpoint(tmp_path / "llama_moe", "llama", tiny_tokenizer_dir, num_experts=4, moe_ffn_hidden_size=64)
    assert "model.arch = 'llama' (MoE) has no legacy TensorRT-LLM names" in _error(llama, tmp_path / "d", "legacy")
    odd = make_checkpoint(tmp_path / "odd", "mixtral", tiny_tokenizer_dir, moe_ffn_hidden_size=60, num_heads=8,
                          num_kv_heads=8)
    assert "--tp 8 does not divide the model's expert FFN size (moe_ffn_hidden_size) 60" in _error(
        odd, tmp_path / "b", "legacy", tp=8)
    window = make_checkpoint(tmp_path / "window", "mixtral", tiny_tokenizer_dir, sliding_window=64)
    assert "sliding_window = 64 has no field in the legacy checkpoint" in _error(window, tmp_path / "c", "legacy")


def test_quantized_moe_without_a_layout_is_refused(tiny_tokenizer_dir, pretrain_data, tmp_path):
    """int8_sq experts have no legacy MoE plugin mode; INT4 experts no export ModelOpt writes (its 0.47
    export_hf_checkpoint fails on them), so none to check megapipe's against."""
    sq = _checkpoint(tmp_path / "sq", tiny_tokenizer_dir, pretrain_data[0], "mixtral", "int8_sq", None, {})
    message = _error(sq, tmp_path / "a", "legacy")
    assert "an MoE checkpoint quantized with int8_sq has no legacy TensorRT-LLM layout" in message
    awq = _checkpoint(tmp_path / "awq", tiny_tokenizer_dir, pretrain_data[0], "mixtral", "int4_awq", None, {})
    for fmt in ("unified", "legacy"):
        message = _error(awq, tmp_path / fmt, fmt)
        assert "an MoE checkpoint quantized with int4_awq has no TensorRT-LLM export in megapipe" in message
        assert f"quantize its parent {tmp_path / 'awq' / 'base'} with fp8 or int8_sq" in message


def test_cli_moe(tiny_tokenizer_dir, tmp_path):
    from megapipe.cli import main

    ckpt = make_checkpoint(tmp_path / "ckpt", "mixtral", tiny_tokenizer_dir)
    assert main(["export", "trt", str(ckpt), str(tmp_path / "legacy"), "--format", "legacy", "--tp", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "legacy").iterdir()) == ["config.json", "quant_cfg.json",
                                                                        "rank0.safetensors", "rank1.safetensors"]
