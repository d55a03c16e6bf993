"""YAML with positions: plain Python values plus a map from each key path to the ``file:line`` it came from.

Pipeline errors must name the line of the culprit, so the file is composed into nodes (which carry marks) and
converted by hand; duplicate keys, which PyYAML silently lets win, are refused with both lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megapipe.errors import ConfigError


@dataclass(frozen=True)
class Loc:
    file: str
    line: int

    def __str__(self) -> str:  # line 0: not from a file (a --set on the command line)
        return f"{self.file}:{self.line}" if self.line else self.file


class Located:
    """Values and the location of every key path (a tuple of keys and list indexes)."""

    def __init__(self, value: Any, locs: dict[tuple, Loc], file: str):
        self.value = value
        self.locs = locs
        self.file = file

    def loc(self, *path) -> Loc:
        """The location of ``path``, or of its nearest ancestor that has one."""
        path = tuple(path)
        while path and path not in self.locs:
            path = path[:-1]
        return self.locs.get(path, Loc(self.file, 1))


def load_located(path: str | Path) -> Located:
    """Parse ``path``; a syntax error or a duplicate key is a ConfigError naming file:line."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"pipeline file {file} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {file}: {e}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        raise ConfigError(f"{file}:{line}: invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}: invalid YAML: {e}") from None
    locs: dict[tuple, Loc] = {}
    if node is None:
        return Located(None, locs, file)
    constructor = yaml.SafeLoader("")
    value = _convert(node, (), locs, file, constructor)
    return Located(value, locs, file)


def _convert(node: yaml.Node, path: tuple, locs: dict, file: str, constructor) -> Any:
    locs[path] = Loc(file, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ConfigError(f"{file}:{key_node.start_mark.line + 1}: YAML merge keys (<<) are not supported")
            key = constructor.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                raise ConfigError(f"{file}:{key_node.start_mark.line + 1}: a key must be a plain scalar")
            key = str(key)
            if key in out:
                first = locs[path + (key,)]
                raise ConfigError(f"{file}:{key_node.start_mark.line + 1}: duplicate key '{key}' (first at line "
                                  f"{first.line})")
            out[key] = _convert(value_node, path + (key,), locs, file, constructor)
            locs[path + (key,)] = Loc(file, key_node.start_mark.line + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, path + (i,), locs, file, constructor) for i, item in enumerate(node.value)]
    try:
        return constructor.construct_object(node, deep=True)
    except yaml.YAMLError as e:
        raise ConfigError(f"{file}:{node.start_mark.line + 1}: {e}") from None
