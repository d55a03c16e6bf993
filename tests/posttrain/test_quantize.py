"""`posttrain quantize`: ModelOpt PTQ on megapipe checkpoints.

Oracle: on the same weights and calibration batches, the quantized megapipe model's perplexity equals that of
the Hugging Face twin quantized with ModelOpt's usual HF flow (``mtq.quantize(hf_model, CFG, forward_loop)``),
for every format that runs on CPU. Plus: the stored state restores to the identical model, no pickle anywhere,
and every bad input is one clear error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("modelopt")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))

from quant_twins import hf_twin, make_checkpoint, windows_of  # noqa: E402

from megapipe.checkpoint import quant_state, read_manifest  # noqa: E402
from megapipe.checkpoint.load import load_model  # noqa: E402
from megapipe.cli import main  # noqa: E402
from megapipe.errors import MegapipeError  # noqa: E402
from megapipe.posttrain.quantize import calibrate, evaluate, quantize_checkpoint  # noqa: E402

SAMPLES, SEQ, BATCH, EVAL_ITERS = 8, 64, 4, 2
CASES = [  # every CPU format on Llama, and each other Llama-shaped architecture with one of them
    ("llama", "fp8", "fp8"), ("llama", "int8_sq", None), ("llama", "int4_awq", "fp8"), ("llama", "w4a8_awq", None),
    ("qwen2", "int8_sq", "fp8"), ("qwen3", "int4_awq", None), ("mistral", "w4a8_awq", "fp8"), ("mistral", "fp8", None),
]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run fastest on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("quant")
    return {arch: make_checkpoint(root / arch, arch, tiny_tokenizer_dir) for arch in ("llama", "qwen2", "qwen3",
                                                                                    "mistral")}


def _quantize(base_ckpt, out, data, fmt, kv, **kw):
    return quantize_checkpoint(base_ckpt, out, fmt, data, kv_cache=kv, calib_samples=SAMPLES, seq_length=SEQ,
                               batch_size=BATCH, eval_iters=EVAL_ITERS, **kw)


@pytest.mark.parametrize("arch,fmt,kv", CASES, ids=[f"{a}-{f}{'-kv' if k else ''}" for a, f, k in CASES])
def test_perplexity_equals_hf_twin_quantized_by_modelopt(base, pretrain_data, tmp_path, arch, fmt, kv):
    prefix, _ = pretrain_data
    summary = _quantize(base[arch], tmp_path / "q", prefix, fmt, kv)
    calib = windows_of(prefix, SAMPLES, SEQ)[:, :-1]
    evals = windows_of(prefix, EVAL_ITERS * BATCH, SEQ, first=SAMPLES)

    twin = hf_twin(base[arch], tmp_path)
    reference_before = evaluate(lambda t: twin(t).logits, evals, BATCH)
    calibrate(twin, fmt, kv, calib, BATCH)  # ModelOpt's HF flow: mtq.quantize(hf_model, CFG, forward_loop)
    reference = evaluate(lambda t: twin(t).logits, evals, BATCH)

    ours = load_model(tmp_path / "q").model  # what was stored, restored
    mine = evaluate(ours, evals, BATCH)
    assert summary["perplexity_before"] == pytest.approx(reference_before["perplexity"], rel=1e-5)
    assert mine["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-3)
    assert mine["perplexity"] == pytest.approx(summary["perplexity_after"], rel=1e-6)
    assert summary["perplexity_after"] != summary["perplexity_before"]  # the fake quantization is really on
    if kv:
        attn = ours.layers["0"].attention
        assert attn.k_bmm_quantizer.is_enabled and attn.k_bmm_quantizer.amax is not None


@pytest.mark.parametrize("fmt", ["int4_awq", "w4a8_awq", "int8_sq"])
def test_stored_state_restores_the_identical_model(base, pretrain_data, tmp_path, fmt):
    prefix, _ = pretrain_data
    _quantize(base["llama"], tmp_path / "q", prefix, fmt, "fp8")
    live = load_model(base["llama"]).model
    calibrate(live, fmt, "fp8", windows_of(prefix, SAMPLES, SEQ)[:, :-1], BATCH)
    restored = load_model(tmp_path / "q").model
    tokens = windows_of(prefix, 2, SEQ, first=20)[:, :-1]
    with torch.no_grad():
        assert torch.equal(live(tokens), restored(tokens))
    assert set(live.state_dict()) == set(restored.state_dict())
    for key, value in live.state_dict().items():
        assert torch.equal(value, restored.state_dict()[key]), key
    # SmoothQuant / AWQ fold their scales into the stored weights; the quantizer tensors sit next to them
    assert any(k.endswith("input_quantizer._pre_quant_scale") for k in restored.state_dict())


def test_checkpoint_holds_json_and_tensors_only(base, pretrain_data, tmp_path):
    prefix, _ = pretrain_data
    _quantize(base["llama"], tmp_path / "q", prefix, "w4a8_awq", "fp8")
    manifest = read_manifest(tmp_path / "q")
    q = manifest["quantization"]
    assert (q["format"], q["kv_cache"], manifest["stage"]) == ("w4a8_awq", "fp8", "quantize")
    assert manifest["parent"] == str(base["llama"].absolute())
    assert [m["mode"] for m in q["modelopt"]["modes"]] == ["quantize", "awq_lite_calibrate"]
    json.dumps(q, allow_nan=False)
    files = sorted(manifest["files"])
    assert all(f.startswith(("model/", "extra/", "tokenizer/")) for f in files), files
    assert not any(f.endswith((".pt", ".pth", ".pkl", ".bin")) for f in files), files
    assert (tmp_path / "q" / "tokenizer" / "tokenizer.json").is_file()
    q_modes = q["modelopt"]["modes"][-1]["quantizers"]
    assert "layers.*.attention.wq.weight_quantizer.0" in q_modes  # layer-wise alike entries are folded


def test_cli_quantize_then_generate(base, pretrain_data, tmp_path, capsys):
    prefix, _ = pretrain_data
    out = tmp_path / "q"
    code = main(["posttrain", "quantize", str(base["llama"]), "--quant", "fp8", "--kv-cache-quant", "fp8",
                 "--calib-data", str(prefix), "--calib-samples", "4", "--calib-seq-len", "32", "--eval-iters", "1",
                 "--output", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "perplexity" in text and "fp8" in text
    assert main(["generate", str(out), "--prompt", "To be", "--max-new-tokens", "4", "--json"]) == 0
    completions = json.loads(capsys.readouterr().out)
    assert len(completions) == 1 and isinstance(completions[0]["completion"], str)
    assert main(["checkpoint", "inspect", str(out)]) == 0
    assert "fp8 + kv fp8 (nvidia-modelopt" in capsys.readouterr().out


def test_calibration_from_jsonl(base, shakespeare_excerpt, tmp_path):
    summary = quantize_checkpoint(base["llama"], tmp_path / "q", "int8_sq", shakespeare_excerpt, calib_samples=4,
                                  seq_length=32, batch_size=2, eval_iters=1)
    assert summary["eval_tokens"] == 2 * 32


# --------------------------------------------------------------------------------------------------- errors


def _error(fn) -> str:
    with pytest.raises(MegapipeError) as e:
        fn()
    return str(e.value)


def test_bad_inputs_are_clear_errors(base, pretrain_data, chat_tokenizer, shakespeare_excerpt, tmp_path,
                                     monkeypatch):
    prefix, _ = pretrain_data
    ckpt = base["llama"]
    out = tmp_path / "q"

    def run(target=out, **kw):
        args = dict(fmt="fp8", calib_data=prefix, calib_samples=4, seq_length=32, batch_size=2, eval_iters=1)
        args.update(kw)
        return lambda: quantize_checkpoint(ckpt, target, **args)

    assert "needs a CUDA GPU" in _error(run(fmt="nvfp4"))
    assert "'int3' is not a supported format" in _error(run(fmt="int3"))
    assert "--kv-cache-quant 'int8' is not supported" in _error(run(kv_cache="int8"))
    assert "neither" in _error(run(calib_data=tmp_path / "nothing"))
    assert "fewer than the" in _error(run(calib_samples=100000))
    assert "--calib-seq-len 4096 exceeds" in _error(run(seq_length=4096))
    assert "--calib-samples 0 is too small" in _error(run(calib_samples=0))
    assert "is the input" in _error(lambda: quantize_checkpoint(ckpt, ckpt, "fp8", prefix,
                                                                           overwrite=True))
    out.mkdir()
    assert "already exists" in _error(run())
    assert not any(p.name.startswith("q.tmp-") for p in tmp_path.iterdir())

    other = make_checkpoint(tmp_path / "other-tokenizer", "llama", chat_tokenizer)  # same vocabulary size
    for option in ("calib_data", "eval_data"):
        data = {"calib_data": shakespeare_excerpt, "eval_data": None, option: prefix}
        assert f"data {prefix} was tokenized with tokenizer" in _error(lambda data=data: quantize_checkpoint(
            other, tmp_path / "q6", "fp8", calib_samples=4, seq_length=32, eval_iters=1, **data))
    small = make_checkpoint(tmp_path / "small-vocab", "llama", None, vocab_size=256)
    assert "holds token id" in _error(lambda: quantize_checkpoint(small, tmp_path / "q2", "fp8", prefix,
                                                                  calib_samples=4, seq_length=32, eval_iters=1))
    _quantize(ckpt, tmp_path / "q3", prefix, "fp8", None)
    assert "already quantized (fp8)" in _error(lambda: quantize_checkpoint(tmp_path / "q3", tmp_path / "q4", "fp8",
                                                                           prefix))

    import importlib.metadata

    real = importlib.metadata.version

    def missing(name):
        if name == "nvidia-modelopt":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert "pip install 'megapipe[quant]'" in _error(run(tmp_path / "q5"))


def test_quantizer_state_json_codec_round_trips():
    value = {"_num_bits": (4, 3), "_block_sizes": {-1: 128, "type": "static"}, "_input_dtype": torch.bfloat16,
             "shape": torch.Size([3, 1]), "plain": [1, 2.5, None, "x"], "_slices": (slice(None), slice(0, 4, None))}
    back = quant_state.decode(json.loads(json.dumps(quant_state.encode(value))))
    assert back == {**value, "shape": (3, 1)}
    assert isinstance(back["_num_bits"], tuple) and -1 in back["_block_sizes"]


def test_quantized_checkpoint_runs_in_bf16(base, pretrain_data, tmp_path, capsys):
    prefix, _ = pretrain_data
    _quantize(base["llama"], tmp_path / "q", prefix, "int8_sq", "fp8")  # a pre_quant_scale multiplies activations
    fp32 = load_model(tmp_path / "q").model
    bf16 = load_model(tmp_path / "q", dtype=torch.bfloat16).model
    tokens = windows_of(prefix, 1, SEQ, first=30)[:, :-1]
    with torch.no_grad():
        a, b = fp32(tokens), bf16(tokens)
    assert torch.isfinite(b).all() and (a - b).abs().max() < 0.1 * a.abs().max()
    assert main(["generate", str(tmp_path / "q"), "--prompt", "To be", "--max-new-tokens", "3", "--bf16"]) == 0


def test_first_modelopt_import_says_so_on_stderr(capsys, monkeypatch):
    """ModelOpt's first import is the silent minute of a quantized model's load (the demo's fp8 sample): one stderr
    line before it, none once it is loaded."""
    quant_state.mtq()
    capsys.readouterr()
    quant_state.announce_modelopt_import()
    assert capsys.readouterr() == ("", "")
    monkeypatch.delitem(sys.modules, "modelopt.torch.quantization")  # as in a fresh process (restored afterwards)
    quant_state.announce_modelopt_import()
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "loading NVIDIA ModelOpt" in err
