"""The engine with images (megapipe.inference.images): a tiny random Qwen2.5-VL imported from transformers; prompts
of text around an image (transformers' image processor on images drawn here) decode greedily token for token as
transformers' ``generate`` does, on the default path, the torch path and in prefill chunks that cut an image, the
vision tower running once per request with an image (its forward calls counted); the prefix cache tells prompts with
the same tokens but other images apart; mistakes are refused in one sentence."""

from __future__ import annotations

import pytest
import torch

from megapipe.cli import main
from megapipe.inference import LLMEngine, SamplingParams
from megapipe.inference.sampling import ParamError
from tests.helpers.hf_vl import IMAGE_TOKEN, draw_images, make_vl_dir, vl_inputs

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(checkpoint, transformers model, prompts [2, S], each prompt's images)."""
    work = tmp_path_factory.mktemp("vl_engine")
    hf_dir, hf_model = make_vl_dir(work / "hf")
    assert main(["import", "hf", str(hf_dir), str(work / "ckpt"), "--quiet"]) == 0
    inputs = vl_inputs(hf_dir)
    grids = inputs["image_grid_thw"]
    pixels = torch.split(inputs["pixel_values"], [int(g.prod()) for g in grids])
    images = [{"pixel_values": pixels[r], "image_grid_thw": grids[r:r + 1]} for r in range(len(grids))]
    return work / "ckpt", hf_model, inputs["tokens"].tolist(), images


def hf_greedy_images(hf_model, prompt: list[int], images: dict, max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=images["pixel_values"],
                            image_grid_thw=images["image_grid_thw"], mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                            max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("config", [{}, {"pack_weights": False, "cpu_kernels": False}, {"max_num_batched_tokens": 5}],
                         ids=["default", "torch", "chunked"])
def test_greedy_with_images_equals_transformers(vl, config, one_thread):
    ckpt, hf_model, prompts, images = vl
    want = [hf_greedy_images(hf_model, p, i, 8) for p, i in zip(prompts, images, strict=True)]
    engine = LLMEngine.from_pretrained(ckpt, device="cpu", **config)
    calls = []
    engine.runner.model.visual.register_forward_hook(lambda *_: calls.append(1))
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY, images=images)]
    assert got == want
    assert len(calls) == len(prompts)  # the tower runs once per request with an image, whatever the prefill chunks
    text_only = [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert text_only != want  # the images are what the answers depend on
    assert len(calls) == len(prompts)


def test_the_prefix_cache_tells_images_apart(vl, tmp_path, one_thread):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ckpt, hf_model, prompts, images = vl
    flipped = draw_images()[0].transpose(0)  # the first image mirrored: the same grid, other pixels
    out = Qwen2VLImageProcessorPil()(flipped, return_tensors="pt")
    other = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    assert torch.equal(other["image_grid_thw"], images[0]["image_grid_thw"])
    engine = LLMEngine.from_pretrained(ckpt, device="cpu", block_size=4)
    first = engine.generate([prompts[0]], GREEDY, images=[images[0]])[0]
    again = engine.generate([prompts[0]], GREEDY, images=[images[0]])[0]
    mirrored = engine.generate([prompts[0]], GREEDY, images=[other])[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert mirrored.num_cached_tokens == 0
    assert mirrored.outputs[0].token_ids == hf_greedy_images(hf_model, prompts[0], other, 8)


def test_mistakes_are_refused(vl, tmp_path):
    ckpt, _, prompts, images = vl
    engine = LLMEngine.from_pretrained(ckpt, device="cpu")
    both = {"pixel_values": torch.cat([i["pixel_values"] for i in images]),
            "image_grid_thw": torch.cat([i["image_grid_thw"] for i in images])}
    with pytest.raises(ParamError, match="the prompt holds 12 image tokens but its images make 16"):
        engine.add_request("a", prompts[0], GREEDY, images=both)
    with pytest.raises(ParamError, match=r"an image of grid \[1, 8, 6\] needs 12 image tokens at position 8, but "
                                         r"the tokens hold 4 in a row there"):
        engine.add_request("b", prompts[1], GREEDY, images=images[0])
    assert not engine.has_unfinished()


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_any_decoder_behind_the_tower_decodes_greedily(name, one_thread):
    """A Llama and a Mixtral-shaped decoder behind the tower (random weights): the engine's greedy tokens, in whole
    and in chunked prefills, are those of the model's full forward on the text + image, token by token."""
    from megapipe.inference import EngineConfig
    from megapipe.models import build_model
    from tests.models.test_vision import decoder_vl, decoder_vl_batch

    model = build_model(decoder_vl(name), seed=0).eval()
    batch = decoder_vl_batch()
    prompt, image = batch["tokens"][0].tolist(), {k: batch[k] for k in ("pixel_values", "image_grid_thw")}
    want = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            want.append(int(model(torch.tensor([want]), **image)[0, -1].argmax()))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for config in ({}, {"max_num_batched_tokens": 5, "block_size": 4}):
        engine = LLMEngine(model, None, EngineConfig(**config))
        got = engine.generate([prompt], params, images=[image])[0].outputs[0].token_ids
        assert got == want[len(prompt):], config
