"""Streaming input readers: JSONL (optionally gzipped), parquet, and whatever Hugging Face ``datasets`` loads from
a local path (a ``save_to_disk`` directory, csv, ...).

Reading is split in two so it parallelises: :func:`iter_blocks` (cheap, in the main process) cuts the inputs into
blocks of whole records; :func:`parse_block` (in the workers) turns a block into texts, one list per JSON key,
checking every record. Memory stays bounded by the block size whatever the input size.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import select
import socket
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megapipe.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
HF_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
BLOCK_BYTES = 1 << 20
TABLE_BATCH_ROWS = 4096
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JSONRecordError(ValueError):
    """A line that is valid JSON but no record Python can read or text can hold (the reason is the message)."""


def load_json_record(line: str, allow_surrogates: bool = False):
    """``json.loads`` of one record, refusing (JSONRecordError) nesting too deep for Python's parser and, unless
    ``allow_surrogates`` (the caller checks the texts it uses), lone UTF-16 surrogate escapes: legal JSON, but no
    character, so no tokenizer or file can take them."""
    try:
        value = json.loads(line)
    except RecursionError:
        raise JSONRecordError("is nested too deeply to read (thousands of levels of [ or {)") from None
    if not allow_surrogates and SURROGATE_ESCAPE.search(line):  # rare: only then look whether an escape is half of a pair
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise JSONRecordError("holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which is "
                                  "no character") from None
    return value


@dataclass
class Block:
    """A run of whole records from one input."""

    source: str  # the input, as messages name it
    first: int  # 1-based line (JSONL) or row (tables) number of the first record
    lines: bytes | None = None  # JSONL: complete lines
    rows: list[list] | None = None  # tables: one list of values per key
    nbytes: int = 0  # input bytes this block accounts for (progress)


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Paths from file names, directories and glob patterns, in the order given (glob matches sorted)."""
    if not patterns:
        raise DataError("no input given (pass --input FILE...)")
    paths: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
            if not matches:
                raise DataError(f"input pattern {pattern} matches no file")
            paths += [Path(m) for m in matches]
            continue
        p = Path(pattern).expanduser()
        if not p.exists():
            if _is_hub_name(pattern):
                paths.append(p)  # not here: a Hugging Face hub dataset, loaded by name
                continue
            raise DataError(f"input file {pattern} does not exist")
        if not os.access(p, os.R_OK):
            raise DataError(f"input file {pattern} is not readable (permission denied)")
        paths += _data_files(p) if p.is_dir() else [p]
    return paths


DATA_SUFFIXES = (*JSONL_SUFFIXES, *(s + ".gz" for s in JSONL_SUFFIXES), ".parquet", ".csv", ".tsv", ".txt")


def _data_files(directory: Path) -> list[Path]:
    """A directory of data files -> those files (sorted, recursively, hidden ones left out), read one by one so a
    bad record is named by its file and line; a saved Hugging Face dataset (or a directory without such files)
    stays one input for ``datasets``."""
    if any((directory / m).is_file() for m in HF_SAVED_MARKERS):
        return [directory]
    found = sorted(
        f for f in directory.rglob("*")
        if f.is_file() and f.name.lower().endswith(DATA_SUFFIXES)
        and not any(part.startswith(".") for part in f.relative_to(directory).parts)
    )
    return found or [directory]


def _is_hub_name(name: str) -> bool:
    """``name`` or ``owner/name`` without a data-file suffix: what a hub dataset id looks like."""
    suffixes = (*JSONL_SUFFIXES, ".gz", ".parquet", ".csv", ".tsv", ".txt", ".arrow")
    return bool(HUB_NAME.fullmatch(name)) and not name.lower().endswith(suffixes)


def _is_jsonl(p: Path) -> bool:
    """By name; a pipe with a JSONL name streams too."""
    return not p.is_dir() and p.name.lower().removesuffix(".gz").endswith(JSONL_SUFFIXES)


def _is_parquet(p: Path) -> bool:
    return p.is_file() and p.name.lower().endswith(".parquet")


def total_size(paths: list[Path]) -> int | None:
    """Bytes the progress bar counts to; None when some input's size is unknown (a pipe, ``datasets``)."""
    if all(p.is_file() and (_is_jsonl(p) or _is_parquet(p)) for p in paths):
        return sum(p.stat().st_size for p in paths)
    return None


def iter_blocks(paths: list[Path], keys: list[str], block_bytes: int = BLOCK_BYTES) -> Iterator[Block]:
    if all(p.exists() for p in paths):
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local paths only: datasets must not reach for the hub
    for p in paths:
        if _is_jsonl(p):
            yield from _jsonl_blocks(p, block_bytes)
        elif _is_parquet(p):
            yield from _parquet_blocks(p, keys)
        else:
            yield from _datasets_blocks(p, keys)


class _PipeReader:
    """A pipe's reads, each after waiting for data in short ``select`` calls. Python runs a signal's handler only
    between system calls, so a Ctrl-C or SIGTERM landing just before a plain blocking read would wait until the
    writer sends more, or forever from a stalled one; here it is acted on within ``poll`` seconds."""

    def __init__(self, raw, poll: float = 0.2):
        self.raw, self.poll = raw, poll

    def read(self, size: int = -1) -> bytes:
        while not select.select([self.raw], [], [], self.poll)[0]:
            pass
        return self.raw.read(size)


def _jsonl_blocks(path: Path, block_bytes: int) -> Iterator[Block]:
    # Unbuffered reads: one system call each, so a block is cut from what has arrived, not after a buffer fills.
    line, done = 1, 0
    try:
        with open(path, "rb", buffering=0) as raw:
            seekable = raw.seekable()
            src = raw if seekable else _PipeReader(raw)
            f = gzip.GzipFile(fileobj=src, mode="rb") if path.name.lower().endswith(".gz") else src
            pieces: list[bytes] = []
            size, target = 0, block_bytes
            while True:
                chunk = f.read(block_bytes)
                if chunk:
                    pieces.append(chunk)
                    size += len(chunk)
                    if size < target:
                        continue
                data = b"".join(pieces)
                cut = len(data) if not chunk else data.rfind(b"\n") + 1
                if chunk and cut == 0:  # a line longer than a block: read on, doubling (linear time for huge lines)
                    pieces, target = [data], 2 * size
                    continue
                if data[:cut].strip():
                    pos = raw.tell() if seekable else done + cut
                    yield Block(str(path), line, lines=data[:cut], nbytes=pos - done)
                    done = pos
                    line += data.count(b"\n", 0, cut)
                if not chunk:
                    break
                pieces = [data[cut:]] if cut < len(data) else []
                size, target = len(data) - cut, block_bytes
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"cannot read input file {path} ({e})") from None


def _parquet_blocks(path: Path, keys: list[str]) -> Iterator[Block]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read input file {path} as parquet ({e})") from None
    _check_columns(path, pf.schema_arrow.names, keys)
    size, rows = path.stat().st_size, max(pf.metadata.num_rows, 1)
    first, done = 1, 0
    try:
        for batch in pf.iter_batches(batch_size=TABLE_BATCH_ROWS, columns=keys):
            n = batch.num_rows
            pos = size * (first - 1 + n) // rows
            yield Block(str(path), first, rows=[batch.column(k).to_pylist() for k in keys], nbytes=pos - done)
            first, done = first + n, pos
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read input file {path} as parquet ({e})") from None


def _datasets_blocks(path: Path, keys: list[str]) -> Iterator[Block]:
    import datasets

    try:
        if not path.exists():
            ds = _hub_dataset(str(path))
        elif path.is_dir() and any((path / m).is_file() for m in HF_SAVED_MARKERS):
            ds = datasets.load_from_disk(str(path))
        else:
            suffix = path.suffix.lower().lstrip(".")
            builder = {"csv": "csv", "tsv": "csv", "txt": "text", "arrow": "arrow"}.get(suffix)
            kwargs = {"delimiter": "\t"} if suffix == "tsv" else {}
            if builder:
                ds = datasets.load_dataset(builder, data_files=str(path), streaming=True, **kwargs)
            else:
                ds = datasets.load_dataset(str(path), streaming=True)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types for "cannot load this"
        raise DataError(f"cannot load input {path} with Hugging Face datasets ({first_line(e)})") from None
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = sorted(ds)
        if len(splits) != 1 and "train" not in splits:
            raise DataError(f"input {path} holds splits {', '.join(splits)}; save the one to preprocess on its own")
        ds = ds["train" if "train" in splits else splits[0]]
    first = 1
    try:
        for batch in ds.iter(batch_size=TABLE_BATCH_ROWS):
            _check_columns(path, list(batch), keys)  # streamed inputs may learn their columns only here
            values = [batch[k] for k in keys]
            yield Block(str(path), first, rows=values)
            first += len(values[0])
    except DataError:
        raise
    except Exception as e:  # a malformed csv row, a lost connection, ...
        raise DataError(f"cannot read input {path} near row {first} ({first_line(e)})") from None


def _hub_dataset(name: str):
    """The train split of a hub dataset, streamed. Offline, one clear error at once (not minutes of retries)."""
    import datasets
    from huggingface_hub import constants

    host = constants.ENDPOINT.split("://")[-1].split("/")[0].split(":")[0]
    if not datasets.config.HF_HUB_OFFLINE:
        try:
            socket.getaddrinfo(host, 443)
        except OSError as e:
            raise DataError(f"input {name} is not a local path, and the Hugging Face hub ({host}) cannot be reached "
                            f"to load it as a hub dataset ({e.strerror or e})") from None
    return datasets.load_dataset(name, split="train", streaming=True)


def _check_columns(path: Path, names: list[str], keys: list[str]) -> None:
    missing = [k for k in keys if k not in names]
    if missing:
        raise DataError(f"input {path} has no column '{missing[0]}' (its columns: {', '.join(names)})")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, for one-sentence errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
              type(None): "null"}


def parse_block(block: Block, keys: list[str], skip_bad: bool) -> tuple[list[list[str]], list[int], list[str]]:
    """The texts of a block's good records (one list per key), their line/row numbers, and what was bad.

    A bad record raises :class:`DataError` naming file and line, unless ``skip_bad``: then it is left out and
    described in the third list.
    """
    bad: list[str] = []

    def reject(number: int, reason: str) -> None:
        where = f"{block.source}:{number}" if block.lines is not None else f"{block.source} row {number}"
        if not skip_bad:
            raise DataError(f"{where}: the record {reason}; fix it or pass --skip-bad-records")
        bad.append(f"{where}: {reason}")

    texts: list[list[str]] = [[] for _ in keys]
    numbers: list[int] = []

    def take(number: int, values) -> None:
        for k, v in zip(keys, values, strict=True):
            if type(v) is not str:
                return reject(number, _not_a_string(k, v))
        for col, v in zip(texts, values, strict=True):
            col.append(v)
        numbers.append(number)

    if block.rows is not None:
        for i, values in enumerate(zip(*block.rows, strict=True)):
            take(block.first + i, values)
        return texts, numbers, bad

    data = block.lines
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        # decoded one by one, to name the bad line; never by json.loads(bytes), which guesses UTF-16/32 from NUL
        # bytes and would then report offsets into text that is not there
        lines: list = [_decode_line(line) for line in data.split(b"\n")]
    else:
        fast = _parse_clean_lines(text, keys)
        if fast is not None:
            return fast, list(range(block.first, block.first + len(fast[0]))), bad
        lines = text.split("\n")
    if lines and not lines[-1]:
        lines.pop()
    for i, line in enumerate(lines):
        if isinstance(line, UnicodeDecodeError):
            reject(block.first + i, f"is not valid UTF-8 ({utf8_problem(line.object, line)})")
            continue
        try:
            record = load_json_record(line, allow_surrogates=True)  # preprocess names a bad text by its key
            values = [record[k] for k in keys]
        except UnicodeDecodeError as e:
            reject(block.first + i, f"is not valid UTF-8 ({utf8_problem(line, e)})")
            continue
        except (ValueError, KeyError, TypeError, IndexError) as e:
            if not line.strip():
                continue  # blank lines are not records
            reject(block.first + i, _json_problem(line, e, keys))
            continue
        take(block.first + i, values)
    return texts, numbers, bad


def _decode_line(line: bytes):
    """The line as text, or the UnicodeDecodeError saying where it is not UTF-8."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        return e


def _parse_clean_lines(text: str, keys: list[str]) -> list[list[str]] | None:
    """The texts of a block whose lines are all good records, parsed as one JSON array (one C call instead of one
    per line); None when any line is not, and the caller goes line by line to find it."""
    body = text[:-1] if text.endswith("\n") else text
    try:
        records = json.loads("[" + body.replace("\n", ",") + "]")  # raw newlines cannot occur inside JSON strings
        if len(records) != body.count("\n") + 1:  # a line held two values (and so another one none)
            return None
        columns = [[r[k] for r in records] for k in keys]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if all(type(v) is str for col in columns for v in col):
        return columns
    return None


def utf8_problem(data: bytes, e: UnicodeDecodeError) -> str:
    """Which byte is wrong, at which offset of ``data`` (0-based, in bytes), and why: a byte that cannot start a
    character, a character whose next byte does not continue it, or one cut off by the end of the line."""
    start, end = e.start, e.end
    first = f"byte 0x{data[start]:02x} at offset {start}"
    if e.reason == "invalid continuation byte" and end < len(data):
        after = f" (after {' '.join(f'{b:02x}' for b in data[start:end])})" if end - start > 1 else ""
        return f"{first} begins a multi-byte character, but byte 0x{data[end]:02x} at offset {end} does not continue it{after}"
    if e.reason in ("unexpected end of data", "invalid continuation byte"):
        return f"{first} begins a multi-byte character that the end of the line cuts off"
    if e.reason == "invalid start byte":
        return f"{first} cannot start a character"
    return f"{first}: {e.reason}"


def _not_a_string(key: str, value) -> str:
    return f"has a {JSON_TYPES.get(type(value), type(value).__name__)} under '{key}', not a string"


def _json_problem(line, e: Exception, keys: list[str]) -> str:
    if isinstance(e, JSONRecordError):
        return str(e)
    if isinstance(e, json.JSONDecodeError):
        at = "" if e.msg.endswith(" at") else " at"  # "Unterminated string starting at" names its position
        return f"is not valid JSON ({e.msg}{at} column {e.colno})"
    if isinstance(line, bytes):  # undecodable line: json.loads(bytes) detects the encoding itself
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as u:
            return f"is not valid UTF-8 ({utf8_problem(line, u)})"
    try:
        record = json.loads(line)
    except ValueError as err:
        return f"is not valid JSON ({err})"
    if not isinstance(record, dict):
        return f"is a JSON {JSON_TYPES.get(type(record), type(record).__name__)}, not an object"
    missing = next(k for k in keys if k not in record)
    have = ", ".join(sorted(record)) or "none"
    return f"has no key '{missing}' (its keys: {have})"


def iter_texts(paths: list[Path], key: str, skip_bad: bool = False) -> Iterator[str]:
    """Every text under ``key`` in the inputs, in order (bad records raise, or are left out with ``skip_bad``)."""
    for block in iter_blocks(paths, [key]):
        yield from parse_block(block, [key], skip_bad=skip_bad)[0][0]
