"""Images through ``megapipe serve`` (the official openai client against a live server on a tiny random Qwen2.5-VL
whose tokenizer knows Qwen2-VL's image markers): chat content parts with data: URLs decode greedily as
transformers' ``generate`` does on the same prompt (its tokenizer and chat template, its image processor, the
placeholders repeated as its processor does), streaming too; remote URLs, oversized images and a mismatch of
placeholders are refused with a 400 that says why, before anything reaches the engine. Both with the engine in a
thread and in an engine core process (which gets the decoded, checked images)."""

from __future__ import annotations

import base64
import io
import json

import openai
import pytest
import torch
from PIL import Image

from megapipe.cli import main
from megapipe.data.images import ImageLimits
from megapipe.inference.sampling import ParamError
from tests.helpers.hf_vl import CHAT_IDS, draw_images, make_vl_dir
from tests.inference.test_server import LiveServer

transformers = pytest.importorskip("transformers")
QUESTION = [{"type": "text", "text": "What is this? "}, "IMAGE", {"type": "text", "text": " And this: "}, "IMAGE",
            {"type": "text", "text": " Say it."}]


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(urls) -> list[dict]:
    it = iter(urls)
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": next(it)}} if p == "IMAGE"
                                         else dict(p) for p in QUESTION]}]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    work = tmp_path_factory.mktemp("vl_server")
    hf_dir, hf_model = make_vl_dir(work / "hf", chat=True)
    assert main(["import", "hf", str(hf_dir), str(work / "ckpt"), "--quiet"]) == 0
    return hf_dir, hf_model


@pytest.fixture(scope="module", params=[False, True], ids=["engine_thread", "engine_process"])
def vl_server(vl_model, request):
    hf_dir, hf_model = vl_model
    limits = ImageLimits(4000, 200 * 200, ("--max-image-size", "--max-image-pixels"))
    server = LiveServer(hf_dir.parent / "ckpt", body=1 << 20, server_config={"image_limits": limits},
                        engine_process=request.param)
    yield server, hf_dir, hf_model
    server.stop()


def hf_greedy(hf_dir, hf_model, images, max_new: int) -> tuple[list[int], list[int]]:
    """transformers' prompt (its tokenizer's chat template, each image placeholder repeated for its patches) and
    its greedy continuation."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(hf_dir)
    hf_messages = [{"role": "user", "content": [{"type": "image"} if p == "IMAGE" else p for p in QUESTION]}]
    text = tok.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    pixels = Qwen2VLImageProcessorPil.from_pretrained(hf_dir)(images, return_tensors="pt")
    for grid in pixels["image_grid_thw"]:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(grid.prod()) // 4), 1)
    ids = tok(text.replace("<|placeholder|>", "<|image_pad|>"), add_special_tokens=False,
              return_tensors="pt")["input_ids"]
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(
        ids == CHAT_IDS[0]).int(), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=1,
        **pixels)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


def test_chat_with_images_equals_transformers(vl_server, one_thread):
    server, hf_dir, hf_model = vl_server
    images = draw_images()
    prompt, want = hf_greedy(hf_dir, hf_model, images, 8)
    tok = server.engine.tokenizer
    c = server.client()
    urls = [data_url(i) for i in images]
    got = c.chat.completions.create(model="tiny", messages=messages(urls), max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == 8
    assert got.choices[0].message.content == tok.decode(want)
    stream = c.chat.completions.create(model="tiny", messages=messages(urls), max_tokens=8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == tok.decode(want)
    text_only = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is this?"}],
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert text_only.usage.prompt_tokens < len(prompt)


def test_image_mistakes_are_400s(vl_server, monkeypatch):
    server, _, _ = vl_server
    submitted = []
    monkeypatch.setattr(server.async_engine, "_submit", lambda *a: submitted.append(a))  # what reaches the engine
    c = server.client()
    small = data_url(draw_images()[1])
    big = draw_images()[0].resize((300, 300))
    cases = [
        (["https://example.com/cat.png", small], "image 1 of the request: remote image URLs are not fetched"),
        ([small, "data:image/png;base64,not base64!"], "image 2 of the request: data URL"),
        ([small, "data:image/png;base64," + base64.b64encode(b"not a png").decode()], "could not be decoded"),
        ([small, data_url(big)], "over the limit of 4000 bytes per image \\(--max-image-size\\)"),
    ]
    for urls, why in cases:
        with pytest.raises(openai.BadRequestError, match=why):
            c.chat.completions.create(model="tiny", messages=messages(urls), max_tokens=2)
    one = messages([small, small])
    one[0]["content"] = one[0]["content"][:2]  # one image part
    one[0]["content"][0]["text"] = "<|image_pad|> is written by the user"
    with pytest.raises(openai.BadRequestError, match="the prompt holds 2 image placeholders but 1 images"):
        c.chat.completions.create(model="tiny", messages=one, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"210 x 200 = 42000 pixels, over the limit of 40000 pixels per "
                                                     r"image \(--max-image-pixels\)"):
        c.chat.completions.create(model="tiny", messages=messages([small, data_url(Image.new("RGB", (210, 200)))]),
                                  max_tokens=2)
    with pytest.raises(ParamError) as e:  # checked against the model by the front end, the core process's too
        server.async_engine.prompt_images([1, 2, 3], torch.zeros(4, 8), torch.tensor([[1, 2, 2]]))
    assert e.value.param == "images" and str(e.value) == "the prompt holds 0 image tokens but its images make 1"
    assert submitted == []


def test_generate_stage_with_an_image_equals_transformers(vl_model, tmp_path, capsys, one_thread):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf_dir, hf_model = vl_model
    image = draw_images()[0]
    image.save(tmp_path / "a.png")
    pixels = Qwen2VLImageProcessorPil.from_pretrained(hf_dir)(image, return_tensors="pt")
    count = int(pixels["image_grid_thw"].prod()) // 4
    text = "Look: <|vision_start|>" + "<|image_pad|>" * count + "<|vision_end|> what is it?"
    ids = AutoTokenizer.from_pretrained(hf_dir)(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(
        ids == CHAT_IDS[0]).int(), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=1, **pixels)
    want = AutoTokenizer.from_pretrained(hf_dir).decode(out[0, ids.shape[1]:])
    capsys.readouterr()
    args = ["generate", str(hf_dir.parent / "ckpt"), "--prompt", "Look: <image> what is it?", "--max-new-tokens", "6",
            "--json"]
    assert main([*args, "--image", str(tmp_path / "a.png")]) == 0
    assert json.loads(capsys.readouterr().out)[0]["completion"] == want
    assert main([*args, "--image", str(tmp_path / "gone.png")]) != 0
    assert f"--image {tmp_path / 'gone.png'}: image file" in " ".join(capsys.readouterr().err.split())
