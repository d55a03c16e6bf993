"""Durable and atomic file writes shared by every stage that must never leave a half-written file."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from megapipe.errors import MegapipeError


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_durable(path: Path, data: bytes) -> None:
    """Write and fsync ``path``; a failing write (disk full, file-size limit) raises an OSError naming the file."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, rename over ``path``, fsync the directory: readers see the old file or
    the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write_bytes_durable(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def missing_parents(path: Path) -> list[Path]:
    """The folders above ``path`` that do not exist yet, innermost first: the ones making ``path`` creates."""
    return [d for d in path.parents if not d.exists()]


def remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (``missing_parents``' list) innermost first, stopping at one that is not empty (something
    else was written there meanwhile) or gone: what an output that failed leaves of the folders it made."""
    for d in folders:
        try:
            d.rmdir()
        except OSError:
            break


# --------------------------------------------------------------------------------------------------- outputs vs inputs


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # hard links and bind mounts too
    except OSError:
        return False


def refuse_overlap(outputs, inputs, error=None) -> None:
    """Refuse to write any of ``outputs`` when it equals, contains or lies inside one of ``inputs`` (symlinks
    resolved), so no command can delete or overwrite what it reads. Paths that do not exist are compared by name.
    Raises ``error`` (default MegapipeError) with one sentence naming both paths."""
    error = error or MegapipeError
    for out in outputs:
        if out is None:
            continue
        o = _real(out)
        for inp in inputs:
            if inp is None:
                continue
            i = _real(inp)
            if o == i or _same_file(o, i):
                raise error(f"output {out} is the input {inp}: write the output somewhere else")
            if i.is_relative_to(o):
                raise error(f"output {out} contains the input {inp}: writing it would destroy the input; "
                            "write the output somewhere else")
            if o.is_relative_to(i) and (i.is_dir() or not i.exists()):
                raise error(f"output {out} lies inside the input {inp}: write the output somewhere else")


def replace_dir(tmp: Path, final: Path) -> None:
    """Put the finished directory ``tmp`` at ``final``: an existing ``final`` is moved aside first and removed only
    after the rename, so a crash leaves the old or the new output, never a mix of both."""
    import shutil

    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
