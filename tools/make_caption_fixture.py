"""Write pipelines/data/captions.jsonl: image-caption pairs for `megapipe posttrain projector` (LLaVA's stage 1),
each an SFT record whose user turn is one image (a PNG data: URL of megapipe.data.shapes) and whose assistant turn
is its caption. Deterministic (seeded; the PNG bytes are Pillow's):

    PYTHONPATH=. python tools/make_caption_fixture.py [OUT.jsonl] [--count N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megapipe.data.shapes import caption, png_data_url, shape_set


def records(count: int, seed: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(im)}}]},
                          {"role": "assistant", "content": caption(colour, shape)}]}
            for im, colour, shape in shape_set(count, seed, balanced=True)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default=str(Path(__file__).resolve().parents[1] / "pipelines/data/captions.jsonl"))
    ap.add_argument("--count", type=int, default=96)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args(argv)
    body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records(args.count, args.seed))
    Path(args.out).write_text(body, encoding="utf-8")
    print(f"{args.out}: {args.count} image-caption pairs")


if __name__ == "__main__":
    main()
