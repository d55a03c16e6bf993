"""``megapipe preprocess``: text corpora -> Megatron ``PREFIX_{key}_document.bin/.idx`` (Megatron's flag names)."""

from __future__ import annotations

from typing import List

import typer
from typer.core import TyperCommand

ORDER = 10


def spread_multi_values(args: list[str], names: set[str]) -> list[str]:
    """``--input a b --json-keys x y`` -> ``--input a --input b --json-keys x --json-keys y`` (argparse's
    ``nargs='+'``, which click lacks): values after a multi-value option up to the next option belong to it."""
    out: list[str] = []
    current = None  # the multi-value option being filled
    needs_value = False  # an option that takes a value just came; the next argument is its value
    for arg in args:
        if arg == "--":
            current, needs_value = None, False
            out.append(arg)
        elif arg.startswith("--"):
            name, eq, _ = arg.partition("=")
            current = name if name in names else None
            needs_value = current is not None and not eq
            out.append(arg)
        elif needs_value:
            out.append(arg)
            needs_value = False
        elif current is not None:
            out += [current, arg]
        else:
            out.append(arg)
    return out


def multi_value_command(*names: str) -> type[TyperCommand]:
    """A command class whose options ``names`` take several values after one flag, Megatron style."""

    class MultiValueCommand(TyperCommand):
        def parse_args(self, ctx, args):
            return super().parse_args(ctx, spread_multi_values(list(args), set(names)))

    return MultiValueCommand


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


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
