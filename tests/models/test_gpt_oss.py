"""GPT-OSS: attention sinks against the softmax with the sink column written out (windows, packed documents, GQA,
gradients); logits equal transformers' GptOssForCausalLM (fp32, eager, 1e-5) over more tokens than the window, packed
documents too; export gives the same tensors back; MXFP4 expert weights decode as the spec says and import
dequantized, encode back byte for byte (and trained weights within the rounding's bound), export as the published
layout that transformers loads; the presets count what transformers counts; a training step; what is refused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from megapipe.checkpoint.hf.bridge import load_hf_model
from megapipe.checkpoint.hf.mxfp4 import QUANTIZATION_CONFIG, decode_mxfp4, encode_mxfp4
from megapipe.config import ModelConfig, from_dict
from megapipe.errors import ConfigError, MegapipeError
from megapipe.models import build_model
from megapipe.models.attention import CausalSDPA, DocumentMask
from megapipe.models.capabilities import describe, require
from megapipe.parallel.plan import param_counts
from tests.helpers.hf_tiny import export_round_trip, make_hf_dir

TOKENS = torch.tensor([[5, 17, 9, 33, 2, 71, 8, 19, 44, 3, 120, 7, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])


def written_out(q, k, v, sinks, keep):
    """softmax([q.k * scale, sink_h]) without the sink column, times v (GQA keys repeated per query head)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~keep, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
def test_sink_attention_equals_the_softmax_with_a_sink_column(window, packed):
    torch.manual_seed(0)
    b, h, kv, s, d = 2, 4, 2, 10, 16
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = torch.randn(b, kv, s, d, requires_grad=True), torch.randn(b, kv, s, d, requires_grad=True)
    sinks = torch.randn(h, requires_grad=True)
    docs = torch.tensor([[0] * 4 + [1] * 6, [0] * 10]) if packed else torch.zeros(b, s, dtype=torch.long)
    pos = torch.arange(s).expand(b, s)  # within each document: the window counts positions, not offsets in the row
    pos = torch.where(docs == 1, pos - 4, pos)
    keep = (docs[:, :, None] == docs[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    if window is not None:
        keep &= (pos[:, :, None] - pos[:, None, :]) < window
    keep = keep[:, None]  # [B, 1, S, S]
    mask = DocumentMask(docs) if packed else None
    ours = CausalSDPA(window)(q, k, v, mask=mask, sinks=sinks)
    ref = written_out(q, k, v, sinks, keep)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad((ours * ref.detach()).sum(), (q, k, v, sinks))
    expected = torch.autograd.grad((ref * ref.detach()).sum(), (q, k, v, sinks))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert grads[3].abs().min() > 0  # every sink learns


def test_logits_match_transformers_beyond_the_window_and_on_packed_documents(tmp_path, capsys):
    hf_dir, hf_model = make_hf_dir(tmp_path / "hf", "gpt_oss")
    loaded = load_hf_model(hf_dir)
    cfg = loaded.cfg
    assert (cfg.sliding_window, cfg.windowed_layers, cfg.yarn_truncate) == (4, [0], False)
    assert TOKENS.shape[1] > 3 * cfg.sliding_window
    with torch.no_grad():
        ours, ref = loaded.model(TOKENS), hf_model(TOKENS).logits
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        # two documents packed in one row: each as transformers computes it alone
        docs = torch.tensor([[0] * 5 + [1] * 8])
        packed = loaded.model(TOKENS[:1], document_ids=docs)
        alone = torch.cat([hf_model(TOKENS[:1, :5]).logits, hf_model(TOKENS[:1, 5:]).logits], dim=1)
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_export_gives_the_same_tensors_and_config(tmp_path, capsys):
    hf_dir, hf_model = make_hf_dir(tmp_path / "hf", "gpt_oss")
    out = export_round_trip(hf_dir, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["rope_parameters"]["truncate"] is False and config["swiglu_limit"] == 1.5
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(TOKENS).logits, hf_model(TOKENS).logits, atol=1e-5, rtol=1e-5)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


def test_mxfp4_decode_follows_the_spec():
    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), dtype=torch.uint8)  # 2 experts, 3 rows, 2 groups of 32
    scales = torch.randint(120, 135, (2, 3, 2), dtype=torch.uint8)
    expected = torch.empty(2, 3, 64)
    for e in range(2):
        for r in range(3):
            for g in range(2):
                for j in range(16):
                    byte, scale = int(blocks[e, r, g, j]), 2.0 ** (int(scales[e, r, g]) - 127)
                    expected[e, r, g * 32 + 2 * j] = _e2m1(byte & 0x0F) * scale
                    expected[e, r, g * 32 + 2 * j + 1] = _e2m1(byte >> 4) * scale
    assert torch.equal(decode_mxfp4(blocks, scales), expected)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # the layout transformers loads

    reference = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(decode_mxfp4(blocks, scales).transpose(1, 2), reference)


def _published_blocks(*shape) -> torch.Tensor:
    """Random MXFP4 bytes [..., G, 16] as an encoder that uses each group's range writes them: a magnitude code 6 or
    7 (4 or 6 times the scale) in every group."""
    blocks = torch.randint(0, 256, shape, dtype=torch.uint8)
    blocks[..., 0] |= 0x06
    return blocks


def test_mxfp4_encode_inverts_decode():
    torch.manual_seed(0)
    blocks = _published_blocks(4, 90, 3, 16)  # gpt-oss's [experts, out, in / 32, 16], smaller
    scales = torch.randint(100, 135, (4, 90, 3), dtype=torch.uint8)
    again = encode_mxfp4(decode_mxfp4(blocks, scales))
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)


def test_mxfp4_encodes_trained_weights_with_the_documented_rounding():
    # one group by hand (scale 2^0: max 6): the midpoints between e2m1 values round to the even code, -0 keeps its sign
    group = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, -5.5, 0.6] + [0.0] * 21)
    blocks, scales = encode_mxfp4(group)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten()[:11].tolist()
    assert scales.tolist() == [127] and codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 15, 1]
    assert encode_mxfp4(torch.full((32,), 7.0))[1].tolist() == [128]  # 7 > 6 * 2^0: the scale doubles, no clipping
    torch.manual_seed(0)
    weights = torch.randn(64, 8, 32) * torch.logspace(-6, 2, 64)[:, None, None]  # trained-looking, not MXFP4
    blocks, scales = encode_mxfp4(weights.flatten(1))
    error = (decode_mxfp4(blocks, scales).unflatten(-1, (8, 32)) - weights).abs()
    scale = torch.exp2(scales.float() - 127)[..., None]  # [64, 8, 1]
    assert (weights.abs().amax(-1, keepdim=True) <= 6 * scale).all() and (weights.abs().amax(-1) > 3 * scale[..., 0]).all()
    bound = torch.where(weights.abs() <= 2 * scale, scale / 4, torch.where(weights.abs() <= 4 * scale, scale / 2, scale))
    assert (error <= bound).all()
    assert (error <= weights.abs().amax(-1, keepdim=True) / 3).all()
    with pytest.raises(MegapipeError, match="MXFP4 cannot encode a non-finite weight"):
        encode_mxfp4(torch.full((32,), float("nan")))


def test_export_trt_refuses_what_tensorrt_llms_gpt_oss_runs_differently():
    from types import SimpleNamespace

    from megapipe.checkpoint.trt import check_gpt_oss

    def src(**model):
        return SimpleNamespace(cfg=from_dict(ModelConfig, {"preset": "gpt-oss-tiny", "vocab_size": 128, **model}),
                               where="ckpt")

    check_gpt_oss(src())
    with pytest.raises(MegapipeError, match=r"ckpt: model.moe_swiglu_limit = 1.5, but TensorRT-LLM's GPT-OSS model "
                                            r"fixes it at 7.0"):
        check_gpt_oss(src(moe_swiglu_limit=1.5))
    with pytest.raises(MegapipeError, match=r"windows layers \[0, 2\] \(the even ones\), but this model windows "
                                            r"layers \[0, 1, 2, 3\]"):
        check_gpt_oss(src(window_attn_skip_freq=None))


def _quantize_experts(state: dict, hf_model) -> dict:
    """Replace each expert projection by random MXFP4 blocks / scales; the HF model gets the decoded values."""
    out = {}
    for name, tensor in state.items():
        if not name.endswith(("gate_up_proj", "down_proj")):
            out[name] = tensor
            continue
        e, n_in, n_out = tensor.shape
        blocks = _published_blocks(e, n_out, n_in // 32, 16)
        scales = torch.randint(122, 126, (e, n_out, n_in // 32), dtype=torch.uint8)
        out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        with torch.no_grad():
            hf_model.get_parameter(name).copy_(decode_mxfp4(blocks, scales).transpose(1, 2))
    return out


def test_mxfp4_experts_import_dequantized(tmp_path, capsys):
    hf_dir, hf_model = make_hf_dir(tmp_path / "hf", "gpt_oss", hidden_size=64, intermediate_size=64)
    torch.manual_seed(1)
    state = _quantize_experts(load_file(hf_dir / "model.safetensors"), hf_model)
    save_file(state, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (hf_dir / "config.json").write_text(json.dumps(config))
    loaded = load_hf_model(hf_dir)
    assert any("MXFP4" in note and "dequantized" in note for note in loaded.notes)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(TOKENS), hf_model(TOKENS).logits, atol=1e-5, rtol=1e-5)


def test_mxfp4_export_writes_the_published_bytes_that_transformers_loads(tmp_path, capsys):
    from megapipe.cli import main

    hf_dir, hf_model = make_hf_dir(tmp_path / "hf", "gpt_oss", hidden_size=64, intermediate_size=64,
                                   swiglu_limit=7.0)  # the limit TensorRT-LLM's GPT-OSS model fixes (export trt)
    torch.manual_seed(1)
    state = _quantize_experts(load_file(hf_dir / "model.safetensors"), hf_model)
    save_file(state, hf_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}))
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["import", "hf", str(hf_dir), str(ckpt), "--quiet"]) == 0
    assert main(["export", "hf", str(ckpt), str(out), "--mxfp4", "--dtype", "fp32", "--quiet"]) == 0
    again = load_file(out / "model.safetensors")
    assert state.keys() == again.keys() and any(name.endswith("_blocks") for name in again)
    assert all(torch.equal(t, again[name]) for name, t in state.items())  # uint8 blocks / scales and fp32 alike
    assert json.loads((out / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG
    # transformers dequantizes the published blocks into the dtype asked for (its MXFP4 kernels are Triton ones that
    # come from the Hub)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    assert theirs.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(theirs(TOKENS).logits, hf_model(TOKENS).logits, atol=1e-5, rtol=1e-5)
    # export trt writes the same layout (the rest in bf16) for TensorRT-LLM's PyTorch backend
    assert main(["export", "trt", str(ckpt), str(tmp_path / "trt"), "--quiet"]) == 0
    trt = load_file(tmp_path / "trt" / "model.safetensors")
    assert trt.keys() == state.keys()
    assert all(torch.equal(t if t.dtype == torch.uint8 else t.bfloat16(), trt[name]) for name, t in state.items())
    assert json.loads((tmp_path / "trt" / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG
    llama_dir, _ = make_hf_dir(tmp_path / "llama", "llama")
    assert main(["import", "hf", str(llama_dir), str(tmp_path / "llama_ckpt"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["export", "hf", str(tmp_path / "llama_ckpt"), str(tmp_path / "llama_out"), "--mxfp4"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "--mxfp4 writes the experts as the published GPT-OSS checkpoints pack them, and this is a Llama" in err
    assert not (tmp_path / "llama_out").exists()


@pytest.mark.parametrize("preset,layers,experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_presets_count_what_transformers_counts(preset, layers, experts):
    """GptOssConfig's defaults are gpt-oss-120b's published config; the 20b differs in layers and experts."""
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts))
    theirs = sum(p.numel() for p in hf.parameters())
    ours = param_counts(from_dict(ModelConfig, {"preset": preset})).total
    assert abs(ours / theirs - 1) < 0.01
    assert ours == theirs  # in fact exactly


def test_the_published_config_reads_as_the_preset():
    from megapipe.checkpoint.hf import adapter_for_arch
    from megapipe.checkpoint.hf.bridge import normalise_hf_config

    adapter = adapter_for_arch("gpt_oss")
    hf = normalise_hf_config({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                              "num_hidden_layers": 24, "num_local_experts": 32}, adapter, "published")
    back = ModelConfig(**adapter.config_from_hf(hf, "published"))
    preset = from_dict(ModelConfig, {"preset": "gpt-oss-20b"})
    assert adapter.hf_config(preset)["layer_types"] == hf["layer_types"]
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "sliding_window",
                  "windowed_layers", "rope_theta", "rotary_scaling_factor", "original_max_position_embeddings",
                  "yarn_truncate", "num_experts", "moe_router_topk", "expert_ffn", "moe_swiglu_alpha",
                  "moe_swiglu_limit", "vocab_size", "max_position_embeddings", "moe_aux_loss_coeff"):
        assert getattr(back, field) == getattr(preset, field), field


@pytest.mark.parametrize("grouped_gemm", [True, False], ids=["grouped_mm", "expert_loop"])
def test_a_training_step_reaches_every_parameter(grouped_gemm):
    cfg = from_dict(ModelConfig, {"preset": "gpt-oss-tiny", "vocab_size": 128, "hidden_size": 64,
                                  "moe_ffn_hidden_size": 64, "intermediate_size": 64, "num_heads": 4,
                                  "num_kv_heads": 2, "head_dim": 16, "moe_grouped_gemm": grouped_gemm})
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # trained-looking biases and sinks, so their paths carry gradients
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (2, 40))  # longer than the 16-token window
    docs = torch.tensor([[0] * 25 + [1] * 15, [0] * 40])
    loss = F.cross_entropy(model(tokens, document_ids=docs)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_expert_paths_agree():
    cfg = from_dict(ModelConfig, {"preset": "gpt-oss-tiny", "vocab_size": 128, "hidden_size": 64,
                                  "moe_ffn_hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16})
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
        tokens = torch.randint(0, 128, (2, 20))
        grouped = model(tokens)
        for layer in model.layers.values():
            layer.moe.experts.grouped_gemm = False
        torch.testing.assert_close(model(tokens), grouped, atol=1e-5, rtol=1e-5)


def test_bad_configs_and_undeclared_stages_are_refused():
    with pytest.raises(ConfigError, match="model.window_attn_skip_freq = 2 picks the sliding-window layers"):
        _validated(window_attn_skip_freq=2)
    with pytest.raises(ConfigError, match=r"model.window_attn_skip_freq = \[1, 0\] must hold one 0 or 1 per layer"):
        _validated(sliding_window=8, window_attn_skip_freq=[1, 0])
    with pytest.raises(ConfigError, match="model.attention_sinks = true does not go with"):
        _validated(attention_sinks=True, multi_latent_attention=True)
    with pytest.raises(ConfigError, match="model.sliding_window = 0 must be > 0"):
        _validated(sliding_window=0)
    cfg = from_dict(ModelConfig, {"preset": "gpt-oss-tiny", "vocab_size": 128})
    assert describe(cfg) == "GPT-OSS"
    require(cfg, "pretrain", layouts=["tp", "sp", "pp", "cp", "ep"])  # every layout (test_dist_layouts.py)
    with pytest.raises(MegapipeError, match="quantize does not support GPT-OSS models"):
        require(cfg, "quantize")
    require(cfg, "export_trt", trt="unified")  # its windows alternate: the published layout carries them
    for stage in ("generate", "serve", "eval", "rl"):  # on the engine (tests/inference/test_gpt_oss_engine.py)
        require(cfg, stage)
    # a Llama with windowed and full layers: the engine and the ring attention of cp take each layer's window
    mixed = ModelConfig(sliding_window=8, window_attn_skip_freq=2)
    require(mixed, "generate")
    with pytest.raises(MegapipeError, match="quantize does not support Llama models"):
        require(mixed, "quantize")

def _validated(**model):
    from megapipe.config import Config, validate

    cfg = Config(model=ModelConfig(**model))
    validate(cfg)
    return cfg
