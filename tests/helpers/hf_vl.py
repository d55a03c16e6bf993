"""A tiny random Qwen2.5-VL saved as a real model directory (config.json, safetensors, tokenizer, the image
processor's preprocessor_config.json), and text + image inputs made by transformers' own image processor from
images drawn here (tests/models/test_vision.py, tests/checkpoint/test_hf_qwen2_5_vl.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.hf_tiny import VOCAB, save_tokenizer

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 300, 301, 302, 303
# head dim 16: M-RoPE sections of 8 frequencies; a 56-pixel window is 2 x 2 merged patches (so a 4 x 3 grid has
# windows cut short by its edge); block 1 attends over the whole image
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
              fullatt_block_indexes=[1], window_size=56, initializer_range=0.1)
SIZES = [(112, 84), (56, 56)]  # (height, width) of the images drawn: 4 x 3 and 2 x 2 merged patches


def hf_vl_config(**changes):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config=dict(TEXT), vision_config=dict(VISION), image_token_id=IMAGE_TOKEN,
                            video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                            vision_end_token_id=VISION_END, tie_word_embeddings=False, **changes)


def make_vl_dir(root: Path, seed: int = 0):
    """A random Qwen2_5_VLForConditionalGeneration (random biases and norms too) + tokenizer + image processor."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(hf_vl_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(root)
    save_tokenizer(root)
    Qwen2VLImageProcessorPil().save_pretrained(root)
    return root, model


def draw_images():
    """Coloured shapes on a background, one image per SIZES."""
    from PIL import Image, ImageDraw

    images = []
    for i, (h, w) in enumerate(SIZES):
        image = Image.new("RGB", (w, h), (30 + 60 * i, 120, 200 - 50 * i))
        draw = ImageDraw.Draw(image)
        draw.ellipse((w // 5, h // 6, w - w // 4, h - h // 5), fill=(220, 40 + 100 * i, 60))
        draw.rectangle((2, 2, w // 3, h // 4), fill=(10, 200, 90))
        images.append(image)
    return images


def vl_inputs(hf_dir: Path) -> dict:
    """Two rows, each text around one image (its placeholder tokens between vision start / end), the pixels and
    grids from transformers' image processor saved in ``hf_dir``: tokens [2, S], pixel_values, image_grid_thw."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(hf_dir)
    out = processor(draw_images(), return_tensors="pt")
    grids = out["image_grid_thw"]
    counts = [int(g.prod()) // 4 for g in grids]
    length = 7 + max(counts) + 6
    gen = torch.Generator().manual_seed(3)
    rows = []
    for count in counts:
        before = torch.randint(0, 290, (7,), generator=gen).tolist()
        after = torch.randint(0, 290, (length - 7 - count - 2,), generator=gen).tolist()
        rows.append(before + [VISION_START] + [IMAGE_TOKEN] * count + [VISION_END] + after)
    return {"tokens": torch.tensor(rows), "pixel_values": out["pixel_values"], "image_grid_thw": grids}


def hf_logits(model, inputs: dict) -> torch.Tensor:
    tokens = inputs["tokens"]
    with torch.no_grad():
        return model(input_ids=tokens, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=(tokens == IMAGE_TOKEN).int()).logits
