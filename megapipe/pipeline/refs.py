"""``${...}`` references in pipeline values: ``${vars.NAME}``, ``${env.NAME}``, ``${STEP.output}``, ``${STEP.dir}``.

A value that is exactly one reference takes the referenced value with its type (``train_iters: ${vars.steps}``
stays an int); a reference inside a longer string is pasted in as text. ``$${`` writes a literal ``${``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from megapipe.errors import ConfigError

REF = re.compile(r"\$\{([^}]*)\}")
ESCAPED = "$${"
STEP_ATTRS = ("output", "dir")


def parse_ref(text: str) -> tuple[str, str]:
    """'pretrain.output' -> ('pretrain', 'output'); a malformed reference raises ConfigError (no location)."""
    parts = text.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"'${{{text}}}' is not a reference of the form ${{step.output}}, ${{vars.NAME}} or "
                          "${env.NAME}")
    return parts[0], parts[1]


def refs_in(value: Any) -> list[tuple[str, str]]:
    """Every (namespace, attribute) referenced anywhere in a value (strings in lists and dicts too)."""
    found: list[tuple[str, str]] = []
    if isinstance(value, str):
        for m in REF.finditer(value.replace(ESCAPED, "")):
            found.append(parse_ref(m.group(1)))
    elif isinstance(value, list):
        for v in value:
            found += refs_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            found += refs_in(v)
    return found


def substitute(value: Any, lookup: Callable[[str, str], Any | None]) -> Any:
    """Replace the references ``lookup`` knows (it returns None for the ones to leave as they are)."""
    if isinstance(value, list):
        return [substitute(v, lookup) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, lookup) for k, v in value.items()}
    if not isinstance(value, str) or "${" not in value:
        return value
    whole = REF.fullmatch(value)
    if whole and not value.startswith(ESCAPED):
        found = lookup(*parse_ref(whole.group(1)))
        return value if found is None else found

    def one(m: re.Match) -> str:
        found = lookup(*parse_ref(m.group(1)))
        return m.group(0) if found is None else str(found)

    pieces = value.split(ESCAPED)
    return ESCAPED.join(REF.sub(one, piece) for piece in pieces)


def unescape(value: Any) -> Any:
    if isinstance(value, list):
        return [unescape(v) for v in value]
    if isinstance(value, dict):
        return {k: unescape(v) for k, v in value.items()}
    return value.replace(ESCAPED, "${") if isinstance(value, str) else value


def vars_lookup(variables: dict[str, Any], env: dict[str, str] | None = None) -> Callable[[str, str], Any | None]:
    """A lookup for ``vars.*`` and ``env.*``; an unknown name raises ConfigError naming the known ones."""
    env = os.environ if env is None else env

    def lookup(ns: str, name: str):
        if ns == "vars":
            if name not in variables:
                known = ", ".join(sorted(variables)) or "none"
                raise ConfigError(f"'${{vars.{name}}}': no variable '{name}' (variables: {known})")
            return variables[name]
        if ns == "env":
            if name not in env:
                raise ConfigError(f"'${{env.{name}}}': the environment variable {name} is not set")
            return env[name]
        return None

    return lookup
