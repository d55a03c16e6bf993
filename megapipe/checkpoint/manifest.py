"""The checkpoint manifest (``megapipe.json``), completeness checks and finding the newest complete checkpoint.

A checkpoint directory is complete when its manifest parses, says ``complete: true``, and every file it lists is
present with the listed size. The manifest is written last, inside the temporary directory, just before the rename,
so a cut-off save never looks complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, Optional

from megapipe.errors import CheckpointError
from megapipe.fileio import fsync_dir, write_bytes_durable, write_text_atomic  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

# 2: every file has a checksum (integrity.py); 1: sizes only, as written before checksums existed (and by saves that
# turn checksums off, for benchmarks). A version-2 manifest without its checksums is damaged, never a version 1.
FORMAT_VERSION = 2
SIZES_ONLY_VERSION = 1
READABLE_VERSIONS = (SIZES_ONLY_VERSION, FORMAT_VERSION)
CHECKSUM_ALGORITHM = "xxh3_128"  # XXH3-128 (integrity.py)
MANIFEST_NAME = "megapipe.json"
LATEST_NAME = "latest"
STEP_DIR = re.compile(r"^step_(\d+)$")

# Every manifest has these keys (callers may add more; unknown keys are kept as they are). The saver adds
# "complete": true and "files": {relative path: size} last; both are what completeness is judged by.
MANIFEST_KEYS = (
    "format_version",
    "model",
    "tokenizer",
    "layout",
    "step",
    "tokens_seen",
    "data_state",
    "trainer_state",
    "stage",
    "parent",
    "quantization",
    "created",
)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def tmp_name(final: Path) -> Path:
    """A sibling name that is never taken for a checkpoint (``step_00000010.tmp-1a2b3c``)."""
    return final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:12]}")


def make_tmp_dir(tmp: Path, final: Path, sub: str = "") -> None:
    """Create ``tmp/sub`` (the temporary twin of output ``final``); an unwritable place is the user's mistake."""
    try:
        (tmp / sub if sub else tmp).mkdir(parents=True)
    except OSError as e:
        raise CheckpointError(f"cannot create output {final}: {e.strerror} ({e.filename})") from None


def new_manifest(step: int, fields: Optional[dict] = None) -> dict:
    """A manifest with every standard key; ``fields`` (model may be a ModelConfig) overrides the defaults."""
    manifest: dict[str, Any] = {k: None for k in MANIFEST_KEYS}
    manifest.update(format_version=FORMAT_VERSION, tokens_seen=0, data_state={}, trainer_state={})
    for key, value in (fields or {}).items():
        manifest[key] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    manifest["step"] = int(step)
    try:
        json.dumps(manifest, allow_nan=False)
    except (TypeError, ValueError) as e:
        bad = [k for k, v in manifest.items() if not _jsonable(v)]
        raise TypeError(f"checkpoint manifest key(s) {', '.join(bad) or '?'} are not JSON-serialisable: {e}") from None
    return manifest


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------------------------------- files


def list_files(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``root`` except the manifest."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel != MANIFEST_NAME:
                out[rel] = full.stat().st_size
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------------------- reading


def read_manifest(ckpt: str | Path) -> dict:
    """Parse ``ckpt/megapipe.json``; every problem is a CheckpointError naming the file (and line)."""
    ckpt = Path(ckpt)
    path = ckpt / MANIFEST_NAME
    if not ckpt.exists():
        raise CheckpointError(f"checkpoint {ckpt} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{ckpt} is not a megapipe checkpoint: it has no {MANIFEST_NAME}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}:{e.lineno}: corrupted manifest, invalid JSON: {e.msg}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}:1: corrupted manifest: expected a JSON object")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise CheckpointError(
            f"{path}: format_version = {version!r} is not supported (this megapipe reads format_version "
            f"{' and '.join(map(str, READABLE_VERSIONS))})"
        )
    problem = _file_list_problem(manifest)
    if problem is not None:
        raise CheckpointError(f"{path}: corrupted manifest: {problem}")
    return manifest


def _file_list_problem(manifest: dict) -> Optional[str]:
    """What is wrong with the manifest's ``files`` (relative path -> size) and ``checksums`` (relative path ->
    digest), or None: each is an object, every path stays inside the checkpoint, and a checksummed manifest
    (format_version 2) has a checksum for every file."""
    for key, kind, type_ in (("files", "size in bytes", int), ("checksums", "checksum", str)):
        entries = manifest.get(key)
        if entries is None:
            continue
        if not isinstance(entries, dict):
            return f"'{key}' is a {type(entries).__name__}, not an object mapping each file to its {kind}"
        for rel, value in entries.items():
            parts = PurePosixPath(rel).parts
            if not parts or rel.startswith("/") or ".." in parts:
                return f"'{key}' names {rel!r}, a path outside the checkpoint"
            if not isinstance(value, type_) or isinstance(value, bool) or (type_ is int and value < 0):
                return f"'{key}' gives {rel!r} the {kind} {value!r}"
    if manifest.get("format_version") == FORMAT_VERSION and manifest.get("files") is not None:
        if manifest.get("checksum_algorithm") != CHECKSUM_ALGORITHM or not isinstance(manifest.get("checksums"), dict):
            return (f"its checksums are missing (format_version {FORMAT_VERSION} records an {CHECKSUM_ALGORITHM} checksum for "
                    "every file)")
        missing = sorted(set(manifest["files"]) - set(manifest["checksums"]))
        if missing:
            return f"{missing[0]} has no checksum (format_version {FORMAT_VERSION} records one for every file)"
    return None


def incomplete_reason(ckpt: Path) -> Optional[str]:
    """None when ``ckpt`` is a complete checkpoint, else why not (one phrase)."""
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError as e:
        return str(e)
    if manifest.get("complete") is not True:
        return f"{ckpt / MANIFEST_NAME} marks the checkpoint incomplete"
    if not (ckpt / "model" / ".metadata").is_file():
        return f"{ckpt / 'model' / '.metadata'} is missing"
    no_tokenizer = not (ckpt / "tokenizer").exists()  # removed on purpose (or never copied): give --tokenizer
    for rel, size in (manifest.get("files") or {}).items():
        full = ckpt / rel
        if no_tokenizer and rel.startswith("tokenizer/"):
            continue
        if not full.is_file():
            return f"{full} is missing"
        if full.stat().st_size != size:
            return f"{full} has {full.stat().st_size} bytes, the manifest says {size} (truncated or replaced)"
    return None


def is_complete(ckpt: str | Path) -> bool:
    return incomplete_reason(Path(ckpt)) is None


def _step_of(path: Path) -> Optional[int]:
    m = STEP_DIR.match(path.name)
    if m:
        return int(m.group(1))
    try:
        return int(read_manifest(path).get("step") or 0)
    except CheckpointError:
        return None


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """All ``step_N`` directories (complete or not) plus the ``latest`` target, sorted by step."""
    run_dir = Path(run_dir)
    found: dict[Path, int] = {}
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            if child.is_dir() and STEP_DIR.match(child.name):
                found[child] = int(STEP_DIR.match(child.name).group(1))
    pointer = run_dir / LATEST_NAME
    if pointer.is_file():
        target = run_dir / pointer.read_text().strip()
        if target.name and target.is_dir() and target not in found and ".tmp-" not in target.name:
            step = _step_of(target)
            if step is not None:
                found[target] = step
    return sorted(((s, p) for p, s in found.items()), key=lambda sp: (sp[0], sp[1].name))


def latest_problem(run_dir: str | Path) -> Optional[str]:
    """What is wrong with run ``run_dir``'s ``latest`` pointer (it names no checkpoint there), or None (also when it
    has none)."""
    pointer = Path(run_dir) / LATEST_NAME
    if not pointer.exists():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return f"{pointer} cannot be read ({e})"
    target = pointer.parent / name
    if not name or "/" in name or not (target / MANIFEST_NAME).is_file():
        return f"{pointer} names {name!r}, which is not a checkpoint in {pointer.parent}"
    return None


def find_latest(path: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under a run dir, or ``path`` itself if it is a complete checkpoint; else None."""
    path = Path(path)
    if (path / MANIFEST_NAME).exists() or (path / "model").is_dir():
        return path if is_complete(path) else None
    for _, ckpt in reversed(list_checkpoints(path)):
        if is_complete(ckpt):
            return ckpt
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` (a checkpoint or a run dir) -> a complete checkpoint directory, or a CheckpointError saying why not."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / MANIFEST_NAME).exists() or (path / "model").is_dir():
        reason = incomplete_reason(path)
        if reason is not None:
            raise CheckpointError(f"{path} is not a usable checkpoint: {reason}")
        return path
    latest = find_latest(path)
    if latest is None:
        candidates = list_checkpoints(path)
        if candidates:
            step, ckpt = candidates[-1]
            raise CheckpointError(
                f"{path} holds no complete checkpoint (the newest, {ckpt.name}, is unusable: {incomplete_reason(ckpt)})"
            )
        if path.is_file():
            raise CheckpointError(f"{path} is a file: give a megapipe checkpoint or run directory, or a Hugging Face "
                                  f"model directory")
        if any((path / name).exists() for name in ("tokenizer.json", "model.safetensors", "model.safetensors.index.json",
                                                  "generation_config.json")):
            raise CheckpointError(f"{path} looks like a Hugging Face model directory but has no config.json")
        raise CheckpointError(f"{path} is not a megapipe checkpoint: it has no {MANIFEST_NAME} and no step_* checkpoints")
    skipped = [c for step, c in list_checkpoints(path) if step > (_step_of(latest) or 0)]
    if skipped:  # an interrupted save; say so rather than silently use older weights
        log.warning("warning: skipping %s (%s); using %s", skipped[-1], incomplete_reason(skipped[-1]), latest)
    return latest


def lineage(ckpt: str | Path, limit: int = 64) -> list[dict]:
    """[{path, stage, step, exists}] from ``ckpt`` back through each manifest's ``parent``."""
    chain: list[dict] = []
    current: Optional[Path] = Path(ckpt)
    seen = set()
    while current is not None and len(chain) < limit:
        key = str(current.resolve()) if current.exists() else str(current)
        if key in seen:
            break
        seen.add(key)
        try:
            m = read_manifest(current)
        except CheckpointError:
            chain.append({"path": str(current), "stage": None, "step": None, "exists": current.exists()})
            break
        chain.append({"path": str(current), "stage": m.get("stage"), "step": m.get("step"), "exists": True})
        parent = m.get("parent")
        if not parent:
            break
        current = Path(parent)
    return chain
