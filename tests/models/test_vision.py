"""The vision-language model (megapipe.models.vision) against transformers' Qwen2.5-VL: logits on text + image
inputs made by transformers' own image processor (fp32, 1e-5), the vision tower's embeddings, M-RoPE positions as
transformers' get_rope_index makes them; text-only M-RoPE is the 1-D rope; the presets' parameter counts and the
planner's vision figures."""

from __future__ import annotations

import pytest
import torch

from megapipe.checkpoint.hf.bridge import load_hf_model
from megapipe.config import ModelConfig, from_dict
from megapipe.errors import MegapipeError
from megapipe.models import build_model
from megapipe.models.rope import model_rope
from megapipe.models.vision import flat_images, mrope_positions, rowwise_images
from tests.helpers.hf_vl import IMAGE_TOKEN, hf_logits, make_vl_dir, vl_inputs

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    hf_dir, hf_model = make_vl_dir(tmp_path_factory.mktemp("vl") / "hf")
    return hf_dir, hf_model, load_hf_model(hf_dir).model.eval(), vl_inputs(hf_dir)


def _ours(model, inputs, **kw):
    with torch.no_grad():
        return model(inputs["tokens"], pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                     **kw)


def test_text_and_image_logits_equal_transformers(vl):
    _, hf_model, ours, inputs = vl
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 6], [1, 4, 4]]  # windows cut short by the 4 x 3 grid's edge
    want = hf_logits(hf_model, inputs)
    torch.testing.assert_close(_ours(ours, inputs), want, atol=1e-5, rtol=0)
    flat = torch.arange(inputs["tokens"].shape[1])  # the 1-D positions: M-RoPE is what makes them equal
    assert (_ours(ours, inputs, positions=flat) - want).abs().max() > 1e-3
    with torch.no_grad():
        text = hf_model(input_ids=inputs["tokens"]).logits
        torch.testing.assert_close(ours(inputs["tokens"]), text, atol=1e-5, rtol=0)


def test_vision_tower_equals_transformers(vl):
    _, hf_model, ours, inputs = vl
    with torch.no_grad():
        want = hf_model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        got = ours.visual(inputs["pixel_values"], inputs["image_grid_thw"])
    assert got.shape == (16, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_mrope_positions_equal_transformers(vl):
    _, hf_model, _, inputs = vl
    tokens, grids = inputs["tokens"], inputs["image_grid_thw"]
    want, deltas = hf_model.model.get_rope_index(tokens, (tokens == IMAGE_TOKEN).int(), image_grid_thw=grids)
    got, ours = mrope_positions(tokens, grids, IMAGE_TOKEN, 2)
    assert torch.equal(got, want) and torch.equal(ours, deltas.view(-1))
    assert got[:, 1, 8:12].tolist() == [[8] * 4, [8, 8, 9, 9], [8, 9, 8, 9]]  # a 2 x 2 image after 8 text tokens


def test_text_positions_make_the_1d_rope():
    cfg = from_dict(ModelConfig, {"preset": "qwen2.5-vl-tiny", "vocab_size": 64})
    positions = torch.tensor([[0, 1, 2, 7, 9], [3, 4, 5, 6, 7]])
    plain, multi = model_rope(cfg, positions, torch.float32), model_rope(cfg, positions.expand(3, -1, -1), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(plain, multi, strict=True))


def test_mismatched_images_are_refused(vl):
    _, _, ours, inputs = vl
    fewer = inputs["tokens"].clone()
    fewer[0, 8] = 5
    with pytest.raises(MegapipeError, match=r"the tokens hold 15 image tokens \(id 300\) but the images make 16 "):
        _ours(ours, {**inputs, "tokens": fewer})
    with pytest.raises(MegapipeError, match=r"the image grids \[\[1, 8, 6\]\] hold 48 patches but pixel_values has 64"):
        _ours(ours, {**inputs, "image_grid_thw": inputs["image_grid_thw"][:1]})
    with pytest.raises(MegapipeError, match=r"an image of grid \[1, 8, 6\] needs 12 image tokens at position 9, but "
                                            r"the tokens hold 11"):
        mrope_positions(fewer, inputs["image_grid_thw"], IMAGE_TOKEN, 2)
    with pytest.raises(MegapipeError, match="more images"):
        mrope_positions(inputs["tokens"], inputs["image_grid_thw"][:1], IMAGE_TOKEN, 2)


def test_row_by_row_images_are_the_batch_images_and_give_the_same_logits(vl):
    """The pipeline stages' batch-first inputs (rowwise_images, M-RoPE positions [B, 3, S]) give the flat inputs'
    logits; rows cut from them keep their own images; tokens and grids that disagree are refused."""
    _, _, ours, inputs = vl
    tokens, pixels, grids = inputs["tokens"], inputs["pixel_values"], inputs["image_grid_thw"]
    rows, row_grids = rowwise_images(tokens, pixels, grids, IMAGE_TOKEN, 2)
    assert rows.shape == (2, 48, pixels.shape[1]) and row_grids.tolist() == [[[1, 8, 6]], [[1, 4, 4]]]
    flat = flat_images(rows, row_grids)
    assert torch.equal(flat[0], pixels) and torch.equal(flat[1], grids)
    assert torch.equal(flat_images(rows[1:], row_grids[1:])[0], pixels[48:])
    positions = mrope_positions(tokens, grids, IMAGE_TOKEN, 2)[0].movedim(0, 1)
    with torch.no_grad():
        got = ours(tokens, pixel_values=rows, image_grid_thw=row_grids, mrope_position_ids=positions)
    torch.testing.assert_close(got, _ours(ours, inputs), atol=0, rtol=0)
    with pytest.raises(MegapipeError, match="the batch's image tokens fill 1 of its 2 image grids"):
        rowwise_images(tokens[:1], pixels, grids, IMAGE_TOKEN, 2)


def test_every_batch_runs_the_tower_on_text_and_changes_nothing(vl):
    """Under data parallelism the tower runs on a text-only batch too (a blank image times zero): the same logits as
    without it, and zero (not absent) gradients for the tower, so every rank reduces the same parameters."""
    _, _, ours, inputs = vl
    tokens = inputs["tokens"][:, :6]  # text before the images
    want = ours(tokens)
    ours.visual.every_batch = True
    try:
        got = ours(tokens)
        got.sum().backward()
    finally:
        ours.visual.every_batch = False
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    grads = [p.grad for p in ours.visual.parameters()]
    assert all(g is not None and not g.any() for g in grads)
    ours.zero_grad(set_to_none=True)


def test_tiny_preset_runs_an_image_on_cpu():
    cfg = from_dict(ModelConfig, {"preset": "qwen2.5-vl-tiny", "vocab_size": 64, "image_token_id": 60})
    model = build_model(cfg, seed=0).eval()
    tokens = torch.tensor([[1, 2] + [60] * 4 + [3]])
    pixels = torch.randn(16, 3 * 2 * 14 * 14)
    with torch.no_grad():
        logits = model(tokens, pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]]))
    assert logits.shape == (1, 7, 64) and torch.isfinite(logits).all()


def test_7b_preset_counts_what_transformers_counts():
    """Qwen/Qwen2.5-VL-7B-Instruct's config.json (its numbers, as facts) built by transformers on the meta device."""
    from megapipe.config import Config
    from megapipe.parallel.plan import plan

    published = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "vocab_size": 152064,
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 128000, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "tie_word_embeddings": False,
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_config": {
            "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
            "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2}}
    with torch.device("meta"):
        hf = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig.from_dict(published))
    theirs = sum(p.numel() for p in hf.parameters())
    cfg = Config(model=from_dict(ModelConfig, {"preset": "qwen2.5-vl-7b"}))
    cfg.data.seq_length, cfg.train.global_batch_size, cfg.train.micro_batch_size = 4096, 64, 1
    cfg.train.precision = "bf16"
    result = plan(cfg, gpus=8)
    assert abs(result["params"]["total"] - theirs) / theirs < 0.01
    vision = result["vision"]
    assert vision["params"] == sum(p.numel() for p in hf.model.visual.parameters())
    assert 0.08 < vision["params_share"] < 0.09 and vision["image_tokens"] == 256
    assert 0 < vision["memory_share"] < 1 and 0 < vision["flops_share"] < 1

    from megapipe.checkpoint.hf import adapter_for_arch
    from megapipe.checkpoint.hf.bridge import normalise_hf_config

    adapter = adapter_for_arch("qwen2_5_vl")  # the published config (flat text fields) read through the bridge
    read = from_dict(ModelConfig, adapter.config_from_hf(normalise_hf_config(published, adapter, "published"), ""))
    preset = from_dict(ModelConfig, {"preset": "qwen2.5-vl-7b"})
    differ = {k: (getattr(read, k), v) for k, v in vars(preset).items()
              if k not in ("preset", "make_vocab_size_divisible_by", "init_std", "head_dim") and getattr(read, k) != v}
    assert differ == {} and read.dim_per_head == preset.dim_per_head == 128


SMALL = ["--model", "qwen2.5-vl-tiny", "--set", "model.num_layers=2", "--set", "model.vision_depth=2",
         "--set", "model.vision_fullatt_block_indexes=[1]", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--split", "90,10,0", "--eval-iters", "1", "--log-interval", "1", "--quiet"]


def test_pretrain_one_process_text_only_and_packing_refused(pretrain_data, tmp_path, capsys, one_thread):
    import json

    from megapipe.checkpoint.load import load_model
    from megapipe.cli import main

    prefix, tok = pretrain_data
    args = ["pretrain", "--data-path", prefix, "--tokenizer", str(tok), *SMALL, "--train-iters", "2"]
    assert main([*args, "--save", str(tmp_path / "run")]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "train"]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    model = load_model(tmp_path / "run").model
    assert model.cfg.vision_depth == 2 and len(model.visual.blocks) == 2  # the tower is saved with the decoder
    capsys.readouterr()
    assert main([*args, "--reset-attention-mask", "--save", str(tmp_path / "packed")]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "pretrain of Qwen2.5-VL models does not support packing" in err and "Traceback" not in err


def test_the_server_refuses_image_content_parts():
    from megapipe.inference.protocol import ChatMessage, ParamError

    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(ParamError, match="content part of type 'image_url' is not supported"):
        ChatMessage(role="user", content=parts).as_template_input()


# the tower in front of decoders other than Qwen2.5-VL's: a Llama one and a Mixtral-shaped MoE one (2-pixel patches of
# 2 frames, 1-merged-patch windows, block 1 full)
TOWER = dict(mrope_section=[2, 1, 1], vision_depth=2, vision_hidden_size=16, vision_intermediate_size=32,
             vision_num_heads=2, vision_patch_size=2, vision_window_size=4, vision_fullatt_block_indexes=[1],
             image_token_id=60)
DECODERS = {"llama": dict(arch="llama"), "mixtral": dict(arch="mixtral", num_experts=4)}


def decoder_vl(name: str, **changes) -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       **{**DECODERS[name], **TOWER, **changes})


def decoder_vl_batch() -> dict:
    """Row 0: 3 text tokens, a 4 x 4-patch image (4 image tokens), 2 text tokens; row 1: text only."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.tensor([[1, 2, 3, 60, 60, 60, 60, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15]])
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "image_grid_thw": torch.tensor([[1, 4, 4]]),
            "pixel_values": torch.randn(16, 3 * 2 * 2 * 2, generator=g)}


@pytest.mark.parametrize("name", DECODERS)
def test_any_decoder_behind_the_tower_forward_and_train_step(name):
    """Text + image logits are finite; the text-only row, and the text before the image, are the decoder's own (built
    without a tower, the same weights); one training step reaches the tower's and the decoder's weights."""
    from megapipe.parallel.dims import ParallelDims
    from megapipe.parallel.step import train_step

    cfg = decoder_vl(name)
    model = build_model(cfg, seed=0)
    assert type(model).__name__ == "VisionLanguageModel"
    decoder = build_model(decoder_vl(name, vision_depth=0, mrope_section=None), seed=1)
    decoder.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("visual.")})
    batch = decoder_vl_batch()
    with torch.no_grad():
        logits = model(batch["tokens"], pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
        alone = decoder(batch["tokens"])
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[1], alone[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(logits[0, :3], alone[0, :3], atol=1e-6, rtol=0)
    assert (logits[0, 3:] - alone[0, 3:]).abs().max() > 1e-3  # the image fills its tokens

    result = train_step(model, [batch], ParallelDims())
    assert torch.isfinite(result.loss) and result.units == batch["tokens"].numel()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    for n in ("visual.patch_embed.proj.weight", "visual.blocks.0.attn.qkv.weight", "visual.merger.fc2.weight",
              "layers.0.attention.wq.weight", "tok_embeddings.weight", "output.weight"):
        assert grads[n].abs().sum() > 0, n
    mlp = "layers.1.moe.experts.w2" if name == "mixtral" else "layers.1.feed_forward.w2.weight"
    assert grads[mlp].abs().sum() > 0
