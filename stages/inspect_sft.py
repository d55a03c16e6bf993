"""``megapipe data inspect-sft FILE --tokenizer T``: show SFT records as the model sees them, the trained tokens
highlighted, so the loss mask can be checked by eye."""

from __future__ import annotations

from typing import Optional

import typer

from megapipe.errors import DataError


def inspect_sft(
    file: str = typer.Argument(..., help="SFT records: JSONL (.gz), parquet or a saved Hugging Face dataset."),
    tokenizer: str = typer.Option(..., "--tokenizer", help="Tokenizer directory or tokenizer.json (or a checkpoint)."),
    chat_template: Optional[str] = typer.Option(
        None, "--chat-template", help="chatml, llama3, harmony, a template name of the tokenizer's or FILE.jinja "
                                      "(default: the tokenizer's own template)."),
    train_on_prompt: bool = typer.Option(False, "--train-on-prompt", help="Train on every token."),
    record: int = typer.Option(1, "--record", help="First record to show (1-based)."),
    count: int = typer.Option(1, "--count", help="How many records to show."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON: per record its segments and counts."),
) -> None:
    """Print records rendered with the chat template; trained tokens in bold green, the rest dim."""
    import json
    from pathlib import Path

    # lazy: imports numpy; megapipe --help stays fast
    from megapipe.data.sft import ChatEncoder, iter_records, parse_record

    if record < 1 or count < 1:
        raise DataError(f"--record {record} and --count {count} must be >= 1")
    tok = Path(tokenizer).expanduser()
    if (tok / "tokenizer").is_dir() and not (tok / "tokenizer.json").exists():
        tok = tok / "tokenizer"  # a checkpoint: its tokenizer
    path = Path(file).expanduser()
    if not path.exists():
        raise DataError(f"input file {file} does not exist")
    encoder = ChatEncoder(tok, chat_template, train_on_prompt)
    shown = []
    for n, (where, rec) in enumerate(iter_records(path), 1):
        if n < record:
            continue
        if len(shown) == count:
            break
        if isinstance(rec, DataError):
            raise rec
        text, ids, offsets, trained = encoder.encode_detailed(parse_record(rec, where))
        shown.append((where, segments(text, ids, offsets, trained, encoder), len(ids), int(trained[1:].sum())))
    if not shown:
        raise DataError(f"{file} has fewer than {record} records")
    if json_output:
        typer.echo(json.dumps([{"record": w, "tokens": n, "trained_tokens": t,
                                "segments": [{"text": s, "trained": tr} for s, tr in segs]}
                               for w, segs, n, t in shown], ensure_ascii=False))
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False)
    for where, segs, n, t in shown:
        console.print(f"[bold]── {where}: {n} tokens, {t} trained (bold green)[/]", soft_wrap=True)
        out = Text()
        for s, tr in segs:
            out.append(s, style="bold green" if tr else "dim")
        console.print(out)
    console.print(f"chat template: {encoder.template_name}")


def segments(text, ids, offsets, trained, encoder) -> list[tuple[str, bool]]:
    """The rendered text cut where the trained flag changes (a token without characters, the appended end of
    document, shows as its token string)."""
    out: list[tuple[str, bool]] = []
    pos = 0
    for i in range(len(ids)):
        lo, hi = int(offsets[i][0]), int(offsets[i][1])
        piece = text[max(lo, pos):hi] if hi > lo else encoder.hf.convert_ids_to_tokens(int(ids[i]))
        pos = max(pos, hi)
        flag = bool(trained[i]) and i > 0  # the first token is never a target
        if out and out[-1][1] == flag:
            out[-1] = (out[-1][0] + piece, flag)
        else:
            out.append((piece, flag))
    if pos < len(text) and out:
        out[-1] = (out[-1][0] + text[pos:], out[-1][1])
    return out
