"""Images for a vision-language model (megapipe.models.vision): decoded from a ``data:`` URL or a local file within
limits on bytes and pixels, and turned into the vision tower's input as Qwen2-VL's image processor does with Pillow
(its ``preprocessor_config.json`` travels in the checkpoint's tokenizer directory): converted to RGB over white,
resized to a multiple of patch x merge pixels within [min_pixels, max_pixels] keeping the aspect ratio, rescaled,
normalized and cut into flattened patches (repeated over the temporal patch), merge x merge neighbours in a row.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from megapipe.errors import DataError

MiB = 1 << 20
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(DataError):
    """An image that cannot be used: unreadable, too large, remote."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * MiB  # an image's encoded size
    max_pixels: int = 4096 * 4096  # an image's width x height as decoded (before the processor resizes it)
    flags: tuple = ("", "")  # the options that set the two, named in a refusal

    def over(self, which: int, what: str) -> str:
        limit = (f"{self.max_bytes} bytes", f"{self.max_pixels} pixels")[which]
        flag = f" ({self.flags[which]})" if self.flags[which] else ""
        return f"{what}, over the limit of {limit} per image{flag}"


def open_image(source: str, limits: ImageLimits = ImageLimits(), allow_files: bool = False,
               base: Optional[Path] = None):
    """The RGB-convertible PIL image at ``source``: a ``data:`` URL (base64), or with ``allow_files`` a local path
    (relative to ``base``) or ``file://`` URL. Remote URLs are refused: nothing is fetched."""
    from PIL import Image

    if source.startswith(("http://", "https://")):
        raise ImageError(f"remote image URLs are not fetched ({source[:60]!r}): send the image inline as a data: URL")
    if source.startswith("data:"):
        data, what = _data_url_bytes(source, limits), f"data URL {source[:40]!r}..."
    elif allow_files:
        path = Path(source[len("file://"):] if source.startswith("file://") else source).expanduser()
        path = path if path.is_absolute() or base is None else base / path
        if not path.is_file():
            raise ImageError(f"image file {str(path)!r} does not exist")
        if path.stat().st_size > limits.max_bytes:
            raise ImageError(limits.over(0, f"image file {str(path)!r} is {path.stat().st_size} bytes"))
        data, what = path.read_bytes(), f"image file {str(path)!r}"
    else:
        raise ImageError(f"image URL {source[:60]!r} is not a data: URL (data:image/png;base64,...)")
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as e:  # Pillow raises several kinds for data it cannot read
        raise ImageError(_undecodable(what, e)) from None
    width, height = image.size
    if width * height > limits.max_pixels:  # checked from the header, before the pixels are decoded
        raise ImageError(limits.over(1, f"the image is {width} x {height} = {width * height} pixels"))
    try:
        image.load()
    except Exception as e:
        raise ImageError(_undecodable(what, e)) from None
    return image


def _undecodable(what: str, e: Exception) -> str:
    from PIL import UnidentifiedImageError

    # Pillow's own message names the in-memory buffer, not the image
    why = "not an image format Pillow reads" if isinstance(e, UnidentifiedImageError) else f"{type(e).__name__}: {e}"
    return f"{what} could not be decoded as an image ({why})"


def _data_url_bytes(url: str, limits: ImageLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ImageError(f"data URL {url[:40]!r}... is not base64 (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > limits.max_bytes + 2:
        raise ImageError(limits.over(0, f"the image is about {len(payload) * 3 // 4} bytes"))
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"data URL {url[:40]!r}... does not hold valid base64") from None
    if len(data) > limits.max_bytes:
        raise ImageError(limits.over(0, f"the image is {len(data)} bytes"))
    return data


def fitted_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width), multiples of ``factor`` nearest the image's, scaled into [min_pixels, max_pixels]."""
    if max(height, width) > 200 * min(height, width):
        raise ImageError(f"the image is {width} x {height}: its aspect ratio must be below 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor)
                                                                                 * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple = CLIP_MEAN
    image_std: tuple = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's bicubic
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_dir(cls, directory) -> "ImageProcessor":
        """From ``preprocessor_config.json`` in ``directory`` (a checkpoint's tokenizer dir); the defaults without."""
        file = Path(directory) / "preprocessor_config.json"
        if not file.is_file():
            return cls()
        cfg = json.loads(file.read_text())
        size = cfg.get("size") or {}
        known = {k: cfg[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample",
                                     "do_resize", "do_rescale", "do_normalize", "do_convert_rgb") if k in cfg}
        for key, alias in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = cfg.get(key, size.get(alias, size.get(key)))
            if value is not None:
                known[key] = int(value)
        for key in ("image_mean", "image_std"):
            if key in cfg:
                known[key] = tuple(cfg[key]) if isinstance(cfg[key], list) else (cfg[key],) * 3
        return cls(**known)

    def token_count(self, grid_thw: torch.Tensor) -> int:
        """Decoder tokens of an image of ``grid_thw`` (frames, height, width in patches)."""
        return int(grid_thw.prod()) // self.merge_size ** 2

    def __call__(self, images: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, C * T * P * P] float32, image_grid_thw [images, 3]) of PIL ``images``."""
        patches, grids = [], []
        for image in images:
            pixels, grid = self._one(image)
            patches.append(pixels)
            grids.append(grid)
        return torch.from_numpy(np.concatenate(patches)), torch.tensor(grids, dtype=torch.int64)

    def _one(self, image) -> tuple[np.ndarray, list[int]]:
        from PIL import Image

        if self.do_convert_rgb and image.mode != "RGB":
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
            image = image.convert("RGB")
        if self.do_resize:
            factor = self.patch_size * self.merge_size
            h, w = fitted_size(image.height, image.width, factor, self.min_pixels, self.max_pixels)
            image = image.resize((w, h), resample=self.resample)
        array = np.asarray(image)
        array = (array[..., None] if array.ndim == 2 else array).transpose(2, 0, 1)  # [C, H, W]
        if self.do_rescale:
            array = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            array = array.astype(np.float32)
        if self.do_normalize:
            mean, std = np.array(self.image_mean, np.float32), np.array(self.image_std, np.float32)
            array = ((array.T - mean) / std).T
        return self._patches(array)

    def _patches(self, array: np.ndarray) -> tuple[np.ndarray, list[int]]:
        c, h, w = array.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = array.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # the image repeated over time
        return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p)), [1, gh, gw]


def image_markers(model_cfg, tokenizer) -> Optional[str]:
    """The text of one image in a prompt of a vision-language model (vision start, image token, vision end, as
    Qwen2-VL's chat template writes an image part); None for a model that takes text only."""
    if model_cfg is None or not model_cfg.vision_depth or model_cfg.image_token_id is None or tokenizer is None:
        return None
    marks = [model_cfg.vision_start_token_id, model_cfg.image_token_id, model_cfg.vision_end_token_id]
    return tokenizer.decode([t for t in marks if t is not None])


def placeholder_repeats(ids, image_token_id: int, counts: Sequence[int]) -> np.ndarray:
    """How many times each token of ``ids`` stands in the expanded prompt: its i-th image token ``counts[i]`` times
    (a rendered prompt holds one per image), every other token once."""
    ids = np.asarray(ids)
    slots = ids == image_token_id
    if int(slots.sum()) != len(counts):
        raise ImageError(f"the prompt holds {int(slots.sum())} image placeholders but {len(counts)} images were given")
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[slots] = counts
    return repeats


def expand_image_tokens(ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> list[int]:
    """``ids`` with its i-th image token repeated ``counts[i]`` times."""
    return np.repeat(np.asarray(ids, dtype=np.int64), placeholder_repeats(ids, image_token_id, counts)).tolist()


IMAGE_PLACEHOLDER = "<image>"  # where a plain-text prompt puts an image (lm-eval's and `generate --image`'s mark)


def prompt_with_images(text: str, images: Sequence, markers: str, tokenizer, processor: ImageProcessor,
                       image_token_id: int) -> tuple[list[int], dict]:
    """The tokens of plain-text ``text`` whose i-th ``<image>`` stands for PIL image i (images without a placeholder
    go before the text), each image's placeholder repeated for its patches, and the images as the engine takes them
    (``pixel_values``, ``image_grid_thw``)."""
    missing = len(images) - text.count(IMAGE_PLACEHOLDER)
    if missing < 0:
        raise ImageError(f"the prompt holds {text.count(IMAGE_PLACEHOLDER)} {IMAGE_PLACEHOLDER} marks but "
                         f"{len(images)} images were given")
    text = (IMAGE_PLACEHOLDER * missing + text).replace(IMAGE_PLACEHOLDER, markers)
    pixels, grids = processor(images)
    ids = expand_image_tokens(tokenizer.encode(text), image_token_id, [processor.token_count(g) for g in grids])
    return ids, {"pixel_values": pixels, "image_grid_thw": grids}
