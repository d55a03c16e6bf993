"""`export trt --format unified` against NVIDIA ModelOpt's own ``export_hf_checkpoint``.

Oracle: the HF twin of the quantized checkpoint (same weights, ModelOpt quantizers holding the same tensors) is
exported by ModelOpt; our export of the megapipe checkpoint must hold the same tensor names, shapes, dtypes and
values (bit for bit) and the same quantization config. Unquantized, the unified export is a Hugging Face directory
that transformers loads with megapipe's logits.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("modelopt")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "posttrain"))

from quant_twins import make_checkpoint, quantized_twin, windows_of  # noqa: E402
from safetensors import safe_open  # noqa: E402

from megapipe.checkpoint.load import load_model  # noqa: E402
from megapipe.checkpoint.quant_state import quiet  # noqa: E402
from megapipe.checkpoint.trt import export_trt  # noqa: E402
from megapipe.errors import MegapipeError  # noqa: E402
from megapipe.posttrain.quantize import evaluate, quantize_checkpoint  # noqa: E402

CASES = [  # every format ModelOpt exports on CPU, on each Llama-shaped architecture (some with the KV cache, fp16)
    ("llama", "fp8", "fp8", "bf16"), ("llama", "int8_sq", None, "bf16"), ("llama", "int4_awq", "fp8", "bf16"),
    ("llama", "w4a8_awq", None, "fp16"),
    ("qwen2", "fp8", None, "bf16"), ("qwen2", "int8_sq", "fp8", "fp16"), ("qwen2", "int4_awq", None, "bf16"),
    ("qwen2", "w4a8_awq", "fp8", "bf16"),
    ("qwen3", "fp8", "fp8", "bf16"), ("qwen3", "int8_sq", None, "bf16"), ("qwen3", "int4_awq", None, "fp16"),
    ("qwen3", "w4a8_awq", "fp8", "bf16"),
    ("mistral", "fp8", None, "fp16"), ("mistral", "int8_sq", "fp8", "bf16"), ("mistral", "int4_awq", "fp8", "bf16"),
    ("mistral", "w4a8_awq", None, "bf16"),
]
CONFIG_FIELDS = {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                 "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "sliding_window",
                 "dtype", "quantization_config"}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run fastest on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_tokenizer_dir, pretrain_data):
    """(arch, fmt, kv) -> a quantized checkpoint, made once per module."""
    root = tmp_path_factory.mktemp("trt-unified")
    prefix, _ = pretrain_data
    made = {}

    def get(arch, fmt, kv):
        key = (arch, fmt, kv)
        if key not in made:
            base = root / f"{arch}-base"
            if not base.exists():
                make_checkpoint(base, arch, tiny_tokenizer_dir)
            out = root / f"{arch}-{fmt}-{kv}"
            quantize_checkpoint(base, out, fmt, prefix, kv_cache=kv, calib_samples=4, seq_length=64, batch_size=2,
                                eval_iters=0)
            made[key] = out
        return made[key]

    return get


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def assert_same_tensors(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs), (sorted(set(ours) ^ set(theirs)))
    for name in ours:
        a, b = ours[name], theirs[name]
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), name
        assert same_bits(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("arch,fmt,kv,dtype", CASES, ids=[f"{a}-{f}{'-kv' if k else ''}-{d}" for a, f, k, d in CASES])
def test_unified_export_equals_modelopt_export_hf_checkpoint(quantized, tmp_path, arch, fmt, kv, dtype):
    from modelopt.torch.export import export_hf_checkpoint

    ckpt = quantized(arch, fmt, kv)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    summary = export_trt(ckpt, tmp_path / "ours", "unified", dtype=dtype)
    twin = quantized_twin(ckpt, tmp_path, torch_dtype)
    with quiet():
        export_hf_checkpoint(twin, dtype=torch_dtype, export_dir=tmp_path / "modelopt")

    assert_same_tensors(tensors(tmp_path / "ours"), tensors(tmp_path / "modelopt"))
    ours_cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    theirs_cfg = json.loads((tmp_path / "modelopt" / "config.json").read_text())
    for field in CONFIG_FIELDS & (set(ours_cfg) | set(theirs_cfg)):
        assert ours_cfg.get(field) == theirs_cfg.get(field), field
    assert json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text()) == json.loads(
        (tmp_path / "modelopt" / "hf_quant_config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "ours" / name).is_file()
    assert summary["quantization"].startswith(fmt)


# layer 0's value projection is all zero: its weight amax, the value cache's amax and the output projection's input
# amax calibrate to 0; one output row of layer 1's gate projection is zero: a zero per-channel / per-block weight amax
DEAD = ("layers.0.attention.wv.weight", "layers.1.feed_forward.w1.weight:5")


@pytest.mark.parametrize("fmt", ["fp8", "int8_sq", "int4_awq", "w4a8_awq"])
def test_a_zero_amax_follows_modelopts_export_rule(tiny_tokenizer_dir, pretrain_data, tmp_path, fmt):
    """A dead weight or activation (a zero amax) gets ModelOpt's rule (export_amax: zero -> max bound, a scale of
    1) in every exported scale, so the file equals ModelOpt's bit for bit except where ModelOpt's unified exporter
    divides the raw amax instead: the FP8 weight scale and the KV cache scales, 0 there (and FP8 weights 0 / 0, NaN)."""
    from modelopt.torch.export import export_hf_checkpoint

    base = make_checkpoint(tmp_path / "base", "llama", tiny_tokenizer_dir, dead=DEAD)
    quantize_checkpoint(base, tmp_path / "q", fmt, pretrain_data[0], kv_cache="fp8", calib_samples=4,
                        seq_length=64, batch_size=2, eval_iters=0)
    export_trt(tmp_path / "q", tmp_path / "ours", "unified", dtype="bf16")
    twin = quantized_twin(tmp_path / "q", tmp_path, torch.bfloat16)
    with quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_hf_checkpoint(twin, dtype=torch.bfloat16, export_dir=tmp_path / "modelopt")
    ours, theirs = tensors(tmp_path / "ours"), tensors(tmp_path / "modelopt")
    v, o, gate = (f"model.layers.{i}.{m}." for i, m in ((0, "self_attn.v_proj"), (0, "self_attn.o_proj"),
                                                          (1, "mlp.gate_proj")))
    raw = [v + "v_scale", *([v + "weight_scale", v + "weight"] if fmt == "fp8" else [])]
    for name in raw:  # ModelOpt's: 0 (and NaN weights); the rule's: a scale of 1 (and zero weights)
        assert torch.all(theirs.pop(name).float().nan_to_num(0.0) == 0), name
        assert torch.all(ours.pop(name).float() == (0.0 if name.endswith("weight") else 1.0)), name
    assert_same_tensors(ours, theirs)
    if fmt in ("fp8", "int8_sq", "w4a8_awq"):  # the output projection reads the dead values: input amax 0
        assert ours[o + "input_scale"].item() == 1.0
    if fmt != "fp8":  # a dead output row: its per-channel / per-block scales
        assert torch.all(ours[gate + "weight_scale"][5] == 1.0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_unquantized_unified_export_loads_in_transformers_with_megapipe_logits(tiny_tokenizer_dir, tmp_path, arch):
    ckpt = make_checkpoint(tmp_path / "ckpt", arch, tiny_tokenizer_dir)
    export_trt(ckpt, tmp_path / "out", "unified", dtype="bf16")
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    model = load_model(ckpt, dtype=torch.bfloat16).model  # the weights the export holds ...
    model.float()  # ... computed in fp32 on both sides
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


def test_unified_streams_into_shards(quantized, tmp_path):
    ckpt = quantized("llama", "int4_awq", "fp8")
    one = export_trt(ckpt, tmp_path / "one", "unified")
    many = export_trt(ckpt, tmp_path / "many", "unified", max_shard_size=200_000)
    assert one["shards"] == 1 and many["shards"] > 2
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in (tmp_path / "many").glob("model-*.safetensors")}
    assert_same_tensors(tensors(tmp_path / "many"), tensors(tmp_path / "one"))


def test_unified_refusals(quantized, tiny_tokenizer_dir, pretrain_data, tmp_path):
    ckpt = quantized("llama", "fp8", None)

    def error(*args, **kw) -> str:
        with pytest.raises(MegapipeError) as e:
            export_trt(ckpt, *args, **kw)
        return str(e.value)

    assert "--format 'onnx' is not supported" in error(tmp_path / "a", "onnx")
    assert "--dtype 'fp32' is not supported" in error(tmp_path / "a", dtype="fp32")
    assert "apply to --format legacy" in error(tmp_path / "a", "unified", tp=2)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "already exists and is not empty" in error(tmp_path / "full")
    (tmp_path / "empty").mkdir()
    export_trt(ckpt, tmp_path / "empty")  # an empty directory is fine
    export_trt(ckpt, tmp_path / "full", overwrite=True)
    assert not (tmp_path / "full" / "x").exists()

    gpt2 = make_checkpoint(tmp_path / "gpt2", "gpt2", tiny_tokenizer_dir)
    quantize_checkpoint(gpt2, tmp_path / "gpt2-fp8", "fp8", pretrain_data[0], calib_samples=2, seq_length=32,
                        eval_iters=0)
    with pytest.raises(MegapipeError, match="use --format legacy"):
        export_trt(tmp_path / "gpt2-fp8", tmp_path / "b", "unified")
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


def test_int4_needs_whole_blocks(tiny_tokenizer_dir, pretrain_data, tmp_path):
    base = make_checkpoint(tmp_path / "base", "llama", tiny_tokenizer_dir, hidden_size=192, num_heads=3,
                           num_kv_heads=1)
    summary = quantize_checkpoint(base, tmp_path / "q", "int4_awq", pretrain_data[0], calib_samples=2,
                                  seq_length=32, eval_iters=1)  # fake quantization pads the last block ...
    restored = load_model(tmp_path / "q").model  # ... (its slices survive the JSON round trip) ...
    evals = windows_of(pretrain_data[0], 4, 32, first=2)  # 1 batch of the default 4 after the 2 calibration ones
    assert evaluate(restored, evals, 4)["perplexity"] == pytest.approx(summary["perplexity_after"], rel=1e-6)
    for fmt in ("unified", "legacy"):
        with pytest.raises(MegapipeError, match="hidden_size is 192"):  # ... the export cannot
            export_trt(tmp_path / "q", tmp_path / fmt, fmt)


def test_format_without_export_is_refused(quantized, tmp_path):
    """A checkpoint quantized on a GPU in a format megapipe does not export (nvfp4) is refused, for both formats."""
    import shutil

    from megapipe.checkpoint.manifest import MANIFEST_NAME

    ckpt = tmp_path / "nvfp4"
    shutil.copytree(quantized("llama", "fp8", None), ckpt)
    manifest = json.loads((ckpt / MANIFEST_NAME).read_text())
    manifest["quantization"]["format"] = "nvfp4"
    (ckpt / MANIFEST_NAME).write_text(json.dumps(manifest))
    for fmt in ("unified", "legacy"):
        with pytest.raises(MegapipeError, match="'nvfp4' has no .*TensorRT-LLM export in megapipe"):
            export_trt(ckpt, tmp_path / fmt, fmt)
