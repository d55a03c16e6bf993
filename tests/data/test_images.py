"""megapipe.data.images: the image processor gives transformers' Qwen2-VL PIL image processor's pixels and grids
exactly (modes with alpha, grey, palette; images scaled up, down and kept; its settings read from its saved
preprocessor_config.json), and images that cannot be used are refused in one sentence."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from PIL import Image

from megapipe.data.images import ImageError, ImageLimits, ImageProcessor, expand_image_tokens, open_image

transformers = pytest.importorskip("transformers")


def images():
    rng = np.random.default_rng(0)
    out = [Image.fromarray(rng.integers(0, 256, (h, w, c), dtype=np.uint8).squeeze())
           for h, w, c in [(37, 91, 3), (300, 200, 4), (20, 20, 1), (900, 700, 3), (56, 84, 3)]]
    return out + [Image.fromarray(rng.integers(0, 256, (50, 60), dtype=np.uint8)).convert("P")]


@pytest.mark.parametrize("settings", [{}, {"min_pixels": 100 * 28 * 28, "max_pixels": 300 * 28 * 28,
                                           "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.4]}],
                         ids=["default", "custom"])
def test_pixels_equal_transformers(settings, tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    reference = Qwen2VLImageProcessorPil(**settings)
    reference.save_pretrained(tmp_path)
    ours = ImageProcessor.from_dir(tmp_path)
    for image in images():
        want = reference(image, return_tensors="pt")
        pixels, grid = ours([image])
        assert torch.equal(pixels, want["pixel_values"]) and torch.equal(grid, want["image_grid_thw"])
    want = reference(images()[:2], return_tensors="pt")
    pixels, grids = ours(images()[:2])
    assert torch.equal(pixels, want["pixel_values"]) and torch.equal(grids, want["image_grid_thw"])
    assert [ours.token_count(g) for g in grids] == [int(g.prod()) // 4 for g in want["image_grid_thw"]]


def test_sources_and_limits(tmp_path):
    image = Image.new("RGB", (30, 20), (10, 20, 30))
    image.save(tmp_path / "a.png")
    url = "data:image/png;base64," + base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    assert np.array_equal(np.asarray(open_image(url)), np.asarray(image))
    assert open_image("a.png", allow_files=True, base=tmp_path).size == (30, 20)
    with pytest.raises(ImageError, match=r"image URL 'a.png' is not a data: URL"):
        open_image("a.png")
    with pytest.raises(ImageError, match=r"image file '.*missing.png' does not exist"):
        open_image("missing.png", allow_files=True, base=tmp_path)
    with pytest.raises(ImageError, match="remote image URLs are not fetched"):
        open_image("http://example.com/a.png", allow_files=True)
    with pytest.raises(ImageError, match="30 x 20 = 600 pixels, over the limit of 599 pixels per image"):
        open_image(url, ImageLimits(max_pixels=599))
    size = (tmp_path / "a.png").stat().st_size
    with pytest.raises(ImageError, match=f"is {size} bytes, over the limit of {size - 1} bytes per image"):
        open_image("a.png", ImageLimits(max_bytes=size - 1), allow_files=True, base=tmp_path)
    (tmp_path / "bad.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ImageError, match="could not be decoded"):
        open_image(str(tmp_path / "bad.png"), allow_files=True)
    assert expand_image_tokens([7, 9, 8, 9], 9, [2, 3]) == [7, 9, 9, 8, 9, 9, 9]
    with pytest.raises(ImageError, match="the prompt holds 2 image placeholders but 1 images were given"):
        expand_image_tokens([7, 9, 8, 9], 9, [2])
