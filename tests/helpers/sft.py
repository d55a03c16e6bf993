"""Helpers of the SFT / distillation / pruning tests: a small tokenizer with ChatML's special tokens."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "fixtures"
CHAT_SET = FIXTURES / "chat_answer_format.jsonl"
CHAT_SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def chat_texts(path: Path = CHAT_SET) -> list[str]:
    """Every message text of a chat JSONL (what the tokenizer is trained on)."""
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for m in record.get("messages", []) + record.get("prompt", []) + record.get("completion", []):
            out.append(m["content"])
    return out


def train_chat_tokenizer(out: Path, vocab_size: int = 384, extra_texts: list[str] = ()) -> Path:
    """A byte-level BPE with <|endoftext|>=0, <|pad|>=1, <|im_start|>=2, <|im_end|>=3 and no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*chat_texts(), *extra_texts], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
