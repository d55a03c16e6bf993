"""Image SFT (posttrain sft on a tiny random Qwen2.5-VL whose tokenizer knows Qwen2-VL's image markers):
conversations with images (OpenAI image_url parts with a relative path or a data: URL, HF's image parts) are
rendered with the image markers, each image token repeated for its patches and never trained on, the pixels stored
beside the tokens exactly as transformers' image processor makes them; the first step's loss is the model's own
loss on those inputs; --freeze-vision / --freeze-projector keep those weights; a missing or unreadable image (a file or a data: URL that
holds no image) is named with its record's file:line."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import pytest
import torch

from megapipe.cli import main
from tests.helpers.hf_vl import CHAT_IDS, draw_images, make_vl_dir

transformers = pytest.importorskip("transformers")
IMAGE = CHAT_IDS[0]


@pytest.fixture(scope="module")
def vl_sft(tmp_path_factory):
    work = tmp_path_factory.mktemp("vl_sft")
    hf_dir, _ = make_vl_dir(work / "hf", chat=True)
    assert main(["import", "hf", str(hf_dir), str(work / "ckpt"), "--quiet"]) == 0
    data = work / "data"
    (data / "img").mkdir(parents=True)
    images = draw_images()
    images[0].save(data / "img" / "a.png")
    images[1].save(data / "b.png")
    url = "data:image/png;base64," + base64.b64encode((data / "b.png").read_bytes()).decode()
    record = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                     {"type": "image_url", "image_url": {"url": "img/a.png"}}]},
        {"role": "assistant", "content": "A red ball."},
        {"role": "user", "content": [{"type": "image", "image": "b.png"}, {"type": "text", "text": " and this?"},
                                     {"type": "image_url", "image_url": url}]},
        {"role": "assistant", "content": "Two green boxes."}]}
    (data / "chat.jsonl").write_text("\n".join([json.dumps(record)] * 2) + "\n")
    return work, data, images


def test_index_holds_expanded_tokens_and_exact_pixels(vl_sft):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from megapipe.data.images import ImageProcessor
    from megapipe.data.sft import ChatEncoder
    from megapipe.data.sft_dataset import SFTImages, prepare_sft_index
    from megapipe.data.tokenizer import load_tokenizer

    work, data, images = vl_sft
    tok_dir = work / "ckpt" / "tokenizer"
    markers = "<|vision_start|><|image_pad|><|vision_end|>"
    encoder = ChatEncoder(tok_dir, image_text=markers)
    index = prepare_sft_index([str(data / "chat.jsonl")], encoder, cache_dir=str(work / "cache"),
                              images=SFTImages(ImageProcessor.from_dir(tok_dir), IMAGE))
    want = Qwen2VLImageProcessorPil.from_pretrained(work / "hf")([images[0], images[1], images[1]],
                                                                 return_tensors="pt")
    grids = index.grids.get(0).reshape(-1, 3)
    assert np.array_equal(grids, want["image_grid_thw"].numpy())
    assert np.array_equal(index.pixels.get(0), want["pixel_values"].numpy().reshape(-1))
    text = ("user: What is this? M\nassistant: A red ball.\nuser: M and this?M\nassistant: Two green boxes.\n"
            .replace("M", markers))
    counts = iter([int(g.prod()) // 4 for g in want["image_grid_thw"]])
    expected = []
    for t in load_tokenizer(tok_dir).encode(text):
        expected += [t] * (next(counts) if t == IMAGE else 1)
    tokens, mask = index.tokens.get(0), index.mask.get(0).astype(bool)
    assert tokens.tolist() == expected and int((tokens == IMAGE).sum()) == 12 + 4 + 4
    assert not mask[tokens == IMAGE].any() and mask.sum() > 0
    trained = load_tokenizer(tok_dir).decode(tokens[mask].tolist())
    assert "A red ball." in trained and "Two green boxes." in trained and "What is" not in trained


def test_image_sft_trains_with_the_models_loss_and_freezes(vl_sft, one_thread):
    from megapipe.checkpoint.load import load_model

    work, data, _ = vl_sft
    run = work / "run"
    args = ["posttrain", "sft", "--load", str(work / "ckpt"), "--data", str(data / "chat.jsonl"), "--seq-length",
            "256", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2", "--lr", "1e-2",
            "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1", "--data-cache-path",
            str(work / "cache2"), "--quiet"]
    assert main([*args, "--save", str(run), "--freeze-vision"]) == 0
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    base, tuned = load_model(work / "ckpt").model, load_model(run).model
    # the model's own loss on the sample (every sample is the one conversation)
    from megapipe.data.images import ImageProcessor
    from megapipe.data.sft import ChatEncoder
    from megapipe.data.sft_dataset import SFTImages, SFTSamples, prepare_sft_index

    tok_dir = work / "ckpt" / "tokenizer"
    index = prepare_sft_index([str(data / "chat.jsonl")], ChatEncoder(
        tok_dir, image_text="<|vision_start|><|image_pad|><|vision_end|>"), cache_dir=str(work / "cache"),
        images=SFTImages(ImageProcessor.from_dir(tok_dir), IMAGE))
    sample = SFTSamples(index, np.arange(1), 256, 1, False, "truncate", 0, 1, False)[0]
    with torch.no_grad():
        logits = base(torch.from_numpy(sample["tokens"])[None], pixel_values=torch.from_numpy(
            sample["pixel_values"]), image_grid_thw=torch.from_numpy(sample["image_grid_thw"]))
    ce = torch.nn.functional.cross_entropy(logits[0].float(), torch.from_numpy(sample["labels"]), reduction="none")
    mask = torch.from_numpy(sample["loss_mask"])
    assert math.isclose(losses[0], float(ce[mask].mean()), rel_tol=1e-4)
    b, t = dict(base.named_parameters()), dict(tuned.named_parameters())
    assert all(torch.equal(b[n], t[n]) for n in b if n.startswith(("visual.blocks", "visual.patch_embed")))
    assert not all(torch.equal(b[n], t[n]) for n in b if n.startswith("visual.merger"))  # the projector trains
    assert not all(torch.equal(b[n], t[n]) for n in b if n.startswith("layers"))
    assert main([*args, "--save", str(work / "run2"), "--freeze-vision", "--freeze-projector"]) == 0
    t2 = dict(load_model(work / "run2").model.named_parameters())
    assert all(torch.equal(b[n], t2[n]) for n in b if n.startswith("visual"))


def test_a_missing_image_is_named_with_its_record(vl_sft, capsys):
    work, data, _ = vl_sft
    bad = data / "bad.jsonl"
    lines = (data / "chat.jsonl").read_text().splitlines()
    bad.write_text(lines[0] + "\n" + lines[1].replace("img/a.png", "img/gone.png") + "\n")
    assert main(["posttrain", "sft", "--load", str(work / "ckpt"), "--data", str(bad), "--seq-length", "96",
                 "--train-iters", "1", "--save", str(work / "bad_run"), "--data-cache-path", str(work / "cache3"),
                 "--quiet"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"{bad}:2: image 1: image file '{data / 'img' / 'gone.png'}' does not exist" in err


NOT_A_PNG = base64.b64encode(b"plain text, no image").decode()


@pytest.mark.parametrize("source, words", [
    ("img/notes.png", "image file '{data}/img/notes.png' could not be decoded as an image (not an image format "
                      "Pillow reads)"),
    ("data:image/png;base64," + NOT_A_PNG, "data URL 'data:image/png;base64,cGxhaW4gdGV4dCwgbm'... could not be "
                                           "decoded as an image (not an image format Pillow reads)"),
    ("data:image/png;base64,@@not-base64@@", "data URL 'data:image/png;base64,@@not-base64@@'... does not hold "
                                             "valid base64"),
], ids=["file", "data-url", "base64"])
def test_an_unreadable_image_is_named_with_its_record(vl_sft, capsys, source, words):
    """A file that is there but holds no image, a data: URL of other bytes or of broken base64: its record's
    file:line, the image's number and source, and nothing written."""
    work, data, _ = vl_sft
    (data / "img" / "notes.png").write_text("not an image\n")
    bad = data / "unreadable.jsonl"
    lines = (data / "chat.jsonl").read_text().splitlines()
    bad.write_text(lines[0] + "\n" + lines[1].replace("img/a.png", source) + "\n")
    run = work / "unreadable_run"
    assert main(["posttrain", "sft", "--load", str(work / "ckpt"), "--data", str(bad), "--seq-length", "96",
                 "--train-iters", "1", "--save", str(run), "--data-cache-path", str(work / "cache4"),
                 "--quiet"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"{bad}:2: image 1: {words.format(data=data)}" in err and "Traceback" not in err, err
    assert not run.exists()


def _sample(work, data):
    """The conversation's tokens, images and labels as the SFT index stores them (seq length 256)."""
    from megapipe.data.images import ImageProcessor
    from megapipe.data.sft import ChatEncoder
    from megapipe.data.sft_dataset import SFTImages, SFTSamples, prepare_sft_index

    tok_dir = work / "ckpt" / "tokenizer"
    index = prepare_sft_index([str(data / "chat.jsonl")], ChatEncoder(
        tok_dir, image_text="<|vision_start|><|image_pad|><|vision_end|>"), cache_dir=str(work / "cache"),
        images=SFTImages(ImageProcessor.from_dir(tok_dir), IMAGE))
    s = SFTSamples(index, np.arange(1), 256, 1, False, "truncate", 0, 1, False)[0]
    return torch.from_numpy(s["tokens"])[None], torch.from_numpy(s["pixel_values"]), torch.from_numpy(
        s["image_grid_thw"])


def test_lora_on_the_decoder_trains_merges_and_exports_for_peft(vl_sft, one_thread):
    """--lora-rank on image conversations: adapters on the decoder only (the tower and projector frozen with the
    base); the merged model (what inference loads) gives the adapter model's logits on text + image inputs, and the
    peft export loaded by peft onto the exported base gives them too (through transformers' own image path)."""
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megapipe.checkpoint import load_checkpoint, read_manifest
    from megapipe.checkpoint.load import load_model
    from megapipe.config import ModelConfig, from_dict
    from megapipe.models import build_model
    from megapipe.models.lora import LoRASpec, apply_lora, is_adapter, lora_layers

    work, data, _ = vl_sft
    run = work / "lora_run"
    assert main(["posttrain", "sft", "--load", str(work / "ckpt"), "--data", str(data / "chat.jsonl"),
                 "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2",
                 "--lr", "1e-2", "--lr-warmup-iters", "0", "--eval-iters", "0", "--data-cache-path",
                 str(work / "cache_lora"), "--lora-rank", "4", "--lora-alpha", "8", "--save", str(run),
                 "--quiet"]) == 0
    step = run / "step_00000002"
    manifest = read_manifest(step)
    cfg = from_dict(ModelConfig, manifest["model"], "model.")
    ours = apply_lora(build_model(cfg), LoRASpec.from_manifest(manifest["lora"]))
    load_checkpoint(step, ours, load_rng=False)
    layers = lora_layers(ours)
    assert len(layers) == 7 * cfg.num_layers and all(n.startswith("layers.") for n, _ in layers)
    assert all(m.lora_B.weight.abs().max() > 0 for _, m in layers)  # trained (B starts at zero)
    base = dict(load_model(work / "ckpt").model.named_parameters())
    assert all(torch.equal(p, base[n]) for n, p in ours.named_parameters() if not is_adapter(n))

    tokens, pixels, grids = _sample(work, data)
    with torch.no_grad():
        want = ours(tokens, pixel_values=pixels, image_grid_thw=grids)
        merged = load_model(step).model(tokens, pixel_values=pixels, image_grid_thw=grids)
    torch.testing.assert_close(merged, want, atol=1e-5, rtol=1e-5)

    for args in (["export", "hf", str(work / "ckpt"), str(work / "lora_base_hf"), "--dtype", "fp32"],
                 ["export", "hf", str(step), str(work / "lora_adapter"), "--lora-adapter-only"]):
        assert main([*args, "--quiet"]) == 0
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(work / "lora_base_hf", dtype=torch.float32)
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(hf, work / "lora_adapter").eval()
        got = peft_model(input_ids=tokens, pixel_values=pixels, image_grid_thw=grids,
                         mm_token_type_ids=(tokens == IMAGE).int()).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.dist
def test_image_sft_under_tensor_parallel_and_fsdp_equals_one_process(vl_sft, tmp_path):
    """posttrain sft on image conversations through torchrun, tp2 x dp_shard2 (the tower replicated and frozen),
    against the same run in one process: each step's loss within 1e-5 relative (fp32, AdamW)."""
    from tests.posttrain.test_posttrain_dist import REL, megapipe, train_losses

    work, data, _ = vl_sft
    args = ["posttrain", "sft", "--load", str(work / "ckpt"), "--data", str(data / "chat.jsonl"), "--seq-length",
            "256", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2",
            "--lr-warmup-iters", "0", "--eval-iters", "0", "--log-interval", "1", "--freeze-vision",
            "--data-cache-path", str(tmp_path / "cache"), "--quiet"]
    assert main([*args, "--save", str(tmp_path / "one")]) == 0
    megapipe([*args, "--save", str(tmp_path / "four"), "--nproc-per-node", "4", "--tensor-model-parallel-size", "2"])
    one, four = train_losses(tmp_path / "one"), train_losses(tmp_path / "four")
    assert sorted(four) == sorted(one) == [1, 2]
    assert all(four[s] == pytest.approx(one[s], rel=REL) for s in one), (one, four)
    manifest = json.loads((tmp_path / "four" / "step_00000002" / "megapipe.json").read_text())
    assert manifest["layout"] == {"world_size": 4, "parallel": "dp_shard2,tp2"}
