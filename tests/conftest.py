"""Fixtures shared across the test suite (keep this small)."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def shakespeare_excerpt() -> Path:
    """189 real documents: Shakespeare paragraphs (some with æ, &c.) and a few non-Latin ones, as JSONL."""
    return FIXTURES / "shakespeare_excerpt.jsonl"


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory, shakespeare_excerpt) -> Path:
    """A byte-level BPE (512 ids, <|endoftext|>=0, <|pad|>=1) trained on the excerpt: a Hugging Face directory."""
    from megapipe.data.readers import iter_texts
    from megapipe.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(iter_texts([shakespeare_excerpt], "text"), 512, out)
    return out
