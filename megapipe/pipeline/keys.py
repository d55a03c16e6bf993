"""Step cache keys: a hash of what determines a step's output.

A key covers the stage, its options as written (variables resolved; references to other steps kept as
``${step.output}`` text, so moving the run directory does not invalidate anything), the megapipe version, the
identity of every input file an option names that the pipeline did not make, and the keys of the upstream steps.
An input file's identity is its size and modification time (a directory's: those of every file in it), as make
and most build caches use: reading terabytes of training data to hash them is not affordable.
How a step is run (executor, resources, environment) is not part of its key, nor are options that only change
what a command prints (``quiet``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from megapipe import __version__
from megapipe.pipeline.refs import REF

KEY_FORMAT = 1
MAX_DIR_FILES = 100_000
NOT_IN_KEY = ("quiet",)  # options that change what a command prints, never what it writes


def step_key(pipeline, name: str, upstream_keys: dict[str, str]) -> tuple[str, dict]:
    """(hex key, the material it hashes) for step ``name`` given its upstream steps' keys."""
    step = pipeline.steps[name]
    material = {
        "format": KEY_FORMAT,
        "stage": step.stage,
        "options": _canonical({k: v for k, v in step.options.items() if k not in NOT_IN_KEY}),
        "megapipe": __version__,
        "inputs": input_identities(step.options),
        "upstream": {u: upstream_keys[u] for u in step.upstream},
    }
    blob = json.dumps(material, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest(), material


def all_keys(pipeline) -> dict[str, str]:
    keys: dict[str, str] = {}
    for name in pipeline.order:
        keys[name], _ = step_key(pipeline, name, keys)
    return keys


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def input_identities(options: dict) -> dict[str, Any]:
    """Identity of each existing file, directory or PREFIX (.bin/.idx) named by an option value that does not
    come from another step."""
    found: dict[str, Any] = {}
    for value in strings_in(options):
        if REF.search(value):
            continue
        ident = path_identity(value)
        if ident is not None:
            found[str(Path(value).absolute())] = ident
    return found


def strings_in(value: Any):
    """Every string in an option value (in lists and dicts too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from strings_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings_in(v)


def path_identity(value: str) -> Any:
    """Size and mtime of a file; a digest of them over a directory's files; both files of a .bin/.idx prefix;
    None when ``value`` names nothing on disk."""
    if not value or len(value) > 4096 or "\n" in value:
        return None
    p = Path(value)
    try:
        if p.is_file():
            return _file_identity(p)
        if p.is_dir():
            return _dir_identity(p)
        bin_, idx = Path(value + ".bin"), Path(value + ".idx")
        if bin_.is_file() and idx.is_file():
            return {"bin": _file_identity(bin_), "idx": _file_identity(idx)}
    except OSError:
        return None
    return None


def _file_identity(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns]


def _dir_identity(root: Path) -> str:
    h = hashlib.sha256()
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            p = Path(dirpath) / f
            try:
                st = p.stat()
            except OSError:
                continue
            h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            count += 1
            if count >= MAX_DIR_FILES:
                return h.hexdigest() + "+"
    return h.hexdigest()
