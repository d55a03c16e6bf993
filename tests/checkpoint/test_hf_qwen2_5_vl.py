"""HF bridge for Qwen2_5_VLForConditionalGeneration: a random transformers model -> ``import hf`` -> the checkpoint's
logits on text + image inputs (transformers' image processor on images drawn here) == transformers' (fp32, 1e-5) ->
``export hf`` -> the same tensors bit for bit, a config.json transformers loads to the same logits, and the image
processor's preprocessor_config.json carried through the checkpoint; transformers' in-memory names import; what
megapipe cannot represent is refused in one sentence."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megapipe.checkpoint.hf.bridge import load_hf_model
from megapipe.checkpoint.load import load_model
from megapipe.cli import main
from tests.helpers.hf_vl import hf_logits, make_vl_dir, vl_inputs

transformers = pytest.importorskip("transformers")


def cli(*args) -> int:
    return main([str(a) for a in args])


def _ours(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs["tokens"], pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])


def test_import_logits_export_tensors_and_processor_files(tmp_path):
    hf_dir, hf_model = make_vl_dir(tmp_path / "hf")
    inputs = vl_inputs(hf_dir)
    want = hf_logits(hf_model, inputs)
    ckpt, out = tmp_path / "ckpt", tmp_path / "again"
    assert cli("import", "hf", hf_dir, ckpt, "--quiet") == 0
    ours = load_model(ckpt).model.eval()
    assert ours.cfg.arch == "qwen2_5_vl" and ours.cfg.vision_depth == 3 and ours.cfg.mrope_section == [2, 3, 3]
    torch.testing.assert_close(_ours(ours, inputs), want, atol=1e-5, rtol=0)
    processor = (hf_dir / "preprocessor_config.json").read_bytes()
    assert (ckpt / "tokenizer" / "preprocessor_config.json").read_bytes() == processor

    assert cli("export", "hf", ckpt, out, "--dtype", "fp32", "--quiet") == 0
    source, again = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == again.keys()
    assert all(torch.equal(t, again[name]) for name, t in source.items())
    assert (out / "preprocessor_config.json").read_bytes() == processor
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"] and config["image_token_id"] == 300
    exported = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    assert exported.config.vision_config.fullatt_block_indexes == [1]
    torch.testing.assert_close(hf_logits(exported, vl_inputs(out)), want, atol=1e-5, rtol=0)


def test_in_memory_names_import(tmp_path):
    """Tensors under transformers' module names (``model.language_model.``, ``model.visual.``), not the files'."""
    hf_dir, hf_model = make_vl_dir(tmp_path / "hf")
    tensors = load_file(hf_dir / "model.safetensors")
    assert any(n.startswith("visual.") for n in tensors) and any(n.startswith("model.layers.") for n in tensors)
    renamed = {("model.language_model." + n[6:] if n.startswith("model.") else
                "model." + n if n.startswith("visual.") else n): t for n, t in tensors.items()}
    save_file(renamed, hf_dir / "model.safetensors", metadata={"format": "pt"})
    inputs = vl_inputs(hf_dir)
    torch.testing.assert_close(_ours(load_hf_model(hf_dir).model.eval(), inputs), hf_logits(hf_model, inputs),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("change, words", [
    ({"out_hidden_size": 32}, "vision_config.out_hidden_size = 32 cannot be represented by megapipe (the patch "
                              "merger feeds the decoder, 64 wide)"),
    ({"hidden_act": "gelu"}, "vision_config.hidden_act = 'gelu' cannot be represented by megapipe"),
], ids=["out_hidden_size", "hidden_act"])
def test_refuses_vision_configs_megapipe_cannot_represent(tmp_path, capsys, change, words):
    hf_dir, _ = make_vl_dir(tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config["vision_config"].update(change)
    (hf_dir / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert cli("import", "hf", hf_dir, tmp_path / "ckpt") != 0
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    assert words in " ".join(err.split())


def test_a_pretrained_tiny_model_exports_once_its_token_ids_are_set(pretrain_data, tmp_path, capsys, one_thread):
    """A megapipe-trained qwen2.5-vl-tiny (text only) writes a config transformers builds the same model from:
    transformers' logits on text + image equal megapipe's; without the placeholder ids, export names the one unset."""
    from tests.models.test_vision import SMALL

    prefix, tok = pretrain_data
    ids = ["--set", "model.image_token_id=300", "--set", "model.video_token_id=301"]
    run, out = tmp_path / "run", tmp_path / "hf"
    assert cli("pretrain", "--data-path", prefix, "--tokenizer", tok, *SMALL, *ids, "--train-iters", "1",
               "--save", run) == 0
    capsys.readouterr()
    assert cli("export", "hf", run, out, "--dtype", "fp32") != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "model.vision_start_token_id is not set: a Hugging Face Qwen2_5_VLForConditionalGeneration config " \
           "needs it" in err and not out.exists()
    ckpt = run / "step_00000001"
    manifest = json.loads((ckpt / "megapipe.json").read_text())
    manifest["model"].update(vision_start_token_id=302, vision_end_token_id=303)
    (ckpt / "megapipe.json").write_text(json.dumps(manifest))
    assert cli("export", "hf", ckpt, out, "--dtype", "fp32", "--quiet") == 0
    exported = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    ours = load_model(ckpt).model.eval()
    tokens = torch.tensor([[5, 6, 7, 300, 300, 300, 300, 9]])
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    inputs = {"tokens": tokens, "pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4]])}
    torch.testing.assert_close(_ours(ours, inputs), hf_logits(exported, inputs), atol=1e-5, rtol=0)
