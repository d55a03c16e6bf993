"""HF bridge for DeepseekV4ForCausalLM (sliding / CSA / HCA attention, hyper-connections, hash-routed and
sqrt-softplus MoE): a random transformers model -> import -> megapipe logits == transformers logits (fp32) -> export
-> the same tensors under the same names, and transformers reads the export back to the same logits.

Tolerance: the logits agree to 1e-5 of their largest magnitude (max |diff| 2.2e-5 on logits up to 9.5 here):
megapipe's attention runs through SDPA (sink_attention), transformers' V4 through an eager softmax; with an eager
softmax in its place the logits are bitwise equal, so what is left is the fused kernel's summation order."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from megapipe.checkpoint.hf.bridge import load_hf_model
from tests.helpers.hf_tiny import export_round_trip, make_hf_dir


def config_and_tokenizer(hf_dir, out):
    """A copy of ``hf_dir`` without its weights (a test writes its own)."""
    out.mkdir()
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert (ours - reference).abs().max() <= 1e-5 * reference.abs().max()


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("v4") / "hf", "deepseek_v4")


@pytest.mark.parametrize("length", [24, 23], ids=["whole-blocks", "a-partial-block"])
def test_import_logits_equal_transformers(hf_pair, length):
    hf_dir, hf_model = hf_pair
    tokens = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
    loaded = load_hf_model(hf_dir)
    assert loaded.cfg.attention_layer_types[1:3] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    assert loaded.cfg.moe_hash_layers == 1 and loaded.cfg.hc_mult == 3
    with torch.no_grad():
        close(loaded.model(tokens), hf_model(tokens).logits)


def test_export_writes_the_same_tensors_and_transformers_reads_them(hf_pair, tmp_path):
    import transformers

    hf_dir, hf_model = hf_pair
    out = export_round_trip(hf_dir, tmp_path)  # the same tensors under the same names
    tokens = torch.arange(20)[None] * 5 % 128
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, hf_model(tokens).logits, atol=0, rtol=0)


def test_hub_names(hf_pair, tmp_path):
    """The Hub's own spelling (no ``model.`` prefix, ``embed`` / ``hc_head_fn``) imports the same."""
    hf_dir, hf_model = hf_pair
    hub = config_and_tokenizer(hf_dir, tmp_path / "hub")
    renames = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
               "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
               "model.hc_head.hc_scale": "hc_head_scale"}
    tensors = {renames.get(k, k.removeprefix("model.")): v for k, v in load_file(hf_dir / "model.safetensors").items()}
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    loaded = load_hf_model(hub)
    assert not loaded.notes
    tokens = torch.arange(16)[None]
    with torch.no_grad():
        close(loaded.model(tokens), hf_model(tokens).logits)


def _fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale per block x block, what they dequantize to)."""
    scale = w.unflatten(0, (-1, block)).unflatten(2, (-1, block)).abs().amax(dim=(1, 3)) / 448.0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 bytes of two e2m1 values, the low nibble first; an e8m0 exponent per 32 values; the dequantized)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = w.unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1) / 6.0)).clamp(min=-127)
    scaled = groups / torch.exp2(exponent)[..., None]
    code = (scaled.abs()[..., None] - grid).abs().argmin(-1) + 8 * (scaled < 0)
    packed = (code[..., 0::2] | code[..., 1::2] << 4).to(torch.uint8).flatten(-2).view(torch.int8)
    values = grid[code % 8] * torch.where(code >= 8, -1.0, 1.0) * torch.exp2(exponent)[..., None]
    return packed, (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu), values.flatten(-2)


def test_fp8_and_fp4_published_weights_import_dequantized(hf_pair, tmp_path):
    """DeepSeek-V4's published layout: FP8 e4m3 linears with ``<module>.scale`` per 8 x 8 block here (128 x 128
    there), FP4 experts (int8 bytes, one e8m0 scale per 32 values)."""
    import json

    hf_dir, hf_model = hf_pair
    quant = config_and_tokenizer(hf_dir, tmp_path / "fp8")
    tensors, expected = load_file(hf_dir / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(".weight") and tensors[n].dim() == 2]:
        module = name[: -len(".weight")]
        if ".experts." in name:
            tensors[name], tensors[module + ".scale"], expected[name] = _fp4(tensors[name])
        elif any(p in name for p in (".attn.wq_", ".attn.wkv.", ".attn.wo_", "shared_experts")):
            tensors[name], tensors[module + ".scale"], expected[name] = _fp8(tensors[name], 8)
    save_file(tensors, quant / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [8, 8], "scale_fmt": "ue8m0"}
    (quant / "config.json").write_text(json.dumps(config))

    loaded = load_hf_model(quant)
    notes = " ".join(loaded.notes)
    assert "FP8" in notes and "FP4" in notes
    state, experts = loaded.model.state_dict(), [f"model.layers.2.ffn.experts.{e}.w2.weight" for e in range(4)]
    pairs = {"layers.1.attention.wq_a.weight": expected["model.layers.1.attn.wq_a.weight"],
             "layers.2.moe.experts.w2": torch.stack([expected[name] for name in experts])}
    assert all(torch.equal(state[name], want) for name, want in pairs.items())
    tokens = torch.arange(20)[None]
    with torch.no_grad():  # FP4 keeps ~1 significant digit: the logits stay close to the unquantized model's
        cos = torch.nn.functional.cosine_similarity(loaded.model(tokens).flatten(), hf_model(tokens).logits.flatten(),
                                                    dim=0)
    assert cos > 0.95
