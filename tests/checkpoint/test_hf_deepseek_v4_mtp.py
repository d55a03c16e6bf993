"""DeepSeek-V4's multi-token-prediction layer in the HF bridge: a checkpoint with ``num_nextn_predict_layers`` = 1 and
its ``mtp.0.*`` tensors (as the Hub holds them; transformers has no MTP forward and leaves them out) imports into
megapipe's MTP module, whose logits and MTP loss equal DeepSeek's published formula written out here on the raw
tensors (the main model's last-layer streams and the next token's embedding, each RMS-normed, e_proj(e) added to
every stream's h_proj(h), transformers' decoder layer as the block, the module's own hyper-connection head, its norm,
the shared output head; depth 1's cross-entropy against the token two ahead), and exports back to the same tensors
under the same names; ``--mtp-num-layers 0`` leaves them out with a note."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megapipe.checkpoint.hf.bridge import load_hf_model
from megapipe.cli import main
from megapipe.models.mtp import shift_left
from megapipe.models.objective import ModelOutput, TokenCrossEntropy
from tests.helpers.hf_mtp import V4_MTP, make_v4_mtp_dir

TOKENS = torch.tensor(
    [
        [5, 17, 9, 33, 2, 71, 8, 19, 44, 3, 120, 7, 60, 1, 90, 14, 30, 2, 8, 5],
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    ]
)


def cli(*args) -> int:
    return main([str(a) for a in args])


def rms(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def reference_mtp_logits(full, own: dict, tokens: torch.Tensor) -> torch.Tensor:
    """Depth 1 at index t (predicting token t + 2) by DeepSeek's published MTP block; the main model is the first
    four layers of ``full``, its last layer the MTP block's."""
    captured = {}

    def grab(_module, args, kwargs):
        captured.update(streams=args[0], kwargs=kwargs)

    handle = full.model.layers[4].register_forward_pre_hook(grab, with_kwargs=True)
    full(tokens, use_cache=False)
    handle.remove()
    eps, cfg = full.config.rms_norm_eps, full.config
    e = rms(full.model.embed_tokens(shift_left(tokens, 1, 0)), own["enorm.weight"], eps) @ own["e_proj.weight"].T
    x = e.unsqueeze(2) + rms(captured["streams"], own["hnorm.weight"], eps) @ own["h_proj.weight"].T
    x = full.model.layers[4](x, **captured["kwargs"])
    flat = x.flatten(2)
    mixes = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps) @ own["hc_head_fn"].T
    pre = torch.sigmoid(mixes * own["hc_head_scale"] + own["hc_head_base"]) + cfg.hc_eps
    return full.lm_head(rms((pre.unsqueeze(-1) * x).sum(2), own["norm.weight"], eps))


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return make_v4_mtp_dir(tmp_path_factory.mktemp("v4mtp") / "hf")


def test_mtp_layer_logits_and_loss_equal_the_published_formula(mtp_dir):
    import transformers

    hf_dir, full, own = mtp_dir
    loaded = load_hf_model(hf_dir)
    assert loaded.cfg.mtp_num_layers == 1 and loaded.cfg.num_layers == 4 and not loaded.notes
    assert loaded.model.mtp[0].block.attention.kind == "sliding_attention"
    main_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()  # leaves mtp.0 out
    with torch.no_grad():
        logits, [mtp_logits] = loaded.model(TOKENS, mtp=True)
        want_main = main_hf(TOKENS).logits
    # SDPA in megapipe's attention, eager softmax in transformers': 1e-5 of the logits' range (as the main logits)
    assert (logits - want_main).abs().max() <= 1e-5 * want_main.abs().max()
    want = reference_mtp_logits(full, own, TOKENS)
    assert (mtp_logits - want).abs().max() <= 1e-5 * want.abs().max()

    labels = shift_left(TOKENS, 1, -100)
    result = TokenCrossEntropy()(
        ModelOutput(logits=logits, mtp=[mtp_logits], mtp_weight=0.3), {"tokens": TOKENS, "labels": labels}
    )
    ce = torch.nn.functional.cross_entropy(want[:, :-2].flatten(0, 1), TOKENS[:, 2:].flatten(), reduction="sum")
    torch.testing.assert_close(result.metrics["mtp/loss_1"], ce, rtol=1e-5, atol=0)
    torch.testing.assert_close(result.backprop, 0.3 * ce, rtol=1e-5, atol=0)


def test_mtp_layer_exports_back_and_is_left_out_on_request(mtp_dir, tmp_path, capsys):
    hf_dir, _, _ = mtp_dir
    ckpt, out = tmp_path / "ckpt", tmp_path / "again"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    assert cli("export", "hf", ckpt, out, "--dtype", "fp32", "--quiet") == 0
    source, again = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == again.keys() and any(k.startswith(V4_MTP) for k in source)
    assert all(torch.equal(t, again[name]) for name, t in source.items())
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1

    capsys.readouterr()
    assert cli("import", "hf", hf_dir, tmp_path / "none", "--mtp-num-layers", "0") == 0
    assert "1 multi-token-prediction layer(s) (mtp.0.*) were not imported (--mtp-num-layers 0)" in " ".join(
        capsys.readouterr().err.split()
    )
    with pytest.raises(Exception, match=r"--mtp-num-layers 2 asks for more .* than the checkpoint holds \(1\)"):
        load_hf_model(hf_dir, mtp_num_layers=2)
