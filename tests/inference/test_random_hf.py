"""tools/make_random_hf.py's tokenizer: every id of the model's vocabulary decodes to text (a random model emits any
id, and a served stream's first chunk is its first text), and what the trained merges encode is unchanged."""

from __future__ import annotations

from tokenizers import Tokenizer

from megapipe.data.tokenizer import train_tokenizer
from tools import make_random_hf as tool


def test_every_id_decodes_to_text(tmp_path):
    train_tokenizer(tool.TEXTS, vocab_size=512, output=tmp_path)
    path = tmp_path / "tokenizer.json"
    trained = Tokenizer.from_file(str(path))
    text = "The quick brown fox jumps over 12345 lazy dogs."
    assert sum(trained.decode([i]) == "" for i in range(1000)) > 500  # ids past the trained table: nothing
    tool.cover_vocab(path, 1000)
    covered = Tokenizer.from_file(str(path))
    assert covered.get_vocab_size() == 1000
    special = set(covered.get_added_tokens_decoder())
    assert special == {0, 1}  # <|endoftext|>, <|pad|>: skipped in decoding, as a real tokenizer's are
    assert all(covered.decode([i]) for i in range(2, 1000))
    assert covered.decode([999]) == " w999"
    assert covered.encode(text).ids == trained.encode(text).ids
