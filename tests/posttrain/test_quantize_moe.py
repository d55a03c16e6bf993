"""`posttrain quantize` on MoE models: Mixtral, Qwen2-MoE (a shared expert behind its gate, a dense layer) and
Qwen3-MoE (every other layer MoE), made at random by transformers and imported with `megapipe import hf`.

Oracle: NVIDIA ModelOpt's quantization of the Hugging Face model itself. transformers 5 holds each layer's experts
as fused 3-D weights, which ModelOpt's HF plugin quantizes per expert (one weight quantizer per expert and
projection, one input quantizer per projection shared by the experts) and leaves the routers unquantized; on the
same calibration windows, the quantized checkpoint's perplexity equals that of the HF model quantized by
``mtq.quantize``. Plus: the stored state restores the identical model, the routers and gates stay unquantized,
the engine generates from it, and int4_awq runs on a model whose widths are whole INT4 blocks.
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
sys.path.insert(0, str(Path(__file__).parent))

from megapipe.checkpoint.load import load_model  # noqa: E402
from megapipe.cli import main  # noqa: E402
from megapipe.errors import MegapipeError  # noqa: E402
from megapipe.posttrain.quantize import calibrate, evaluate, quantize_checkpoint, token_stream, windows  # noqa: E402
from tests.helpers.hf_tiny import make_hf_dir  # noqa: E402

SAMPLES, SEQ, BATCH, EVAL_ITERS = 8, 32, 4, 2
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
# every width (hidden, heads x head_dim, expert FFN) a whole 128-wide INT4 block
WHOLE_BLOCKS = dict(hidden_size=128, intermediate_size=128, head_dim=32)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run fastest on one thread (see tests/conftest.py)."""


def import_hf(root: Path, arch: str, **config) -> tuple[Path, Path]:
    """(the HF directory, its megapipe checkpoint made by `megapipe import hf`)."""
    hf_dir, _ = make_hf_dir(root / "hf", arch, **config)
    assert main(["import", "hf", str(hf_dir), str(root / "ckpt")]) == 0
    return hf_dir, root / "ckpt"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    made = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in made:
            made[arch] = import_hf(tmp_path_factory.mktemp(arch), arch)
        return made[arch]

    return get


def batches(ckpt: Path, data: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration windows [N, S], evaluation windows [M, S+1]) as quantize_checkpoint cuts them from ``data``."""
    tokenizer = load_model(ckpt).tokenizer
    stream = token_stream(data, tokenizer, (SAMPLES + EVAL_ITERS * BATCH) * SEQ + 1)
    return windows(stream, SAMPLES, SEQ)[:, :-1], windows(stream, EVAL_ITERS * BATCH, SEQ, first=SAMPLES)


def _quantize(ckpt: Path, out: Path, data: Path, fmt: str, kv=None) -> dict:
    return quantize_checkpoint(ckpt, out, fmt, data, kv_cache=kv, calib_samples=SAMPLES, seq_length=SEQ,
                               batch_size=BATCH, eval_iters=EVAL_ITERS)


def assert_equals_modelopt_on_hf(hf_dir: Path, ckpt: Path, quantized: Path, data: Path, fmt: str, summary: dict):
    calib, evals = batches(ckpt, data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference_before = evaluate(lambda t: hf(t).logits, evals, BATCH)
    calibrate(hf, fmt, None, calib, BATCH)  # ModelOpt's HF flow: mtq.quantize(hf_model, CFG, forward_loop)
    reference = evaluate(lambda t: hf(t).logits, evals, BATCH)
    mine = evaluate(load_model(quantized).model, evals, BATCH)  # what was stored, restored
    assert summary["perplexity_before"] == pytest.approx(reference_before["perplexity"], rel=1e-5)
    assert mine["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-4)
    assert mine["perplexity"] == pytest.approx(summary["perplexity_after"], rel=1e-6)
    assert summary["perplexity_after"] != summary["perplexity_before"]  # the fake quantization is really on


CASES = [(arch, fmt) for arch in ARCHS for fmt in ("fp8", "int8_sq")]


@pytest.mark.parametrize("arch,fmt", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_perplexity_equals_the_hf_model_quantized_by_modelopt(imported, shakespeare_excerpt, tmp_path, arch, fmt):
    hf_dir, ckpt = imported(arch)
    summary = _quantize(ckpt, tmp_path / "q", shakespeare_excerpt, fmt)
    assert_equals_modelopt_on_hf(hf_dir, ckpt, tmp_path / "q", shakespeare_excerpt, fmt, summary)

    manifest = json.loads((tmp_path / "q" / "megapipe.json").read_text())
    kinds, names = manifest["quantization"]["modelopt"]["kinds"], manifest["quantization"]["modelopt"]["modes"][-1][
        "quantizers"]
    first = load_model(ckpt).model.cfg.moe_layers[0]
    enabled = {n.replace("layers.*.", f"layers.{first}.") for n, k in names.items()
               if not kinds[k].get("_disabled", False)}  # ``layers.*.``: alike in every layer
    layer = f"layers.{first}.moe"
    assert {f"{layer}.experts.gate_up_proj_weight_quantizers.{e}" for e in range(4)} <= enabled
    assert {f"{layer}.experts.down_proj_input_quantizer", f"{layer}.experts.gate_up_proj_input_quantizer"} <= enabled
    assert not [n for n in enabled if ".moe.gate." in n or ".moe.shared_gate." in n]  # the routers and gates


def test_int4_awq_on_whole_int4_blocks(tmp_path, shakespeare_excerpt):
    hf_dir, ckpt = import_hf(tmp_path, "mixtral", **WHOLE_BLOCKS)
    summary = _quantize(ckpt, tmp_path / "q", shakespeare_excerpt, "int4_awq")
    assert_equals_modelopt_on_hf(hf_dir, ckpt, tmp_path / "q", shakespeare_excerpt, "int4_awq", summary)
    state = load_model(tmp_path / "q").model.state_dict()
    # one INT4 scale per 128-wide block of each expert's [gate; up] rows; AWQ smooths attention, not the experts
    assert state["layers.0.moe.experts.gate_up_proj_weight_quantizers.3._amax"].shape == (2 * 128, 1)
    assert "layers.0.attention.wq.input_quantizer._pre_quant_scale" in state
    assert not any("experts" in k and k.endswith("_pre_quant_scale") for k in state)


def test_stored_state_restores_the_identical_model(imported, shakespeare_excerpt, tmp_path):
    _, ckpt = imported("qwen2_moe")
    _quantize(ckpt, tmp_path / "q", shakespeare_excerpt, "int8_sq", kv="fp8")
    calib, evals = batches(ckpt, shakespeare_excerpt)
    live = load_model(ckpt).model
    calibrate(live, "int8_sq", "fp8", calib, BATCH)
    restored = load_model(tmp_path / "q").model
    with torch.no_grad():
        assert torch.equal(live(evals[:, :-1]), restored(evals[:, :-1]))
    live_state, restored_state = live.state_dict(), restored.state_dict()
    assert set(live_state) == set(restored_state)
    for key, value in live_state.items():
        assert torch.equal(value, restored_state[key]), key
    # unquantized tensors keep their names; the experts are stored as the fused weights ModelOpt quantized
    assert "layers.0.moe.gate.weight" in restored_state and "layers.0.moe.shared_gate.weight" in restored_state
    assert restored_state["layers.0.moe.experts.gate_up_proj"].shape == (4, 2 * 32, 64)


def test_cli_quantize_then_generate(imported, shakespeare_excerpt, tmp_path, capsys):
    """`megapipe generate` runs the quantized experts through the engine: greedy = the model's own full forward."""
    from megapipe.inference import LLMEngine, SamplingParams

    _, ckpt = imported("qwen3_moe")
    out = tmp_path / "q"
    assert main(["posttrain", "quantize", str(ckpt), "--quant", "fp8", "--calib-data", str(shakespeare_excerpt),
                 "--calib-samples", "4", "--calib-seq-len", "32", "--eval-iters", "1", "--output", str(out)]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "To be", "--max-new-tokens", "4", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out)[0]["completion"], str)

    model = load_model(out).model
    prompts = [[5, 17, 9, 33, 2, 71], [44, 3, 100, 101]]
    engine = LLMEngine.from_pretrained(out, device="cpu")
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                                                   ignore_eos=True))]
    for prompt, tokens in zip(prompts, got, strict=True):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert tokens == seq[len(prompt):]


def test_moe_formats_without_a_reference_are_refused(imported, shakespeare_excerpt, tmp_path):
    _, ckpt = imported("mixtral")
    with pytest.raises(MegapipeError) as e:
        _quantize(ckpt, tmp_path / "q", shakespeare_excerpt, "w4a8_awq")
    assert str(e.value) == (f"{ckpt}: quantize of Mixtral models does not support quant w4a8_awq "
                            "(supported: fp8, int8_sq, int4_awq)")
    assert not (tmp_path / "q").exists()
