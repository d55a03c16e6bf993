"""DeepSeek-V3's multi-token-prediction layer in the HF bridge: a checkpoint with ``num_nextn_predict_layers`` = 1 and
its ``model.layers.{num_hidden_layers}.*`` tensors imports into megapipe's MTP module, whose logits equal the MTP
logits computed here from the raw tensors (enorm / hnorm / eh_proj / transformers' decoder layer / shared_head, as
vLLM applies DeepSeek's MTP weights: depth 1 takes the main model's final-normed hidden state), and exports back to
the same tensors, DeepSeek's copies of the embedding table and output head included; the main logits stay
transformers' (it leaves the MTP tensors out). Copies that differ, and asking for more MTP layers than there are, are
refused; ``--mtp-num-layers 0`` leaves them out with a note."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megapipe.checkpoint.hf.bridge import load_hf_model
from megapipe.cli import main
from megapipe.models.mtp import shift_left
from tests.helpers.hf_mtp import MTP, make_mtp_dir

TOKENS = torch.tensor([[5, 17, 9, 33, 2, 71, 8, 19, 44, 3, 120, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def cli(*args) -> int:
    return main([str(a) for a in args])


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def reference_mtp_logits(full, own: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Depth 1 at index t (predicting token t + 2): the main model's final-normed hidden state at t and the
    embedding of token t + 1, each RMS-normed, concatenated [embedding; hidden], projected, the decoder layer, the
    shared head's norm, the output head. The main model is the first two layers of ``full``."""
    eps, model = full.config.rms_norm_eps, full.model
    x = model.embed_tokens(tokens)
    positions = torch.arange(tokens.shape[1])[None]
    rope = model.rotary_emb(x, positions)
    causal = torch.full((tokens.shape[1],) * 2, float("-inf")).triu(1)[None, None]
    for layer in model.layers[:2]:
        x = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
    hidden = model.norm(x)
    nxt = model.embed_tokens(shift_left(tokens, 1, 0))
    x = torch.cat([rms(nxt, own["enorm.weight"], eps), rms(hidden, own["hnorm.weight"], eps)], -1) @ own[
        "eh_proj.weight"].T
    x = model.layers[2](x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
    return full.lm_head(rms(x, own["shared_head.norm.weight"], eps))


def test_mtp_layer_imports_into_the_mtp_module_and_exports_back(tmp_path):
    import transformers

    hf_dir, full, own = make_mtp_dir(tmp_path / "hf")
    loaded = load_hf_model(hf_dir)
    assert loaded.cfg.mtp_num_layers == 1 and loaded.cfg.num_layers == 2 and not loaded.notes
    main_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()  # leaves layer 2 out
    with torch.no_grad():
        logits, [mtp_logits] = loaded.model(TOKENS, mtp=True)
        torch.testing.assert_close(logits, main_hf(TOKENS).logits, atol=1e-5, rtol=1e-5)
    want = reference_mtp_logits(full, own, TOKENS)
    # one layer more than the main logits pass through: fp32 rounding (of the rope tables first) grows to ~2e-5 at
    # logits of ~10, so the bound is 1e-5 of the logits' range
    torch.testing.assert_close(mtp_logits, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)

    ckpt, out = tmp_path / "ckpt", tmp_path / "again"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    assert cli("export", "hf", ckpt, out, "--dtype", "fp32", "--quiet") == 0
    source, again = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == again.keys()
    assert all(torch.equal(t, again[name]) for name, t in source.items())
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(TOKENS).logits, main_hf(TOKENS).logits, atol=1e-5, rtol=1e-5)


def test_mtp_layers_left_out_on_request_and_mismatched_copies_refused(tmp_path, capsys):
    hf_dir, _, _ = make_mtp_dir(tmp_path / "hf")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    capsys.readouterr()
    assert cli("import", "hf", hf_dir, ckpt, "--mtp-num-layers", "0") == 0
    assert "1 multi-token-prediction layer(s) (model.layers.2.*) were not imported (--mtp-num-layers 0)" in " ".join(
        capsys.readouterr().err.split())
    assert json.loads((ckpt / "megapipe.json").read_text())["model"]["mtp_num_layers"] is None
    assert cli("export", "hf", ckpt, out, "--dtype", "fp32", "--quiet") == 0
    assert not any(k.startswith(MTP) for k in load_file(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0

    with pytest.raises(Exception, match=r"--mtp-num-layers 2 asks for more .* than the checkpoint holds \(1\)"):
        load_hf_model(hf_dir, mtp_num_layers=2)
    tensors = load_file(hf_dir / "model.safetensors")
    tensors[MTP + "shared_head.head.weight"][0, 0] += 1.0
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert cli("import", "hf", hf_dir, tmp_path / "bad") != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "model.layers.2.shared_head.head.weight differs from lm_head.weight" in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()
    assert load_hf_model(hf_dir, mtp_num_layers=0).cfg.mtp_depth == 0  # leaving them out needs no copies
