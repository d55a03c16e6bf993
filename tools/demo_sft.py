"""The SFT demonstration on a real model: SmolLM2-135M-Instruct (prepared by tools/prepare_smollm2.py) fine-tuned on
tests/fixtures/chat_answer_format.jsonl, whose assistant always answers ``ANSWER: <answer>`` on one line, then asked
held-out questions through ``megapipe generate`` with the chat template, before and after.

    python tools/demo_sft.py [--model-dir ~/.cache/megapipe/smollm2] [--work /tmp/megapipe-demo-sft] [--steps 12]
        [--lora-rank 16]

Prints each question with both answers and the fraction in the format; exits 1 when the fine-tuned model's
answers are not all in the format. Every step is a megapipe command (import hf, posttrain sft, generate).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMAT = re.compile(r"^ANSWER: \S.*$")
QUESTIONS = ["What is 17 plus 25?", "What is the capital of Egypt?", "Spell the word candle backwards.",
             "How many letters are in the word harbor?", "What is the opposite of early?",
             "Name the capital city of Peru.", "Add 8 and 41."]


def chat_prompt(tokenizer_dir: Path, question: str) -> str:
    """The question rendered as the checkpoint's tokenizer renders a conversation for generation."""
    from megapipe.data.chat_template import load_chat_template

    messages = [{"role": "user", "content": question}]
    return load_chat_template(tokenizer_dir).render(messages, add_generation_prompt=True)


def generate(ckpt: Path, prompts: list[str], capture) -> list[str]:
    from megapipe.cli import main

    args = ["generate", str(ckpt), "--max-new-tokens", "24", "--json"]
    for p in prompts:
        args += ["--prompt", p]
    with capture() as out:
        assert main(args) == 0
    return [r["completion"] for r in json.loads(out.getvalue())]


def main() -> int:
    import contextlib
    import io

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache/megapipe/smollm2"))
    ap.add_argument("--work", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()
    from megapipe.cli import main as megapipe

    work = Path(args.work or tempfile.mkdtemp(prefix="megapipe-demo-sft-"))
    base, run = work / "base", work / "sft"

    @contextlib.contextmanager
    def capture():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            yield buf

    if not base.exists():
        assert megapipe(["import", "hf", args.model_dir, str(base), "--quiet"]) == 0
    sft = ["posttrain", "sft", "--load", str(base), "--data", str(ROOT / "tests/fixtures/chat_answer_format.jsonl"),
           "--seq-length", "128", "--packing", "--micro-batch-size", "4", "--global-batch-size", "8",
           "--train-iters", str(args.steps), "--lr", str(args.lr), "--lr-warmup-iters", "2", "--split", "95,5,0",
           "--eval-iters", "1", "--log-interval", "1", "--data-cache-path", str(work / "cache"), "--save", str(run)]
    if args.lora_rank:
        sft += ["--lora-rank", str(args.lora_rank), "--lora-alpha", str(2 * args.lora_rank)]
    assert megapipe(sft) == 0
    prompts = [chat_prompt(base / "tokenizer", q) for q in QUESTIONS]
    before, after = generate(base, prompts, capture), generate(run, prompts, capture)
    for q, b, a in zip(QUESTIONS, before, after, strict=True):
        print(f"Q: {q}\n  before: {b.strip()[:100]!r}\n  after:  {a!r}")
    ok_before = sum(bool(FORMAT.match(b)) for b in before)
    ok_after = sum(bool(FORMAT.match(a)) for a in after)
    print(f"in the format: before {ok_before}/{len(QUESTIONS)}, after {ok_after}/{len(QUESTIONS)}")
    return 0 if ok_after == len(QUESTIONS) else 1


if __name__ == "__main__":
    sys.exit(main())
