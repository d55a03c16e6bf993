"""``megapipe preprocess``: text corpora -> Megatron ``PREFIX_{key}_document.bin/.idx`` (Megatron's flag names)."""

from __future__ import annotations

from typing import List

import typer

from stages.common import multi_value_command, print_table

ORDER = 10


def preprocess(
    input: List[str] = typer.Option(..., "--input", help="JSONL (.gz), parquet, csv or saved-dataset paths or globs; "
                                    "several may follow one --input."),
    output_prefix: str = typer.Option(..., "--output-prefix", help="Writes PREFIX_{key}_document.bin/.idx."),
    tokenizer: str = typer.Option(..., "--tokenizer", help="Hugging Face tokenizer directory or tokenizer.json."),
    json_keys: List[str] = typer.Option(["text"], "--json-keys", help="Keys (columns) to tokenize, one output each."),
    append_eod: bool = typer.Option(False, "--append-eod", help="End each document with the end-of-document token."),
    workers: int = typer.Option(1, "--workers", help="Worker processes (parse + tokenize)."),
    skip_bad_records: bool = typer.Option(False, "--skip-bad-records", help="Skip malformed records, count them."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no summary."),
) -> None:
    """Tokenize text into Megatron .bin/.idx datasets (byte-compatible with megatron-core)."""
    from megapipe.data.preprocess import preprocess as run
    from megapipe.data.preprocess import summary_rows
    from megapipe.data.tokenizer import load_tokenizer

    stats = run(input, output_prefix, load_tokenizer(tokenizer), json_keys=json_keys, append_eod=append_eod,
                workers=workers, skip_bad_records=skip_bad_records, quiet=quiet)
    if not quiet:
        rows = summary_rows(stats)
        rows += [("skipped, e.g.", ex) for ex in stats.skipped_examples]
        print_table("preprocess summary", rows)


def register(app: typer.Typer) -> None:
    app.command("preprocess", cls=multi_value_command("--input", "--json-keys"))(preprocess)
