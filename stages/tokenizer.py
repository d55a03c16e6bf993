"""``megapipe tokenizer train``: a byte-level BPE written as a Hugging Face tokenizer directory."""

from __future__ import annotations

from typing import List

import typer

from megapipe.errors import DataError
from megapipe.fileio import refuse_overlap
from stages.common import print_table


def train(
    input: List[str] = typer.Option(..., "--input", help="Training text: JSONL (.gz), parquet, csv or saved-dataset "
                                    "paths or globs (the inputs preprocess takes); several may follow one --input."),
    vocab_size: int = typer.Option(..., "--vocab-size", help="Vocabulary size, special tokens included."),
    output: str = typer.Option(..., "--output", help="Directory to write tokenizer.json and its configs to."),
    json_key: str = typer.Option("text", "--json-key", help="Key (column) holding the text."),
    eod_token: str = typer.Option("<|endoftext|>", "--eod-token", help="End-of-document token (id 0)."),
    pad_token: str = typer.Option("<|pad|>", "--pad-token", help="Padding token (id 1)."),
    special_token: List[str] = typer.Option([], "--special-token", help="Another special token, e.g. ChatML's "
                                            "<|im_start|> and <|im_end|> (ids 2, 3, ... in order); repeatable."),
    skip_bad_records: bool = typer.Option(False, "--skip-bad-records", help="Leave out malformed records instead "
                                          "of stopping at the first."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing tokenizer directory at --output."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary table."),
) -> None:
    """Train a byte-level BPE (HF tokenizers) with end-of-document and padding tokens; writes a Hugging Face
    tokenizer directory that transformers.AutoTokenizer and every megapipe --tokenizer option load."""
    import time
    from pathlib import Path

    # lazy: imports numpy; megapipe --help stays fast
    from megapipe.data.readers import expand_inputs, iter_texts
    from megapipe.data.tokenizer import train_tokenizer

    start = time.perf_counter()
    paths = expand_inputs(input)
    refuse_overlap([output], [p for p in paths if p.exists()], DataError)
    out = Path(output)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DataError(f"--output {output} already holds files (a tokenizer?): pick another directory or pass "
                        "--overwrite")
    tok = train_tokenizer(iter_texts(paths, json_key, skip_bad_records), vocab_size, output, eod_token, pad_token,
                          source=f"--input {' '.join(input)}", special_tokens=tuple(special_token))
    if not quiet:
        print_table("tokenizer", [("output", str(output)), ("vocab size", f"{tok.vocab_size:,}"),
                                  ("eod / pad ids", f"{tok.eod_id} / {tok.pad_id}"),
                                  ("time", f"{time.perf_counter() - start:.1f} s")])
