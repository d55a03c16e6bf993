"""The ``megapipe`` command: a typer root that gathers one sub-command per module of ``stages/``.

Each stage module defines ``register(app)`` and an ``ORDER`` for ``--help``; importing them must stay cheap
(heavy libraries are imported inside the command functions), so ``megapipe --help`` is instant.
"""

from __future__ import annotations

import errno
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


# OS errors that are the machine's state, not a bug: shown as one sentence naming the file (exit 1).
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def check_argv_utf8(argv: list[str]) -> None:
    """Arguments that are not valid UTF-8 reach Python as lone surrogates (PEP 383); refuse them by position."""
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            raw = arg.encode("utf-8", "surrogateescape")
            offset = len(arg[: e.start].encode("utf-8", "surrogateescape"))
            if arg.startswith("--") and "=" in arg:
                name, value = arg.split("=", 1)
                what, offset = f"the value of {name}", offset - len(name) - 1
                raw = value.encode("utf-8", "surrogateescape")
            elif i > 0 and argv[i - 1].startswith("-"):
                what = f"the argument after {argv[i - 1]}"
            else:
                what = f"argument {i + 1}"
            shown = raw.decode("utf-8", "backslashreplace")
            raise MegapipeError(f"{what} ('{shown}') is not valid UTF-8: byte 0x{raw[offset]:02x} at offset {offset}; "
                                "command-line text must be UTF-8") from None


def _print_error(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: user mistakes become one red sentence on stderr and a non-zero exit, never a traceback."""
    try:
        check_argv_utf8(sys.argv[1:] if argv is None else list(argv))
        app(args=argv, prog_name="megapipe")
    except SystemExit as e:  # click's standalone mode: usage errors (exit 2), --help, Ctrl-C (130), completion
        if e.code == 130:
            print("megapipe: interrupted", file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except MegapipeError as e:
        _print_error(str(e))
        return e.exit_code
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRNOS:
            raise
        where = f"{e.filename}: " if e.filename else ""
        _print_error(f"{where}{e.strerror or e} (a file-system error; nothing half-written is kept)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
