"""Rendered shapes and colours: the small generated image set megapipe's vision-language demos, eval task and
caption data are made of (tools/shapes_vl.py, tools/make_eval_tasks.py, tools/make_caption_fixture.py).

An image is a circle, square or triangle in red, green, blue or yellow, of random size and place, on a noisy grey
background (84 x 84 pixels: 36 patches of 14, 9 image tokens after the 2 x 2 merge). Drawn with Pillow from a seeded
``random.Random``, so a seed always gives the same pixels.
"""

from __future__ import annotations

import base64
import io
import random

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What is in the picture?"
SIZE = 84


def draw(rng: random.Random, colour: str, shape: str):
    """One PIL image of a ``colour`` ``shape``; its size, place, shade and background noise drawn from ``rng``."""
    from PIL import Image, ImageDraw

    grey = rng.randint(90, 160)
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    pixels = image.load()
    for _ in range(300):  # noise
        pixels[rng.randrange(SIZE), rng.randrange(SIZE)] = tuple(grey + rng.randint(-40, 40) for _ in range(3))
    r = rng.randint(14, 30)
    cx, cy = rng.randint(r + 2, SIZE - r - 2), rng.randint(r + 2, SIZE - r - 2)
    fill = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in COLOURS[colour])
    d = ImageDraw.Draw(image)
    if shape == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def shape_set(n: int, seed: int, balanced: bool = False) -> list[tuple[object, str, str]]:
    """``n`` (image, colour, shape): each class drawn at random, or with ``balanced`` every (colour, shape) in turn."""
    rng = random.Random(seed)
    classes = [(c, s) for c in COLOURS for s in SHAPES]
    out = []
    for i in range(n):
        colour, shape = classes[i % len(classes)] if balanced else (rng.choice(list(COLOURS)), rng.choice(SHAPES))
        out.append((draw(rng, colour, shape), colour, shape))
    return out


def png_data_url(image) -> str:
    """The image as a ``data:image/png;base64,...`` URL (what chat requests and the bundled data carry)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def caption(colour: str, shape: str) -> str:
    """The caption of an image of the set (LLaVA's stage-1 pairs: an image and a short description)."""
    return f"A {colour} {shape} on a grey background."
