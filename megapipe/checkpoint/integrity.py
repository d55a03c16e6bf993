"""Checksums of checkpoint files: computed while DCP writes the shards, recorded in the manifest, verified on load.

The hash is xxHash's XXH3-128 (non-cryptographic, ~10+ GB/s on one core): it guards against damage (a flipped block,
a file replaced or cut by a copy tool) at a cost small next to the disk. Shards are hashed as the bytes go out
(``HashingFileSystem`` wraps DCP's file streams), so a save never re-reads what it wrote; small files (manifest
aside) are hashed from disk when the manifest is written. Verifying reads every file once through ``mmap``.
"""

from __future__ import annotations

import mmap
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

from megapipe.checkpoint.manifest import CHECKSUM_ALGORITHM as ALGORITHM
from megapipe.errors import CheckpointError

_CHUNK = 64 << 20


def _new():
    return xxhash.xxh3_128()


def hash_file(path: str | Path) -> str:
    """The hex digest of a whole file."""
    h = _new()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                for start in range(0, size, _CHUNK):
                    h.update(view[start : start + _CHUNK])
            finally:
                view.release()
    return h.hexdigest()


def hash_bytes(data: bytes) -> str:
    h = _new()
    h.update(data)
    return h.hexdigest()


class _HashingStream:
    """A binary write stream that hashes what goes through it and names its file in write errors."""

    def __init__(self, raw, path: Path, done, failed, hashing: bool = True):
        self.raw, self.path, self._done, self._failed = raw, path, done, failed
        self._hash = _new() if hashing else None

    def write(self, data) -> int:
        try:
            n = self.raw.write(data)
        except OSError as e:  # disk full, file-size limit: say which file
            error = OSError(e.errno, e.strerror, str(self.path))
            self._failed(error)  # torch.save's C++ writer replaces it by "unexpected pos": keep the real one
            raise error from None
        if self._hash is not None:
            self._hash.update(data)
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        if not self.raw.closed:
            try:
                self.raw.close()
            except OSError as e:
                error = OSError(e.errno, e.strerror, str(self.path))
                self._failed(error)
                raise error from None
            if self._hash is not None:
                self._done(self.path, self._hash.hexdigest())

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HashingFileSystem(FileSystem):
    """DCP's FileSystem whose write streams hash their bytes; ``digests`` maps absolute paths to hex digests
    (renames, as of ``.metadata.tmp`` -> ``.metadata``, carry the digest along)."""

    def __init__(self, hashing: bool = True) -> None:
        super().__init__()
        self.hashing = hashing
        self.digests: dict[str, str] = {}
        self.error: Optional[OSError] = None  # the first write that failed
        self._lock = threading.Lock()

    def _record(self, path: Path, digest: str) -> None:
        with self._lock:
            self.digests[str(Path(path).absolute())] = digest

    def _failed(self, error: OSError) -> None:
        with self._lock:
            self.error = self.error or error

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        try:
            raw = open(path, mode)
        except OSError as e:
            self._failed(e)
            raise
        stream = _HashingStream(raw, path, self._record, self._failed, self.hashing)
        try:
            yield stream
        finally:
            stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            digest = self.digests.pop(str(Path(path).absolute()), None)
            if digest is not None:
                self.digests[str(Path(new_path).absolute())] = digest


def digests_for(root: Path, files: Iterable[str], known: dict[str, str]) -> dict[str, str]:
    """Relative path -> digest for ``files`` under ``root``: from ``known`` (absolute path -> digest, computed while
    writing) where there, else hashed from disk."""
    out = {}
    for rel in files:
        full = str((root / rel).absolute())
        out[rel] = known.get(full) or hash_file(root / rel)
    return out


# --------------------------------------------------------------------------------------------------- verifying


def recorded(manifest: dict) -> Optional[dict[str, str]]:
    """The manifest's checksums, or None for a checkpoint saved before megapipe recorded them."""
    sums = manifest.get("checksums")
    if not isinstance(sums, dict) or manifest.get("checksum_algorithm") != ALGORITHM:
        return None
    return sums


def check_file(ckpt: Path, rel: str, manifest: dict) -> Optional[str]:
    """None when ``ckpt/rel`` is as the manifest recorded it, else what is wrong (one phrase naming the file)."""
    full = ckpt / rel
    sizes = manifest.get("files") or {}
    if not full.is_file():
        return f"{full} is missing"
    if rel in sizes and full.stat().st_size != sizes[rel]:
        return f"{full} has {full.stat().st_size} bytes, the manifest recorded {sizes[rel]} (truncated or replaced)"
    sums = recorded(manifest) or {}
    if rel in sums:
        try:
            got = hash_file(full)
        except OSError as e:
            return f"{full} cannot be read ({e.strerror})"
        if got != sums[rel]:
            return f"{full} is damaged (its {ALGORITHM} checksum differs from the one recorded when it was saved)"
    return None


def select(manifest: dict, prefixes: Iterable[str]) -> list[str]:
    """The manifest's files under any of ``prefixes`` (``"model/"``, ``"extra/rng_rank00001.safetensors"``)."""
    prefixes = tuple(prefixes)
    names = set(manifest.get("files") or {}) | set(recorded(manifest) or {})
    return sorted(n for n in names if n.startswith(prefixes))


def problems(ckpt: Path, manifest: dict, files: Iterable[str]) -> list[str]:
    return [p for p in (check_file(ckpt, rel, manifest) for rel in files) if p is not None]


def verify_files(ckpt: Path, manifest: dict, files: list[str], rank: int = 0, world: int = 1) -> list[str]:
    """This rank's share of ``files`` checked (every ``world``-th one): the problems found."""
    return problems(ckpt, manifest, files[rank::world])


# absolute path -> (size, mtime, inode) of each file whose checksum matched in this process: a file read again while
# unchanged is not hashed again (a command loads one checkpoint in several pieces: convert, export, RL's two models)
_verified: dict[str, tuple[int, int, int]] = {}


def _stamp(path: Path) -> Optional[tuple[int, int, int]]:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def remember(ckpt: Path, files: Iterable[str]) -> None:
    """``files`` of ``ckpt`` were just verified."""
    for rel in files:
        full = ckpt / rel
        _verified[str(full.absolute())] = _stamp(full)


def unverified(ckpt: Path, files: Iterable[str]) -> list[str]:
    """Those of ``files`` not verified in this process, or changed since."""
    out = []
    for rel in files:
        full = ckpt / rel
        stamp = _verified.get(str(full.absolute()))
        if stamp is None or stamp != _stamp(full):
            out.append(rel)
    return out


def damaged_error(ckpt: Path, found: list[str]) -> CheckpointError:
    more = f" (and {len(found) - 1} more damaged file(s): run `megapipe checkpoint verify {ckpt}`)" if len(found) > 1 else ""
    return CheckpointError(
        f"checkpoint {ckpt} cannot be used: {found[0]}{more}; restore the file from a copy or load another checkpoint"
    )
