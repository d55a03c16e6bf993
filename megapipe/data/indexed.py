"""Megatron's MMIDIDX token store: ``PREFIX.bin`` (raw tokens) + ``PREFIX.idx`` (the index), byte-compatible.

``.idx`` layout (little endian): magic ``MMIDIDX\\x00\\x00``, u64 version (1), u8 dtype code, u64 sequence count
S, u64 document-index count D, then int32 sequence lengths [S], int64 byte pointers into ``.bin`` [S] and int64
document indices [D] (sequence ids where each document starts, beginning with 0 and ending with S).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from megapipe.data.paths import bin_path, idx_path
from megapipe.data.sidecar import remove_sidecar, write_sidecar
from megapipe.errors import DataError
from megapipe.fileio import missing_parents, remove_empty

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 below 65500 tokens, int32 above."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def exists(prefix: str | Path) -> bool:
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


class IndexedDataset:
    """Read-only, memory-mapped view of a ``.bin/.idx`` pair. ``ds[i]`` is sequence i as a numpy array."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        ip, bp = idx_path(prefix), bin_path(prefix)
        for p in (ip, bp):
            if not p.is_file():
                raise DataError(f"dataset file {p} does not exist (expected a {bp.name}/{ip.name} pair)")
        with open(ip, "rb") as f:
            head = f.read(len(MAGIC) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[: len(MAGIC)] != MAGIC:
            raise DataError(f"{ip} is not a Megatron MMIDIDX index (bad magic bytes)")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != VERSION:
            raise DataError(f"{ip} has index version {version}; only version {VERSION} is supported")
        code = head[17]
        if code not in DTYPE_CODES:
            raise DataError(f"{ip} has unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        seq_count, doc_count = struct.unpack("<QQ", head[18:34])
        expected = 34 + seq_count * 4 + seq_count * 8 + doc_count * 8
        if ip.stat().st_size < expected:
            raise DataError(f"{ip} is truncated: {ip.stat().st_size} bytes, the header promises {expected}")
        if ip.stat().st_size > expected:
            raise DataError(f"{ip} has {ip.stat().st_size - expected} bytes after the index its header describes "
                            "(damaged, or not written by a Megatron-compatible tool)")
        self._idx = np.memmap(ip, mode="r", dtype=np.uint8) if seq_count or doc_count else np.zeros(34, np.uint8)
        off = 34
        self.sizes = np.frombuffer(self._idx, dtype=np.int32, count=seq_count, offset=off)
        off += seq_count * 4
        self.pointers = np.frombuffer(self._idx, dtype=np.int64, count=seq_count, offset=off)
        off += seq_count * 8
        self.document_indices = np.frombuffer(self._idx, dtype=np.int64, count=doc_count, offset=off)
        nbytes = bp.stat().st_size
        self._check_consistency(ip, bp, code, nbytes)
        self._bin = np.memmap(bp, mode="r", dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)

    def _check_consistency(self, ip: Path, bp: Path, code: int, nbytes: int) -> None:
        """The index against itself and against the .bin; each mismatch names which file disagrees with what.

        Megatron's writer stores the sequences back to back: pointer i is the byte offset of sequence i, so the
        pointers must step by ``size * itemsize`` and the .bin must hold exactly the last pointer plus the last size.
        """
        sizes = np.asarray(self.sizes, dtype=np.int64)
        item = self.dtype.itemsize
        if len(sizes) and sizes.min() < 0:
            i = int(np.argmax(sizes < 0))
            raise DataError(f"{ip} is damaged: sequence {i} has a negative length ({int(sizes[i])})")
        tokens = int(sizes.sum())
        starts = np.zeros(len(sizes), np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1], out=starts[1:])
        pointers = np.asarray(self.pointers, dtype=np.int64)
        if not np.array_equal(pointers, starts * item):
            spacing = [d for d in sorted(CODE_OF, key=lambda d: d.itemsize)
                       if d.itemsize != item and np.array_equal(pointers, starts * d.itemsize)]
            if spacing:
                raise DataError(
                    f"{ip} is inconsistent: its dtype code {code} says {self.dtype} ({item}-byte tokens), but its "
                    f"pointers are spaced for {spacing[0].itemsize}-byte tokens (the dtype byte is wrong)"
                )
            i = int(np.argmax(pointers != starts * item))
            raise DataError(
                f"{ip} is inconsistent: pointer {i} is {int(pointers[i])}, but the lengths before it put sequence {i} "
                f"at byte {int(starts[i] * item)} (lengths and pointers disagree)"
            )
        docs = np.asarray(self.document_indices, dtype=np.int64)
        if len(docs) < 1 or docs[0] != 0 or docs[-1] != len(sizes) or np.any(np.diff(docs) < 0):
            first = int(docs[0]) if len(docs) else None
            last = int(docs[-1]) if len(docs) else None
            raise DataError(
                f"{ip} has a malformed document index: it must rise from 0 to the sequence count {len(sizes)}, "
                f"found {len(docs)} entries from {first} to {last}"
            )
        if nbytes != tokens * item:
            other = [d for d in CODE_OF if d.itemsize != item and nbytes == tokens * d.itemsize]
            if other:
                raise DataError(
                    f"{bp} does not match {ip}: the index describes {tokens:,} {self.dtype} tokens ({tokens * item:,} "
                    f"bytes) but the .bin has {nbytes:,} bytes, the size of {other[0].itemsize}-byte tokens "
                    "(a .bin of another dtype, or of another dataset)"
                )
            cut = "truncated" if nbytes < tokens * item else "longer than its index describes"
            raise DataError(
                f"{bp} does not match {ip}: the index describes {tokens:,} {self.dtype} tokens ({tokens * item:,} "
                f"bytes) but the .bin has {nbytes:,} bytes ({cut})"
            )

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return max(len(self.document_indices) - 1, 0)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


class IndexedDatasetWriter:
    """Streams documents into ``PREFIX.bin/.idx`` under temporary names; ``finalize`` renames both at the end.

    Used as a context manager, an exception removes the temporaries, so a failed run leaves nothing at PREFIX.
    """

    def __init__(self, prefix: str | Path, dtype=np.int32, sidecar: dict | None = None):
        """``sidecar``: what ``PREFIX.megapipe.json`` records (tokenizer, ...); None writes none (and removes a
        stale one)."""
        self.prefix = str(prefix)
        self.sidecar = sidecar
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise DataError(f"token dtype {self.dtype} cannot be stored in an MMIDIDX file")
        tag = f".tmp-{os.getpid()}"
        self._tmp_bin = Path(f"{bin_path(prefix)}{tag}")
        self._tmp_idx = Path(f"{idx_path(prefix)}{tag}")
        parent = Path(self.prefix).parent
        clash = next((f"{p} is a directory" for p in (bin_path(prefix), idx_path(prefix)) if p.is_dir()), None)
        if parent.exists() and not parent.is_dir():
            clash = f"{parent} is a file, not a directory"
        if clash:
            raise DataError(f"cannot write the dataset {self.prefix}.bin/.idx: {clash}")
        # the directories made for the output, removed again (when empty) by abort()
        self._made = missing_parents(self._tmp_bin)
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._bin = open(self._tmp_bin, "wb")
        except OSError as e:
            raise self._write_error(e) from None
        self._sizes: list[np.ndarray] = []
        self._doc_starts: list[np.ndarray] = [np.zeros(1, np.int64)]
        self._num_seqs = 0
        self._one_by_one: list[int] = []
        self._done = False

    def add_document(self, tokens) -> None:
        """One document stored as one sequence (Megatron's usual layout)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._write(arr.tobytes(order="C"))
        self._one_by_one.append(arr.size)  # plain ints, turned into arrays in batches: small per document
        if len(self._one_by_one) >= 1 << 16:
            self._flush_one_by_one()

    def _flush_one_by_one(self) -> None:
        if self._one_by_one:
            lengths = np.array(self._one_by_one, np.int32)
            self._one_by_one = []
            self._append_index(lengths)

    def _append_index(self, lengths: np.ndarray) -> None:
        self._sizes.append(lengths.astype(np.int32))
        self._doc_starts.append(self._num_seqs + np.arange(1, len(lengths) + 1, dtype=np.int64))
        self._num_seqs += len(lengths)

    def add_documents(self, flat_tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many documents at once: ``flat_tokens`` is their concatenation, ``lengths`` their sizes."""
        flat = np.ascontiguousarray(flat_tokens, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size:
            raise ValueError("lengths do not add up to the number of tokens")
        self._flush_one_by_one()
        self._write(flat.tobytes())
        self._append_index(lengths)

    def add_dataset(self, prefix: str | Path) -> None:
        """Append every sequence and document of another ``.bin/.idx`` pair (as Megatron's merge does)."""
        other = IndexedDataset(prefix)
        self._flush_one_by_one()
        if other.dtype != self.dtype:
            raise DataError(f"cannot merge {prefix}: its tokens are {other.dtype}, the output's are {self.dtype}")
        with open(bin_path(prefix), "rb") as src:
            while chunk := src.read(16 << 20):
                self._write(chunk)
        self._sizes.append(np.array(other.sizes, np.int32))
        self._doc_starts.append(np.array(other.document_indices[1:], np.int64) + self._num_seqs)
        self._num_seqs += len(other)

    def _write(self, data: bytes) -> None:
        try:
            self._bin.write(data)
        except OSError as e:  # disk full, file-size limit
            raise self._write_error(e, self._tmp_bin) from None

    def _write_error(self, e: OSError, file: Path | None = None) -> DataError:
        name = e.filename or file
        where = f"writing {name} failed" if name else "a write failed"
        return DataError(f"cannot write the dataset {self.prefix}.bin/.idx: {where} ({e.strerror or e}); "
                         "nothing was kept")

    def finalize(self) -> None:
        try:
            self._finalize()
        except OSError as e:  # disk full, the directory removed under us, ...
            self.abort()
            raise self._write_error(e, self._tmp_bin) from None

    def _finalize(self) -> None:
        self._flush_one_by_one()
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int32)
        doc_idx = np.concatenate(self._doc_starts)
        pointers = np.zeros(len(sizes), np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        try:
            with open(self._tmp_idx, "wb") as f:
                f.write(MAGIC)
                f.write(struct.pack("<Q", VERSION))
                f.write(struct.pack("<B", CODE_OF[self.dtype]))
                f.write(struct.pack("<Q", len(sizes)))
                f.write(struct.pack("<Q", len(doc_idx)))
                f.write(sizes.astype(np.int32).tobytes())
                f.write(pointers.tobytes())
                f.write(doc_idx.astype(np.int64).tobytes())
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise OSError(e.errno, e.strerror, e.filename or str(self._tmp_idx)) from None
        remove_sidecar(self.prefix)  # first: a crash below leaves a pair of unknown origin, never a wrong record
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))
        self._done = True
        if self.sidecar is not None:
            write_sidecar(self.prefix, self.sidecar)

    def abort(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            p.unlink(missing_ok=True)
        remove_empty(self._made)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()
