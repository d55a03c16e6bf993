"""``megapipe preprocess``: text corpora -> Megatron ``PREFIX_{key}_document.bin/.idx`` (Megatron's flag names)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from stages.common import print_table


def preprocess(
    input: List[str] = typer.Option(..., "--input", help="JSONL (.jsonl/.json, also .gz), parquet, or what Hugging "
                                    "Face datasets loads from a local path (save_to_disk directory, csv, tsv, txt); a "
                                    "name that is not a local path is loaded from the hub (online). Files or globs; "
                                    "several may follow one --input."),
    output_prefix: str = typer.Option(..., "--output-prefix", help="Writes PREFIX_{key}_document.bin/.idx (Megatron "
                                      "MMIDIDX) for each --json-keys key."),
    tokenizer: str = typer.Option(..., "--tokenizer", help="Hugging Face tokenizer directory or tokenizer.json file."),
    json_keys: List[str] = typer.Option(["text"], "--json-keys", help="Keys (columns) to tokenize, one output each; "
                                        "several may follow one --json-keys."),
    append_eod: bool = typer.Option(False, "--append-eod", help="End each document with the tokenizer's "
                                    "end-of-document token."),
    workers: int = typer.Option(1, "--workers", help="Worker processes that parse and tokenize (the output is the "
                                "same for any count)."),
    skip_bad_records: bool = typer.Option(False, "--skip-bad-records", help="Skip malformed records (bad JSON, "
                                          "missing key, non-string value, invalid UTF-8) and count them in the "
                                          "summary, instead of stopping at the first."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no summary table."),
) -> None:
    """Tokenize text into Megatron .bin/.idx datasets (byte-compatible with megatron-core; uint16 tokens when the
    vocabulary has fewer than 65,500 ids, else int32). A failed or interrupted run leaves no output."""
    # lazy: imports numpy; megapipe --help stays fast
    from megapipe.data.preprocess import preprocess as run
    from megapipe.data.preprocess import summary_rows
    from megapipe.data.tokenizer import load_tokenizer

    stats = run(input, output_prefix, load_tokenizer(tokenizer), json_keys=json_keys, append_eod=append_eod,
                workers=workers, skip_bad_records=skip_bad_records, quiet=quiet)
    if not quiet:
        rows = summary_rows(stats)
        rows += [("skipped, e.g.", ex) for ex in stats.skipped_examples]
        print_table("preprocess summary", rows)


def first_dataset(path: Path, options: dict) -> str:
    """What a pipeline step's ``${step.output}`` is: preprocess writes PREFIX_{key}_document.bin/.idx per
    --json-keys key; downstream gets the first one."""
    keys = options.get("json_keys") or ["text"]
    key = keys[0] if isinstance(keys, list) else keys
    return f"{path}_{key}_document"
