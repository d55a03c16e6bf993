"""GPT pretraining samples over Megatron ``.bin/.idx`` token stores, Megatron-style, with cached indices.

A split's documents, each epoch in a fresh seeded order, form one token stream; sample i is the ``seq_length + 1``
tokens starting at stream position ``i * seq_length`` (samples span documents, consecutive samples share one token).
Three indices describe it, as in Megatron: the document index (document ids in stream order, epoch after epoch), the
sample index (``[len + 1, 2]``: position in the document index and offset of each sample's first token) and the
shuffle index (samples shuffled within each epoch; a sample belongs to the epoch its first token is in).

Differences from Megatron, on purpose: documents are shuffled per epoch and samples within their epoch (Megatron
shuffles across all but a short last epoch), and every epoch is built whole, so the first samples never depend on
how many were requested: a run extended on resume sees the same data in the same order. The split is by document
(a document = the sequences between two ``document_indices`` entries; one sequence each as written by preprocess),
with Megatron's normalised weights and rounding.

``data_path`` is ``["A"]``, ``["0.7", "A", "0.3", "B"]`` (weight/prefix pairs) or ``["A", "B"]``: a list without
weights blends each prefix in proportion to its tokens in the split, as if the files were concatenated (Megatron's
unweighted blend also sizes each dataset by itself).

The indices are cached as ``.npy`` under ``cache_dir`` in a directory named by a hash of their inputs (prefix path,
the ``.idx``/``.bin`` size, mtime and inode, document range, seq_length, seed, epochs, format version); they are
built once (rank 0 under torch.distributed, the others wait at a barrier; a file lock between unrelated processes),
written to a temporary directory and renamed, and loaded with ``mmap_mode='r'``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from megapipe.config import number_or_none, parse_data_path
from megapipe.data.blend import BlendedDataset, build_blend_index, normalize_weights
from megapipe.data.indexed import IndexedDataset
from megapipe.data.paths import bin_path, idx_path
from megapipe.errors import DataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SPLITS = ("train", "valid", "test")
DEFAULT_CACHE_NAME = "megapipe_index_cache"


# ----------------------------------------------------------------------------------------------------- inputs
def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised train/valid/test weights (missing trailing ones are 0, as in Megatron)."""
    parts = [p.strip() for p in re.split(r"[,/]", str(split))]
    values = [number_or_none(p) for p in parts]
    if not 1 <= len(parts) <= 3 or any(v is None or not math.isfinite(v) or v < 0 for v in values):
        raise DataError(f"data.split {split!r} must be up to three non-negative numbers like '969,30,1'")
    values += [0.0] * (3 - len(values))
    if sum(values) <= 0:
        raise DataError(f"data.split {split!r} gives every split weight 0")
    return list(normalize_weights(values))


def split_document_ranges(weights: list[float], num_documents: int) -> list[tuple[int, int]]:
    """Megatron's rounding: split k covers documents [round(lo_k * n), round(hi_k * n)) of cumulative weights."""
    bounds = [0.0]
    for w in weights:
        bounds.append(bounds[-1] + w)
    return [(int(round(lo * num_documents)), int(round(hi * num_documents)))
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


# ------------------------------------------------------------------------------------------------- index math
def _int_dtype(max_value: int):
    return np.int32 if max_value < 2**31 - 1 else np.int64


def plan_epochs(num_tokens: int, seq_length: int, num_samples: int | None) -> tuple[int, int, int]:
    """``(sample_epochs, length, document_epochs)``: whole epochs of samples covering ``num_samples`` (None: one
    epoch), the number of samples they hold, and the epochs of documents the last sample's tokens reach into."""
    if num_samples is None:
        epochs = 1
    else:
        epochs = max(1, (max(num_samples, 1) - 1) * seq_length // num_tokens + 1)
    length = -(-epochs * num_tokens // seq_length)  # samples whose first token lies in those epochs
    doc_epochs = length * seq_length // num_tokens + 1  # the stream must hold token length * seq_length
    return epochs, length, doc_epochs


def build_document_index(doc_ids: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    """Document ids in stream order: one seeded permutation of ``doc_ids`` per epoch."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0])))
    n = len(doc_ids)
    out = np.empty(num_epochs * n, dtype=_int_dtype(int(doc_ids.max(initial=0)) + 1))
    for e in range(num_epochs):
        out[e * n : (e + 1) * n] = rng.permutation(doc_ids)
    return out


def build_sample_index(stream_lengths: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """``[num_samples + 1, 2]``: for each sample boundary ``i * seq_length``, (position in the document index of the
    document holding that token, offset in it). Sample i reads from boundary i up to and including boundary i+1's
    token. Same result as Megatron's C++ ``build_sample_idx`` (with the extra token), by one ``searchsorted``."""
    ends = np.cumsum(stream_lengths, dtype=np.int64)
    if num_samples * seq_length >= (ends[-1] if len(ends) else 0):
        raise ValueError("the document stream is too short for the requested samples")
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(ends, positions, side="right")  # first document ending after the position
    offsets = positions - (ends[doc_pos] - stream_lengths[doc_pos])
    out = np.empty((num_samples + 1, 2), dtype=_int_dtype(max(len(ends), int(stream_lengths.max(initial=0)))))
    out[:, 0] = doc_pos
    out[:, 1] = offsets
    out[0] = 0  # Megatron starts at document 0 even when it is empty (it reads nothing from it)
    return out


def build_shuffle_index(num_tokens: int, seq_length: int, num_epochs: int, seed: int) -> np.ndarray:
    """Sample ids, shuffled within each epoch (sample i is in the epoch of its first token, i*seq_length)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 1])))
    bounds = [-(-e * num_tokens // seq_length) for e in range(num_epochs + 1)]
    out = np.empty(bounds[-1], dtype=_int_dtype(bounds[-1]))
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        out[lo:hi] = lo + rng.permutation(hi - lo)
    return out


# ------------------------------------------------------------------------------------------------- documents
class TokenStore:
    """A ``.bin/.idx`` pair seen as documents: contiguous token ranges ``tokens[start[d] : start[d] + length[d]]``."""

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        if not (idx_path(prefix).is_file() and bin_path(prefix).is_file()):
            hint = " (give the prefix, without .bin/.idx)" if str(prefix).endswith((".bin", ".idx")) else ""
            raise DataError(f"data prefix {prefix} not found: expected {bin_path(prefix)} and {idx_path(prefix)}{hint}")
        ds = IndexedDataset(prefix)  # checks the pair's consistency (contiguous pointers, document index, sizes)
        sizes = np.asarray(ds.sizes, dtype=np.int64)
        seq_starts = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=seq_starts[1:])
        doc_bounds = np.asarray(ds.document_indices, dtype=np.int64)
        self.start = seq_starts[doc_bounds[:-1]]
        self.length = seq_starts[doc_bounds[1:]] - self.start
        self.num_documents = len(self.length)
        self.dtype = ds.dtype
        self.tokens = (np.memmap(bin_path(prefix), dtype=ds.dtype, mode="r").view(np.ndarray) if seq_starts[-1]
                       else np.zeros(0, ds.dtype))

    def identity(self) -> dict:
        """What the cache key needs to notice a rewritten prefix: path, size, mtime and inode of both files."""
        out = {"prefix": str(Path(self.prefix).resolve())}
        for p in (idx_path(self.prefix), bin_path(self.prefix)):
            st = os.stat(p)
            out[p.suffix] = [st.st_size, st.st_mtime_ns, st.st_ino]
        return out


# ---------------------------------------------------------------------------------------------------- cache
def _torch_dist():
    """torch.distributed when a process group is up (without importing torch when nobody else did)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed


class IndexCache:
    """``.npy`` arrays under ``root/{kind}-{hash of key}/``; ``root=None`` builds in memory every time."""

    def __init__(self, root: str | Path | None, explicit: bool = True):
        self.root = Path(root) if root is not None else None
        self.explicit = explicit
        self.builds = 0  # how many index sets this object built (tests and logs)

    def entry(self, kind: str, key: dict) -> Path | None:
        if self.root is None:
            return None
        blob = json.dumps({"format_version": FORMAT_VERSION, "kind": kind, **key}, sort_keys=True)
        return self.root / f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"

    def fetch(self, kind: str, key: dict, build: Callable[[], dict[str, np.ndarray]]) -> tuple[dict, bool]:
        """``(arrays, cache_hit)``."""
        path = self.entry(kind, key)
        if path is not None and path.is_dir():
            return self._load(path), True
        if path is None:
            self.builds += 1
            return build(), False
        with self._lock():
            if path.is_dir():
                return self._load(path), True
            self.builds += 1
            arrays = build()
            self._write(path, kind, key, arrays)
            return arrays, False

    @staticmethod
    def _load(path: Path) -> dict[str, np.ndarray]:
        # plain ndarray views of the maps: slicing an np.memmap costs more than reading a sample
        return {p.stem: np.load(p, mmap_mode="r").view(np.ndarray) for p in sorted(path.glob("*.npy"))}

    @contextlib.contextmanager
    def _lock(self):
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root, os.O_RDONLY)
        except OSError as e:
            if self.explicit:
                raise DataError(f"data.cache_dir {self.root} cannot be used: {e.strerror}") from e
            log.warning("index cache %s unusable (%s): building the indices in memory", self.root, e.strerror)
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _write(self, path: Path, kind: str, key: dict, arrays: dict[str, np.ndarray]) -> None:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.mkdir(parents=True)
            for name, arr in arrays.items():
                with open(tmp / f"{name}.npy", "wb") as f:
                    np.save(f, arr, allow_pickle=False)
            (tmp / "description.json").write_text(json.dumps({"kind": kind, **key}, indent=1, sort_keys=True))
            os.rename(tmp, path)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if path.is_dir():  # someone without our lock (another machine) got there first: theirs is as good
                return
            if self.explicit:
                raise DataError(f"cannot write the index cache under data.cache_dir {self.root}: {e.strerror}") from e
            log.warning("cannot write index cache %s (%s): indices kept in memory", self.root, e.strerror)


# -------------------------------------------------------------------------------------------------- datasets
class GPTDataset:
    """Samples of ``seq_length + 1`` tokens from documents ``[doc_begin, doc_end)`` of one prefix."""

    def __init__(self, store: TokenStore, doc_range: tuple[int, int], seq_length: int, num_samples: int | None,
                 seed: int, cache: IndexCache, split_name: str = "train"):
        self.store = store
        self.seq_length = seq_length
        self.split_name = split_name
        self.doc_range = begin, end = doc_range
        self.num_tokens = int(store.length[begin:end].sum())
        if self.num_tokens == 0:
            raise DataError(
                f"split {split_name!r} of {store.prefix} (documents {begin}..{end}) has no tokens but samples "
                "were requested; change data.split or add data"
            )
        self.num_epochs, length, doc_epochs = plan_epochs(self.num_tokens, seq_length, num_samples)
        key = {**store.identity(), "documents": [begin, end], "seq_length": seq_length, "seed": seed,
               "epochs": self.num_epochs}

        def build() -> dict[str, np.ndarray]:
            docs = build_document_index(np.arange(begin, end, dtype=np.int64), doc_epochs, seed)
            samples = build_sample_index(store.length[docs], seq_length, length)
            shuffle = build_shuffle_index(self.num_tokens, seq_length, self.num_epochs, seed)
            return {"document_index": docs, "sample_index": samples, "shuffle_index": shuffle}

        arrays, self.cache_hit = cache.fetch("gpt", key, build)
        self.cache_path = cache.entry("gpt", key)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self.shuffle_index)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        j = int(self.shuffle_index[i])
        (b, b_off), (e, e_off) = self.sample_index[j].tolist(), self.sample_index[j + 1].tolist()
        tokens, start, length = self.store.tokens, self.store.start, self.store.length
        out = np.empty(self.seq_length + 1, dtype=np.int64)
        filled = 0
        for pos, doc in zip(range(b, e + 1), self.document_index[b : e + 1].tolist(), strict=True):
            lo = start[doc] + (b_off if pos == b else 0)
            hi = start[doc] + (e_off + 1 if pos == e else length[doc])
            out[filled : filled + hi - lo] = tokens[lo:hi]
            filled += hi - lo
        return out


def _default_cache_dir(prefixes: list[str]) -> Path:
    return Path(prefixes[0]).resolve().parent / DEFAULT_CACHE_NAME


def build_gpt_datasets(data_path: list[str], split: str, seq_length: int, num_samples: dict[str, int], seed: int,
                       cache_dir: str | None) -> dict[str, GPTDataset | BlendedDataset | None]:
    """Train/valid/test datasets (None where no samples are requested). ``num_samples[name]`` None = one epoch;
    ``cache_dir`` None = next to the first prefix (in memory if that is not writable)."""
    prefixes, weights = parse_data_path(data_path)
    fractions = parse_split(split)
    if not isinstance(seq_length, (int, np.integer)) or isinstance(seq_length, bool) or seq_length < 1:
        raise DataError(f"data.seq_length {seq_length!r} must be a positive integer")
    unknown = set(num_samples) - set(SPLITS)
    if unknown:
        raise DataError(f"num_samples has unknown split {sorted(unknown)[0]!r}; use {', '.join(SPLITS)}")
    for name, n in num_samples.items():
        if n is not None and (not isinstance(n, (int, np.integer)) or n < 0):
            raise DataError(f"num_samples[{name!r}] = {n!r} must be a non-negative integer or None")
    wanted = {s: num_samples.get(s, 0) for s in SPLITS}
    cache = IndexCache(cache_dir if cache_dir is not None else _default_cache_dir(prefixes),
                       explicit=cache_dir is not None)
    stores = {p: TokenStore(p) for p in dict.fromkeys(prefixes)}

    dist = _torch_dist()
    builder = dist is None or dist.get_rank() == 0
    if not builder:
        dist.barrier()  # rank 0 builds every index first; then the others load them from the cache
    try:
        out = {s: _build_split(s, wanted[s], stores, prefixes, weights, fractions, seq_length, seed, cache)
               if wanted[s] != 0 else None for s in SPLITS}
    finally:
        if builder and dist is not None:
            dist.barrier()
    return out


def _build_split(name, wanted, stores, prefixes, weights, fractions, seq_length, seed, cache):
    k = SPLITS.index(name)
    ranges = [split_document_ranges(fractions, stores[p].num_documents)[k] for p in prefixes]

    def dataset(i: int, n: int | None) -> GPTDataset:
        lo, hi = ranges[i]
        if hi <= lo:
            raise DataError(
                f"split {name!r} of {prefixes[i]} has 0 of its {stores[prefixes[i]].num_documents} documents "
                f"(data.split weights {[round(f, 4) for f in fractions]}) but samples were requested"
            )
        return GPTDataset(stores[prefixes[i]], ranges[i], seq_length, n, seed, cache, name)

    if len(prefixes) == 1:
        return dataset(0, wanted)
    if weights is None:  # unweighted list: each prefix in proportion to its tokens in this split
        weights = [float(stores[p].length[lo:hi].sum()) for p, (lo, hi) in zip(prefixes, ranges, strict=True)]
        if sum(weights) == 0:
            raise DataError(f"split {name!r} has no tokens in any of {prefixes}; change data.split or add data")
    if wanted is None:  # one pass: as many samples as the split's tokens make
        total = sum(int(stores[p].length[lo:hi].sum()) for p, (lo, hi) in zip(prefixes, ranges, strict=True))
        wanted = max(1, total // seq_length)
    active = [i for i, w in enumerate(weights) if w > 0]
    key = {"weights": [float(weights[i]) for i in active], "size": int(wanted)}

    def build() -> dict[str, np.ndarray]:
        dataset_index, dataset_sample_index = build_blend_index(key["weights"], int(wanted))
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    arrays, blend_hit = cache.fetch("blend", key, build)
    counts = np.bincount(np.asarray(arrays["dataset_index"]), minlength=len(active))
    datasets = [dataset(i, int(c)) if c else None for i, c in zip(active, counts, strict=True)]
    return BlendedDataset(datasets, key["weights"], arrays["dataset_index"], arrays["dataset_sample_index"], blend_hit)
