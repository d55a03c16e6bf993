"""Helpers shared by the stage commands."""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, List, Optional

import typer
from typer.core import TyperCommand

from megapipe.config import flag_fields, load_config, parse_override
from megapipe.errors import ConfigError

CONFIG_OPTION = typer.Option(None, "--config", "-c", help="YAML config file (same fields as the flags).")
SET_OPTION = typer.Option(None, "--set", help="Dotted config override, repeatable: --set train.lr=3e-4.")
# speculative decoding, as generate and serve take it (EngineConfig's fields)
SPECULATIVE_TOKENS = typer.Option(0, "--speculative-tokens", "--num-speculative-tokens",
                                  help="Draft tokens per decode step (0 = off).")
SPECULATIVE_METHOD = typer.Option(None, "--speculative-method",
                                  help="mtp (the model's MTP modules; the default) or ngram (prompt lookup, any "
                                       "model); needs --num-speculative-tokens.")
PROMPT_LOOKUP_MAX = typer.Option(None, "--prompt-lookup-max", help="ngram: the longest suffix looked up [default: 4].")
PROMPT_LOOKUP_MIN = typer.Option(None, "--prompt-lookup-min", help="ngram: the shortest suffix looked up [default: 2].")


def speculative_fields(method: Optional[str], tokens: int, lookup_max: Optional[int],
                       lookup_min: Optional[int]) -> dict:
    """The speculative flags as EngineConfig's fields. A flag that would do nothing is refused: a method without
    draft tokens (vLLM refuses a speculative config without num_speculative_tokens too), a prompt-lookup bound
    without the ngram method."""
    if method is not None and not tokens:
        raise ConfigError(f"--speculative-method {method} needs --num-speculative-tokens N (the drafts per decode "
                          f"step, >= 1)")
    fields = {"speculative_method": method or "mtp"}
    for flag, value in (("--prompt-lookup-max", lookup_max), ("--prompt-lookup-min", lookup_min)):
        if value is None:
            continue
        if fields["speculative_method"] != "ngram" or not tokens:
            raise ConfigError(f"{flag} {value} applies to --speculative-method ngram only (here: "
                              f"{'no speculation' if not tokens else fields['speculative_method']})")
        fields[flag[2:].replace("-", "_")] = value
    return fields


def build_config(config: Optional[str], flags: dict, sets: Optional[list[str]]):
    """YAML file, then the flags the user gave (dotted key -> value, None = not given), then --set overrides."""
    overrides = {k: v for k, v in flags.items() if v is not None}
    for item in sets or []:
        k, v = parse_override(item)
        overrides[k] = v
    return load_config(config, overrides)


def _flag_option(key: str, f, tp) -> tuple[Any, Any]:
    """(annotation, typer.Option) for config field ``f`` (dotted ``key``, type ``tp``), grouped by section in --help."""
    meta = f.metadata
    flags, panel = list(meta["flags"]), key.split(".")[0]
    help_text = f"{meta['help']} (config: {key})".strip()
    base = meta["flag_type"] or tp
    args = [a for a in typing.get_args(base) if a is not type(None)]
    if typing.get_origin(base) is typing.Union and len(args) == 1:
        base = args[0]
    if base is bool:
        names = [f"{n}/--no-{n[2:]}" for n in flags]
        return Optional[bool], typer.Option(None, *names, help=help_text, rich_help_panel=panel)
    if typing.get_origin(base) is typing.Literal:
        return Optional[base], typer.Option(None, *flags, help=help_text, rich_help_panel=panel)
    if typing.get_origin(base) is list:
        return Optional[List[str]], typer.Option(None, *flags, help=help_text, rich_help_panel=panel)
    if base not in (int, float, str):
        raise TypeError(f"config field {key} has no flag type for {base!r}")
    return Optional[base], typer.Option(None, *flags, help=help_text, rich_help_panel=panel)


def config_flags(*sections: str, skip: tuple[str, ...] = ()):
    """Decorator for a stage command: one option per flagged config field of ``sections`` (see megapipe.config.opt),
    handed to the command as ``flags`` (dotted key -> value, None = not given), ready for ``build_config``."""
    fields = [(k, f, tp) for s in sections for k, f, tp in flag_fields(s) if k not in skip]

    def decorate(fn):
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.name != "flags"]
        generated = {}
        taken = {p.name for p in own}
        for key, f, tp in fields:
            name = min(f.metadata["flags"], key=len).lstrip("-").replace("-", "_")  # its shortest flag, as typer names it
            if name in taken:
                raise TypeError(f"{fn.__name__}: the flag of config field {key} clashes with parameter {name!r}")
            taken.add(name)
            annotation, default = _flag_option(key, f, tp)
            generated[name] = (key, f)
            own.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            flags = {key: _flag_value(kwargs.pop(name), f) for name, (key, f) in generated.items()}
            return fn(*args, flags=flags, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=own)
        wrapper.multi_value_flags = tuple(
            f.metadata["flags"][0] for _, f, tp in fields
            if typing.get_origin(f.metadata["flag_type"] or tp) is list)
        return wrapper

    return decorate


def _flag_value(value, f):
    if value is None:
        return None
    meta = f.metadata
    if meta["parse"] is not None:
        try:
            return meta["parse"](value)
        except ValueError as e:
            raise ConfigError(f"{meta['flags'][0]} {value!r} {e}") from None
    if meta["scale"] is not None:
        return value * meta["scale"]
    if isinstance(value, (list, tuple)):
        return list(value) or None
    return value


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


class MegapipeCommand(TyperCommand):
    """Every megapipe command's class: a value typer cannot convert is named in the refusal (typer's own message says
    only what the value should be)."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except typer.BadParameter as e:
            errors = e.__cause__.errors() if hasattr(e.__cause__, "errors") else []  # pydantic's, where it converted
            if errors and "input" in errors[0] and not e.message.startswith(repr(errors[0]["input"])):
                e.message = f"{errors[0]['input']!r}: {e.message[:1].lower()}{e.message[1:]}"
            raise


def multi_value_command(*names: str) -> type[TyperCommand]:
    """A command class whose options ``names`` take several values after one flag, Megatron style."""

    class MultiValueCommand(MegapipeCommand):
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
