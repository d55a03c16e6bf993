"""The engine with one image per request against text-only requests of the same prompt length, one run:

    PYTHONPATH=. .venv/bin/python tools/bench_vision.py [--requests 8] [--size 224] [--max-tokens 32]

``qwen2.5-vl-tiny`` with random weights (fp32, CPU): ``--requests`` prompts of 16 text tokens around one
``--size`` x ``--size`` image (drawn here, cut into patches by transformers' image processor; 224 pixels: 16 x 16
patches, 64 image tokens), each image different, against as many prompts of random text tokens as long; every request
decodes ``--max-tokens`` tokens greedily in one continuous batch. Prints the wall time, the generated tokens per
second of each and their ratio (the baseline: text only), and the vision tower's share (its time on the same images
alone). Timings on a shared machine vary from run to run; the ratio is what to read.
"""

from __future__ import annotations

import argparse
import time

import torch

IMAGE_TOKEN = 500


def images(n: int, size: int) -> list[dict]:
    from PIL import Image, ImageDraw
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil()
    out = []
    for i in range(n):
        image = Image.new("RGB", (size, size), (20 * i % 255, 120, 200))
        ImageDraw.Draw(image).ellipse((size // 8, size // 6, size - size // 5, size - 10 - i), fill=(220, 40, 9 * i))
        p = processor(image, return_tensors="pt")
        out.append({"pixel_values": p["pixel_values"], "image_grid_thw": p["image_grid_thw"]})
    return out


def timed(engine, prompts, params, per_prompt) -> tuple[float, int]:
    started = time.perf_counter()
    outs = engine.generate(prompts, params, images=per_prompt)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    from megapipe.config import ModelConfig, from_dict
    from megapipe.inference import LLMEngine, SamplingParams
    from megapipe.inference.engine import EngineConfig
    from megapipe.models import build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    cfg = from_dict(ModelConfig, {"preset": "qwen2.5-vl-tiny", "vocab_size": 512, "image_token_id": IMAGE_TOKEN})
    model = build_model(cfg, seed=0).eval()
    engine = LLMEngine(model, None, EngineConfig(max_model_len=1024), eos_token_ids=[])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    pics = images(args.requests, args.size)
    gen = torch.Generator().manual_seed(0)
    with_images, text_only = [], []
    for pic in pics:
        n_image = int(pic["image_grid_thw"].prod()) // cfg.vision_spatial_merge_size ** 2
        text = torch.randint(0, IMAGE_TOKEN, (16,), generator=gen).tolist()
        with_images.append(text[:8] + [IMAGE_TOKEN] * n_image + text[8:])
        text_only.append(torch.randint(0, IMAGE_TOKEN, (16 + n_image,), generator=gen).tolist())
    timed(engine, text_only[:1], params, None)  # warm-up
    base_s, base_tokens = timed(engine, text_only, params, None)
    image_s, image_tokens = timed(engine, with_images, params, pics)
    with torch.inference_mode():
        started = time.perf_counter()
        for pic in pics:
            model.visual(pic["pixel_values"], pic["image_grid_thw"])
        tower_s = time.perf_counter() - started
    print(f"{args.requests} requests, prompts of {len(with_images[0])} tokens ({len(with_images[0]) - 16} of them one "
          f"{args.size}x{args.size} image), {args.max_tokens} generated each, {torch.get_num_threads()} threads")
    print(f"text only (baseline): {base_s:.2f} s, {base_tokens / base_s:,.1f} tokens/s")
    print(f"one image each:       {image_s:.2f} s, {image_tokens / image_s:,.1f} tokens/s "
          f"({image_tokens / image_s / (base_tokens / base_s):.2f}x the baseline; the vision tower alone "
          f"{tower_s:.2f} s, {tower_s / image_s:.0%} of the run)")


if __name__ == "__main__":
    main()
