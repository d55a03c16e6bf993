"""The ``megapipe`` command: a typer root that gathers one sub-command per module of ``stages/``.

Each stage module defines ``register(app)`` and an ``ORDER`` for ``--help``; importing them must stay cheap
(heavy libraries are imported inside the command functions), so ``megapipe --help`` is instant.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import typer

from megapipe import __version__
from megapipe.errors import MegapipeError

app = typer.Typer(
    name="megapipe",
    help="Train and ship language models: preprocess -> pretrain -> post-train -> export -> serve.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"megapipe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """megapipe: raw JSONL to a served model; every stage shares one checkpoint format."""


def _register_stages() -> None:
    import stages

    modules = [importlib.import_module(f"stages.{m.name}") for m in pkgutil.iter_modules(stages.__path__)]
    for mod in sorted(modules, key=lambda m: getattr(m, "ORDER", 100)):
        if hasattr(mod, "register"):
            mod.register(app)


_register_stages()


def main(argv: list[str] | None = None) -> int:
    """Entry point: user mistakes become one red sentence on stderr and a non-zero exit, never a traceback."""
    try:
        app(args=argv, prog_name="megapipe")
    except SystemExit as e:  # click's standalone mode: usage errors (exit 2), --help, Ctrl-C (130), completion
        if e.code == 130:
            print("megapipe: interrupted", file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except MegapipeError as e:
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
