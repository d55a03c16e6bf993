"""Image SFT on rendered shapes: held-out accuracy of naming an image's colour and shape before and after SFT of a
tiny random Qwen2.5-VL, one run:

    PYTHONPATH=. .venv/bin/python tools/shapes_vl.py [--train 480] [--test 96] [--iters 300] [--work DIR]

The image set is drawn by megapipe.data.shapes (Pillow, seeded): a circle, square or triangle in red, green, blue or
yellow, of random size and place, on a noisy grey 84 x 84 background (36 patches, 9 image tokens).
The model: a random Qwen2_5_VLForConditionalGeneration (2 decoder layers of 64, a 2-block vision tower) with a
byte-level BPE that knows Qwen2-VL's image markers, imported with ``megapipe import hf``. Training records are
``{"messages": [user: question + image_url (a file path), assistant: "<colour> <shape>"]}``, trained with
``megapipe posttrain sft``; the held-out images are answered greedily by the engine (prompts rendered with the chat
template, images cut into patches by megapipe.data.images as the server does). Prints the accuracy of the colour, the
shape and both, before and after.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # token ids 2..5
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def make_set(directory: Path, n: int, seed: int) -> list[tuple[Path, str]]:
    """``n`` images of megapipe.data.shapes written to ``directory``, each with its answer "<colour> <shape>"."""
    from megapipe.data.shapes import shape_set

    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (image, colour, shape) in enumerate(shape_set(n, seed)):
        path = directory / f"{i:04d}.png"
        image.save(path)
        out.append((path, f"{colour} {shape}"))
    return out


def make_model(hf_dir: Path, text: dict | None = None, vision: dict | None = None) -> None:
    """A random Qwen2.5-VL with a byte-level BPE knowing the image markers in ``hf_dir``; ``text`` / ``vision``
    change the decoder's / tower's HF config fields."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from megapipe.data.shapes import COLOURS, QUESTION, SHAPES
    from megapipe.data.tokenizer import train_tokenizer

    texts = [QUESTION, "assistant:", "user:"] + [f"{c} {s}" for c in COLOURS for s in SHAPES]
    train_tokenizer(texts * 50, vocab_size=320, output=hf_dir, special_tokens=MARKERS)
    config_file = hf_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config_file.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    text = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            **(text or {})}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "fullatt_block_indexes": [1], "window_size": 56, **(vision or {})}
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=4, video_token_id=5, vision_start_token_id=2,
        vision_end_token_id=3, tie_word_embeddings=False))
    model.save_pretrained(hf_dir)
    Qwen2VLImageProcessorPil().save_pretrained(hf_dir)


def accuracy(ckpt: Path, held_out: list[tuple[Path, str]]) -> dict:
    """Greedy answers of the engine to each held-out image: the fraction right on colour, shape and both."""
    from PIL import Image

    from megapipe.data.chat_template import load_chat_template
    from megapipe.data.images import ImageProcessor, expand_image_tokens
    from megapipe.data.shapes import QUESTION
    from megapipe.inference import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(ckpt, device="cpu")
    tok, cfg = engine.tokenizer, engine.runner.model.cfg
    processor = ImageProcessor.from_dir(tok.path)
    markers = tok.decode([cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id])
    text = load_chat_template(tok.path).render([{"role": "user", "content": QUESTION + markers}],
                                               add_generation_prompt=True)
    prompts, images = [], []
    for path, _ in held_out:
        pixels, grid = processor([Image.open(path)])
        prompts.append(expand_image_tokens(tok.encode(text), cfg.image_token_id, [processor.token_count(grid[0])]))
        images.append({"pixel_values": pixels, "image_grid_thw": grid})
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), images=images)
    answers = [o.outputs[0].text.strip().split("\n")[0].strip().split() for o in outs]
    right = [(a[:1] == w.split()[:1], a[1:2] == w.split()[1:], a == w.split())
             for a, (_, w) in zip(answers, held_out, strict=True)]
    n = len(right)
    return {"colour": sum(r[0] for r in right) / n, "shape": sum(r[1] for r in right) / n,
            "both": sum(r[2] for r in right) / n, "example": " ".join(answers[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=int, default=480)
    ap.add_argument("--test", type=int, default=96)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()

    from megapipe.cli import main as cli
    from megapipe.data.shapes import QUESTION

    work = Path(args.work or tempfile.mkdtemp(prefix="shapes_vl_"))
    train, test = make_set(work / "train", args.train, 0), make_set(work / "test", args.test, 1)
    with open(work / "train.jsonl", "w") as f:
        for path, answer in train:
            f.write(json.dumps({"messages": [
                {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                             {"type": "image_url", "image_url": {"url": str(path.relative_to(work))}}]},
                {"role": "assistant", "content": answer}]}) + "\n")
    make_model(work / "hf")
    assert cli(["import", "hf", str(work / "hf"), str(work / "base"), "--quiet"]) == 0
    before = accuracy(work / "base", test)
    assert cli(["posttrain", "sft", "--load", str(work / "base"), "--data", str(work / "train.jsonl"),
                "--seq-length", "64", "--micro-batch-size", str(args.batch), "--global-batch-size", str(args.batch),
                "--train-iters", str(args.iters), "--lr", str(args.lr), "--lr-warmup-iters", "10",
                "--eval-iters", "0", "--log-interval", "50", "--save", str(work / "sft"), "--quiet"]) == 0
    after = accuracy(work / "sft", test)
    print(json.dumps({"train_images": args.train, "held_out": args.test, "iters": args.iters, "batch": args.batch,
                      "before": before, "after": after}, indent=1))


if __name__ == "__main__":
    main()
