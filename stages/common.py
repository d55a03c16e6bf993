"""Helpers shared by the stage commands."""

from __future__ import annotations

from typing import Optional

import typer
from typer.core import TyperCommand

ORDER = 1000  # not a stage

CONFIG_OPTION = typer.Option(None, "--config", "-c", help="YAML config file (same fields as the flags).")
SET_OPTION = typer.Option(None, "--set", help="Dotted config override, repeatable: --set train.lr=3e-4.")


def build_config(config: Optional[str], flags: dict, sets: Optional[list[str]]):
    """YAML file, then the flags the user gave (dotted key -> value, None = not given), then --set overrides."""
    from megapipe.config import load_config, parse_override

    overrides = {k: v for k, v in flags.items() if v is not None}
    for item in sets or []:
        k, v = parse_override(item)
        overrides[k] = v
    return load_config(config, overrides)


def _is_option(arg: str) -> bool:
    """``--x``, ``-q``: an option; ``-``, ``-3``, ``-0.5``: a value."""
    return len(arg) > 1 and arg[0] == "-" and not arg[1].isdigit() and arg[1] != "."


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
        elif _is_option(arg):
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


GROUP_HELP = {
    "import": "Bring a model from another format into a megapipe checkpoint.",
    "export": "Write a megapipe checkpoint in another format.",
    "posttrain": "Post-train a checkpoint: sft, distill, prune, quantize, rl.",
}


def group(app: typer.Typer, name: str) -> typer.Typer:
    """The sub-command group ``name`` of ``app``, created on first use (so several stage modules can share it)."""
    for info in app.registered_groups:
        if info.name == name:
            return info.typer_instance
    sub = typer.Typer(help=GROUP_HELP.get(name), no_args_is_help=True)
    app.add_typer(sub, name=name)
    return sub
