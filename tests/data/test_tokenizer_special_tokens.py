"""`tokenizer train --special-token`: extra special tokens (e.g. ChatML's) after end-of-document and padding."""

from __future__ import annotations

import json

from megapipe.cli import main


def test_special_tokens_get_the_next_ids_and_stay_whole(tmp_path, shakespeare_excerpt):
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(shakespeare_excerpt), "--vocab-size", "300", "--output", str(out),
                 "--special-token", "<|im_start|>", "--special-token", "<|im_end|>", "-q"]) == 0
    added = {t["content"]: t["id"] for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    assert added == {"<|endoftext|>": 0, "<|pad|>": 1, "<|im_start|>": 2, "<|im_end|>": 3}
    from megapipe.data.tokenizer import load_tokenizer

    tok = load_tokenizer(out)
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[:1] == [2] and tok.eod_id == 0


def test_a_repeated_special_token_is_refused(tmp_path, shakespeare_excerpt, capsys):
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(shakespeare_excerpt), "--vocab-size", "300", "--output", str(out),
                 "--special-token", "<|pad|>"]) != 0
    assert "--special-token '<|pad|>' is empty or given twice" in " ".join(capsys.readouterr().err.split())
    assert not out.exists()
