"""`posttrain quantize --quant fp8` and `export trt --format unified` of DeepSeek-V3 (multi-latent attention + MoE),
against NVIDIA ModelOpt's own ``export_hf_checkpoint`` of the transformers twin holding the same quantizers: the same
tensors bit for bit (every MLA projection in FP8 with its scales, the experts under the Hub's per-expert names), the
same hf_quant_config.json. What TensorRT-LLM cannot take from an MLA model (other formats, a quantized KV cache, the
legacy format) is refused in one sentence."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("modelopt")
sys.path.insert(0, str(Path(__file__).parents[1] / "posttrain"))
sys.path.insert(0, str(Path(__file__).parent))

from quant_twins import quantized_twin  # noqa: E402
from test_trt_unified import assert_same_tensors, tensors  # noqa: E402

from megapipe.checkpoint.hf import import_hf  # noqa: E402
from megapipe.checkpoint.quant_state import quiet  # noqa: E402
from megapipe.checkpoint.trt import export_trt  # noqa: E402
from megapipe.errors import MegapipeError  # noqa: E402
from megapipe.posttrain.quantize import quantize_checkpoint  # noqa: E402
from tests.helpers.hf_tiny import make_hf_dir  # noqa: E402

EXCERPT = Path(__file__).parents[1] / "fixtures" / "shakespeare_excerpt.jsonl"
MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run fastest on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def mla_ckpt(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("mla")
    hf_dir, _ = make_hf_dir(work / "hf", "deepseek_v3")
    import_hf(hf_dir, work / "ckpt")
    return work / "ckpt"


def test_fp8_unified_export_equals_modelopt_export_hf_checkpoint(mla_ckpt, tmp_path):
    from modelopt.torch.export import export_hf_checkpoint

    quantize_checkpoint(mla_ckpt, tmp_path / "fp8", "fp8", EXCERPT, calib_samples=4, seq_length=32, batch_size=2,
                        eval_iters=0)
    export_trt(tmp_path / "fp8", tmp_path / "ours", "unified", dtype="bf16")
    twin = quantized_twin(tmp_path / "fp8", tmp_path, torch.bfloat16)
    with quiet():
        export_hf_checkpoint(twin, dtype=torch.bfloat16, export_dir=tmp_path / "modelopt")
    ours, theirs = tensors(tmp_path / "ours"), tensors(tmp_path / "modelopt")
    for proj in MLA_LINEARS:
        assert ours[f"model.layers.0.self_attn.{proj}.weight"].dtype == torch.float8_e4m3fn, proj
        assert ours[f"model.layers.0.self_attn.{proj}.input_scale"].shape == ()
    assert ours["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert_same_tensors(ours, theirs)
    quant = json.loads((tmp_path / "ours" / "hf_quant_config.json").read_text())
    assert quant == json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())


@pytest.mark.parametrize("case", ["int8_sq", "kv_fp8", "legacy"])
def test_what_tensorrt_llm_cannot_take_from_mla_is_refused(mla_ckpt, tmp_path, case):
    if case == "legacy":
        with pytest.raises(MegapipeError, match="export trt of DeepSeek-V3 .* does not support trt legacy"):
            export_trt(mla_ckpt, tmp_path / "out", "legacy")
        return
    fmt, kv = ("int8_sq", None) if case == "int8_sq" else ("fp8", "fp8")
    with pytest.raises(MegapipeError, match=r"DeepSeek-V3 .*" + ("does not support quant int8_sq" if kv is None else
                                                              "multi-latent attention.s compressed latent")):
        quantize_checkpoint(mla_ckpt, tmp_path / "q", fmt, EXCERPT, kv_cache=kv, calib_samples=2, seq_length=32)
    assert not (tmp_path / "q").exists()
