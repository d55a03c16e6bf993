"""`export trt --format legacy` (trtllm-build rank files) against NVIDIA ModelOpt's ``export_tensorrt_llm_checkpoint``.

Oracle: ModelOpt exports the HF twin (same weights, quantizers holding the same tensors) for the same tp x pp;
every rank file must hold the same names, shapes, dtypes and bits, and config.json the same fields. Where
ModelOpt's config falls back to wrong values without TensorRT-LLM installed, megapipe writes what TensorRT-LLM's
own converter writes; those fields are checked on their own (DEVIATIONS).
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

from quant_twins import hf_twin, make_checkpoint, model_config, quantized_gpt2_twin, quantized_twin  # noqa: E402
from test_trt_unified import DEAD, assert_same_tensors  # noqa: E402

from megapipe.checkpoint.quant_state import quiet  # noqa: E402
from megapipe.checkpoint.trt import export_trt  # noqa: E402
from megapipe.errors import MegapipeError  # noqa: E402
from megapipe.posttrain.quantize import quantize_checkpoint  # noqa: E402

WIDE = dict(hidden_size=256, intermediate_size=512)  # INT4 blocks of 128 on each of 2 ranks
GQA4 = dict(hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=2)  # ... on 4 ranks, 2 KV heads
FP16 = {("mistral", "fp8"), ("qwen3", "int8_sq"), ("gpt2", None)}  # exported in fp16, the others in bf16
DECODER = {"llama": "llama", "mistral": "llama", "qwen2": "qwen", "qwen3": "qwen", "gpt2": "gpt", "mixtral": "llama",
           "qwen2_moe": "qwen", "qwen3_moe": "qwen"}
# (arch, format, kv, tp, pp, checkpoint overrides); every CPU format on each architecture with legacy names
CASES = [
    ("llama", None, None, 1, 1, {}),
    ("llama", "fp8", "fp8", 2, 2, {}),
    ("llama", "fp8", None, 4, 1, {}),  # 2 KV heads on 4 ranks: duplicated
    ("llama", "int8_sq", "fp8", 2, 1, {}),
    ("llama", "int4_awq", None, 2, 1, WIDE),
    ("llama", "w4a8_awq", "fp8", 1, 2, {}),
    ("qwen2", None, None, 2, 2, {"vocab_size": 515}),  # tied; the vocabulary padded for 2 ranks
    ("qwen2", "fp8", "fp8", 2, 1, {}),
    ("qwen2", "int8_sq", None, 2, 1, {}),
    ("qwen2", "int4_awq", None, 1, 1, {}),
    ("qwen2", "w4a8_awq", "fp8", 4, 1, GQA4),  # INT4 block scales follow the duplicated KV heads
    ("qwen3", None, None, 1, 2, {}),
    ("qwen3", "fp8", "fp8", 1, 2, {}),
    ("qwen3", "int8_sq", None, 2, 1, {}),
    ("qwen3", "int4_awq", "fp8", 1, 1, {}),
    ("qwen3", "w4a8_awq", None, 2, 1, WIDE),
    ("mistral", None, None, 2, 1, {}),
    ("mistral", "fp8", None, 1, 1, {}),
    ("mistral", "int8_sq", "fp8", 1, 2, {}),
    ("mistral", "int4_awq", "fp8", 1, 1, {"vocab_size": 544}),  # AWQ pads the vocabulary to a multiple of 64
    ("mistral", "w4a8_awq", None, 2, 2, WIDE),
    ("gpt2", None, None, 2, 1, {}),
    ("gpt2", "fp8", "fp8", 2, 1, {}),
    ("llama", "fp8", "fp8", 1, 1, {"dead": DEAD}),  # zero amaxes (see DEAD)
    ("llama", "int8_sq", "fp8", 2, 1, {"dead": DEAD}),
]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run fastest on one thread (see tests/conftest.py)."""


def _id(case) -> str:
    arch, fmt, kv, tp, pp, over = case
    return f"{arch}-{fmt or 'bf16'}{'-kv' if kv else ''}-tp{tp}-pp{pp}" + ("-" + "-".join(over) if over else "")


def _checkpoint(tmp: Path, tokenizer_dir, data, arch, fmt, kv, overrides) -> Path:
    base = make_checkpoint(tmp / "base", arch, tokenizer_dir, **overrides)
    if fmt is None:
        return base
    quantize_checkpoint(base, tmp / "q", fmt, data, kv_cache=kv, calib_samples=4, seq_length=64, batch_size=2,
                        eval_iters=0)
    return tmp / "q"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_legacy_export_equals_modelopt_export_tensorrt_llm_checkpoint(tiny_tokenizer_dir, pretrain_data, tmp_path,
                                                                      case):
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    arch, fmt, kv, tp, pp, overrides = case
    dtype, torch_dtype = ("fp16", torch.float16) if (arch, fmt) in FP16 else ("bf16", torch.bfloat16)
    ckpt = _checkpoint(tmp_path, tiny_tokenizer_dir, pretrain_data[0], arch, fmt, kv, overrides)
    summary = export_trt(ckpt, tmp_path / "ours", "legacy", dtype=dtype, tp=tp, pp=pp)
    if fmt is None:
        twin = hf_twin(ckpt, tmp_path, torch_dtype)
    elif arch == "gpt2":
        twin = quantized_gpt2_twin(ckpt, tmp_path, torch_dtype)
    else:
        twin = quantized_twin(ckpt, tmp_path, torch_dtype)
    with quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_tensorrt_llm_checkpoint(twin, DECODER[arch], dtype=torch_dtype, export_dir=tmp_path / "modelopt",
                                       inference_tensor_parallel=tp, inference_pipeline_parallel=pp)

    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "modelopt"
    assert sorted(p.name for p in ours_dir.iterdir()) == sorted(p.name for p in theirs_dir.iterdir())
    assert summary["ranks"] == tp * pp
    for rank in range(tp * pp):
        assert_same_tensors(_rank(ours_dir, rank), _rank(theirs_dir, rank))

    ours_cfg = json.loads((ours_dir / "config.json").read_text())
    theirs_cfg = json.loads((theirs_dir / "config.json").read_text())
    _check_deviations(ours_cfg, theirs_cfg, arch, tp, pp)
    assert ours_cfg == theirs_cfg
    if fmt is None:
        assert json.loads((ours_dir / "quant_cfg.json").read_text()) == json.loads(
            (theirs_dir / "quant_cfg.json").read_text())


def test_legacy_export_merges_lora_adapters_as_the_hf_export_does(tiny_tokenizer_dir, tmp_path):
    """A LoRA checkpoint's legacy rank files hold the merged weights: ModelOpt's export of the merged ``export hf``
    twin, bit for bit, and not the base model's."""
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    from megapipe.checkpoint import write_checkpoint
    from megapipe.checkpoint.load import load_model
    from megapipe.models.lora import LoRASpec, apply_lora, lora_layers

    base = make_checkpoint(tmp_path / "base", "llama", tiny_tokenizer_dir)
    spec = LoRASpec(rank=2, alpha=4.0, dropout=0.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    model = apply_lora(load_model(base).model, spec, seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, m in lora_layers(model):  # fresh adapters are zero: make them count
            m.lora_B.weight.copy_(0.05 * torch.randn(m.lora_B.weight.shape, generator=g))
    lora = write_checkpoint(tmp_path / "lora", model, manifest={"model": model_config("llama"), "stage": "sft",
                                                                "lora": spec.to_manifest()}, tokenizer=tiny_tokenizer_dir)
    export_trt(lora, tmp_path / "ours", "legacy", dtype="bf16", tp=2)
    export_trt(base, tmp_path / "base-trt", "legacy", dtype="bf16", tp=2)
    with quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_tensorrt_llm_checkpoint(hf_twin(lora, tmp_path, torch.bfloat16), "llama", dtype=torch.bfloat16,
                                       export_dir=tmp_path / "modelopt", inference_tensor_parallel=2)
    for rank in range(2):
        ours = _rank(tmp_path / "ours", rank)
        assert_same_tensors(ours, _rank(tmp_path / "modelopt", rank))
        plain = _rank(tmp_path / "base-trt", rank)
        for name in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
            key = f"transformer.layers.0.{name}.weight"
            assert not torch.equal(ours[key], plain[key]), key


def _rank(directory: Path, rank: int) -> dict:
    from safetensors import safe_open

    with safe_open(directory / f"rank{rank}.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _check_deviations(ours: dict, theirs: dict, arch: str, tp: int, pp: int) -> None:
    """The fields where megapipe writes what TensorRT-LLM's converter writes; afterwards both configs are equal."""

    cfg = model_config(arch)
    if cfg.position_embedding == "rope":
        assert ours.pop("rotary_base") == theirs.pop("rotary_base", cfg.rope_theta) == cfg.rope_theta
        assert theirs.pop("position_embedding_type") == ours.pop("position_embedding_type") == "rope_gpt_neox"
    else:
        assert theirs.pop("position_embedding_type") == "rope_gpt_neox"  # ModelOpt's fallback for every model
        assert ours.pop("position_embedding_type") == "learned_absolute"
    if DECODER[arch] in ("llama", "qwen"):
        assert (ours.pop("attn_bias"), ours.pop("mlp_bias")) == (cfg.qkv_bias, cfg.mlp_bias)
    if DECODER[arch] == "qwen":
        assert ours.pop("qwen_type") == arch


# --------------------------------------------------------------------------------------------------- errors


def test_legacy_refusals(tiny_tokenizer_dir, pretrain_data, tmp_path):
    base = make_checkpoint(tmp_path / "base", "llama", tiny_tokenizer_dir)

    def error(ckpt, **kw) -> str:
        with pytest.raises(MegapipeError) as e:
            export_trt(ckpt, tmp_path / "out", "legacy", **kw)
        assert not any(".tmp-" in p.name for p in tmp_path.iterdir())
        return str(e.value)

    assert "--tp 3 does not divide the model's 4 attention heads" in error(base, tp=3)
    assert "--pp 3 does not divide the model's 2 layers" in error(base, pp=3)
    assert "--tp 0 must be at least 1" in error(base, tp=0)
    odd_kv = make_checkpoint(tmp_path / "kv3", "llama", tiny_tokenizer_dir, num_heads=6, num_kv_heads=3,
                             hidden_size=192)
    assert "cannot split the model's 3 KV heads" in error(odd_kv, tp=2)
    window = make_checkpoint(tmp_path / "window", "mistral", tiny_tokenizer_dir, sliding_window=64)
    assert "sliding_window = 64 has no field in the legacy checkpoint" in error(window)

    quantize_checkpoint(base, tmp_path / "awq", "int4_awq", pretrain_data[0], calib_samples=2, seq_length=32,
                        eval_iters=0)
    assert "int4_awq with --tp 2" in error(tmp_path / "awq", tp=2)
    quantize_checkpoint(base, tmp_path / "sq", "int8_sq", pretrain_data[0], calib_samples=2, seq_length=32,
                        eval_iters=0)
    assert "duplicates KV heads" in error(tmp_path / "sq", tp=4)


def test_architecture_without_legacy_names_is_refused(tiny_tokenizer_dir, tmp_path, monkeypatch):
    from megapipe.checkpoint import trt_legacy

    base = make_checkpoint(tmp_path / "base", "qwen3", tiny_tokenizer_dir)
    monkeypatch.delitem(trt_legacy.DECODER, "qwen3")
    with pytest.raises(MegapipeError, match="'qwen3' has no legacy TensorRT-LLM names"):
        export_trt(base, tmp_path / "out", "legacy")


def test_cli_export_trt(tiny_tokenizer_dir, pretrain_data, tmp_path, capsys):
    from megapipe.cli import main

    base = make_checkpoint(tmp_path / "base", "llama", tiny_tokenizer_dir)
    quantize_checkpoint(base, tmp_path / "q", "fp8", pretrain_data[0], kv_cache="fp8", calib_samples=2,
                        seq_length=32, eval_iters=0)
    assert main(["export", "trt", str(tmp_path / "q"), str(tmp_path / "legacy"), "--format", "legacy",
                 "--tp", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "legacy").iterdir()) == ["config.json", "rank0.safetensors",
                                                                        "rank1.safetensors"]
    assert main(["export", "trt", str(tmp_path / "q"), str(tmp_path / "unified")]) == 0
    assert "fp8 + kv fp8" in capsys.readouterr().out
    assert main(["export", "trt", str(tmp_path / "q"), str(tmp_path / "x"), "--format", "legacy", "--tp", "3"]) == 2
    assert "--tp 3 does not divide the model's 4 attention heads" in capsys.readouterr().err
    assert main(["export", "hf", str(tmp_path / "q"), str(tmp_path / "hf")]) == 2
    assert "export trt CKPT OUT --format unified" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("fmt", ["int8_sq", "int4_awq"])
def test_gpt2_smoothed_qkv_dequantizes_to_the_fake_quant_weights(tiny_tokenizer_dir, pretrain_data, tmp_path, fmt):
    """GPT-2's HF twin fuses q/k/v into one Conv1D quantizer, so SmoothQuant/AWQ states (one smoothing vector per
    projection in megapipe) have no ModelOpt counterpart to compare with. Instead: the exported fused qkv, scaled back
    (INT values x weight scales x the shared pre_quant_scale), equals each projection's weight x its own scale."""
    from megapipe.checkpoint.load import load_model

    ckpt = _checkpoint(tmp_path, tiny_tokenizer_dir, pretrain_data[0], "gpt2", fmt, None, {})
    export_trt(ckpt, tmp_path / "out", "legacy", dtype="bf16")
    rank = _rank(tmp_path / "out", 0)
    pre = "transformer.layers.0.attention.qkv."
    ints, scales = rank[pre + "weight"], rank[pre + "weights_scaling_factor"]
    if fmt == "int4_awq":  # two INT4 values per byte along the output rows, [out/2, in] -> [out, in]
        b = ints.view(torch.uint8).to(torch.int16)
        low, high = ((b & 0x0F) ^ 8) - 8, ((b >> 4) ^ 8) - 8
        ints = torch.stack([low, high], dim=1).reshape(-1, b.shape[1])
        scales = scales.repeat_interleave(128, dim=1)
    else:
        scales = scales[:, None]
    smoothed = ints.float() * scales * rank[pre + "prequant_scaling_factor"].float()
    model = load_model(ckpt).model
    attn = model.layers["0"].attention
    want = torch.cat([w.weight * w.input_quantizer._pre_quant_scale for w in (attn.wq, attn.wk, attn.wv)])
    step = (scales * rank[pre + "prequant_scaling_factor"].float()).expand_as(want)
    assert ((smoothed - want).abs() <= 0.51 * step + 0.02 * want.abs()).all()
