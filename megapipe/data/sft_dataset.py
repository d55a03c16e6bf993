"""SFT datasets: records tokenized once into an indexed store (cached), then split, packed and batched.

The store is two Megatron ``.bin/.idx`` pairs in one cache directory, one sequence per conversation: ``tokens``
(the ids) and ``mask`` (uint8, 1 where the token is a target the loss counts), plus ``first_target.npy`` (per
conversation, the position of its first trained target) and ``meta.json`` (counts, skipped records). The directory
is named by a hash of everything the tokens depend on (the inputs' path, size, mtime and inode, the tokenizer file,
the chat template, --train-on-prompt, --skip-bad-records), built once under a file lock (rank 0 under
torch.distributed, the others wait at a barrier) into a temporary directory and renamed, and memory-mapped after:
epochs, resumed runs and other stages reuse it without re-tokenizing.

A sample is one row of ``seq_length`` tokens: one conversation (cut at ``seq_length``, or left out with
``overlong='drop'``) padded at the end, or, with packing, several conversations placed by best-fit-decreasing,
each with its own document id and positions restarting at 0. ``labels[t] = tokens[t + 1]`` within a conversation;
``loss_mask[t]`` is the mask of token t + 1, and false at the last token of each conversation and on padding. The
train split's rows are reshuffled every epoch (seeded), the valid split's kept in order.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from megapipe.data.gpt_dataset import parse_split, split_document_ranges
from megapipe.data.images import ImageError, ImageLimits, ImageProcessor, open_image, placeholder_repeats
from megapipe.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from megapipe.data.loader import PretrainingLoader
from megapipe.data.readers import expand_inputs
from megapipe.data.sft import ChatEncoder, NoChatTemplate, input_identity, iter_records, parse_record
from megapipe.errors import DataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CACHE_NAME = "megapipe_sft_cache"
BAD_EXAMPLES_KEPT = 5


def _torch_dist():
    """torch.distributed when a process group is up."""
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


@dataclass
class SFTIndex:
    path: Path
    tokens: IndexedDataset
    mask: IndexedDataset
    first_target: np.ndarray
    meta: dict
    cache_hit: bool = False
    pixels: Optional[IndexedDataset] = None  # a vision-language model's: each conversation's image patches, flat
    grids: Optional[IndexedDataset] = None  # and their (frames, height, width) patch grids, flat

    @property
    def num_conversations(self) -> int:
        return len(self.tokens)


def expand_sft_inputs(inputs: list[str]) -> list[Path]:
    if not inputs:
        raise DataError("sft.data (--data) is not set: give the JSONL / parquet / saved-dataset files to train on")
    paths = expand_inputs(inputs)
    for p in paths:
        if not p.exists():
            raise DataError(f"input file {p} does not exist")
    return paths


def cache_root(paths: list[Path], cache_dir: Optional[str]) -> Path:
    """--data-cache-path, else ``megapipe_sft_cache`` next to the first input (else under ~/.cache/megapipe)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    first = paths[0].resolve()
    parent = first if first.is_dir() else first.parent
    if os.access(parent, os.W_OK):
        return parent / CACHE_NAME
    return Path.home() / ".cache" / "megapipe" / CACHE_NAME


@dataclass(frozen=True)
class SFTImages:
    """How a vision-language model's SFT records take images: decoded (paths relative to the record's file),
    processed into patches and their grids, each image token of the rendered conversation repeated for its
    patches (never trained on)."""

    processor: ImageProcessor
    image_token_id: int
    limits: ImageLimits = ImageLimits()

    def key(self) -> dict:
        return {"processor": asdict(self.processor), "image_token_id": self.image_token_id}

    def encode(self, ex, ids: np.ndarray, trained: np.ndarray):
        """(ids, trained, pixel_values float32 [patches, D], grids int64 [images, 3]) with the images of ``ex``."""
        base = Path(ex.where.rsplit(":", 1)[0]).parent
        images = []
        for i, source in enumerate(ex.images):
            try:
                images.append(open_image(source, self.limits, allow_files=True, base=base))
            except ImageError as e:
                raise DataError(f"{ex.where}: image {i + 1}: {e}") from None
        if not images:
            return ids, trained, None, None
        try:
            pixels, grids = self.processor(images)
            repeats = placeholder_repeats(ids, self.image_token_id, [self.processor.token_count(g) for g in grids])
        except ImageError as e:
            raise DataError(f"{ex.where}: {e}") from None
        ids, trained = np.repeat(ids, repeats), np.repeat(trained, repeats)
        return ids, trained & (ids != self.image_token_id), pixels.numpy(), grids.numpy()


def index_key(paths: list[Path], encoder: ChatEncoder, skip_bad: bool, images: Optional[SFTImages] = None) -> dict:
    key = {"format_version": FORMAT_VERSION, "inputs": input_identity(paths), "tokenizer": encoder.tokenizer_sha,
           "chat_template": encoder.template_sha, "train_on_prompt": encoder.train_on_prompt,
           "skip_bad_records": skip_bad}
    return key if images is None else {**key, "images": images.key()}


def prepare_sft_index(inputs: list[str], encoder: ChatEncoder, skip_bad: bool = False,
                      cache_dir: Optional[str] = None, progress: Optional[Callable[[int], None]] = None,
                      images: Optional[SFTImages] = None) -> SFTIndex:
    """The tokenized store of ``inputs`` (built now, or found in the cache); ``images``: a vision-language model's
    records keep their images' patches beside their tokens."""
    paths = expand_sft_inputs(inputs)
    key = index_key(paths, encoder, skip_bad, images)
    return cached_index("sft", key, cache_root(paths, cache_dir), cache_dir is not None,
                        lambda entry: _build(paths, encoder, skip_bad, entry, key, progress, images), _load)


def cached_index(kind: str, key: dict, root: Path, explicit: bool, build: Callable[[Path], None],
                 load: Callable[[Path, bool], object]):
    """The cache entry ``root/KIND-HASH(key)``: loaded when present, else built once (``build(entry)`` writes it;
    under a file lock, by rank 0 while the other ranks wait at a barrier) and loaded (``load(entry, hit)``)."""
    entry = root / f"{kind}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}"
    if entry.is_dir():
        return load(entry, True)
    dist = _torch_dist()
    builder = dist is None or dist.get_rank() == 0
    if not builder:
        dist.barrier()  # rank 0 builds first; the others then load it (or fail the same way when it could not)
        if entry.is_dir():
            return load(entry, True)
    try:
        with _lock(root, explicit=explicit):
            if entry.is_dir():
                return load(entry, True)
            build(entry)
            return load(entry, False)
    finally:
        if builder and dist is not None:
            dist.barrier()


def _load(entry: Path, hit: bool) -> SFTIndex:
    meta = json.loads((entry / "meta.json").read_text())
    pixels, grids = ((IndexedDataset(entry / "pixels"), IndexedDataset(entry / "grids"))
                     if (entry / "grids.idx").is_file() else (None, None))
    return SFTIndex(entry, IndexedDataset(entry / "tokens"), IndexedDataset(entry / "mask"),
                    np.load(entry / "first_target.npy", mmap_mode="r").view(np.ndarray), meta, hit, pixels, grids)


@contextlib.contextmanager
def _lock(root: Path, explicit: bool):
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY)
    except OSError as e:
        where = "data.cache_dir (--data-cache-path)" if explicit else "the SFT index cache"
        raise DataError(f"{where} {root} cannot be used: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def write_index(paths: list[Path], encoder: ChatEncoder, skip_bad: bool, entry: Path, key: dict, unit: str,
                encode: Callable, progress=None, extra: Optional[Callable] = None) -> None:
    """Tokenise every record of ``paths`` into the index directory ``entry`` (written under a temporary name and
    renamed when whole): ``encode(record, where)`` -> the record's documents [(ids, trained mask)], one ``unit``
    (a conversation, a pair); a DataError is a bad record, which stops the build or, with ``skip_bad``, is counted
    and skipped. ``extra(documents, counts)`` sees each kept record; ``extra(None, tmp dir)`` ends the build (its own
    files beside tokens / mask / meta.json)."""
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    counts = {"records": 0, unit: 0, "bad_records": 0}
    bad: list[str] = []
    try:
        tmp.mkdir(parents=True)
        dtype = optimal_dtype(len(encoder.vocab))
        with IndexedDatasetWriter(tmp / "tokens", dtype) as tokens, IndexedDatasetWriter(tmp / "mask", np.uint8) as mask:
            for path in paths:
                for where, record in iter_records(path):
                    counts["records"] += 1
                    try:
                        if isinstance(record, DataError):
                            raise record
                        documents = encode(record, where)
                    except NoChatTemplate:
                        raise
                    except DataError as e:
                        if not skip_bad:
                            raise DataError(f"{e}; fix it or pass --skip-bad-records") from None
                        counts["bad_records"] += 1
                        if len(bad) < BAD_EXAMPLES_KEPT:
                            bad.append(str(e))
                        continue
                    for ids, trained in documents:
                        tokens.add_document(ids)
                        mask.add_document(trained.astype(np.uint8))
                    counts[unit] += 1
                    if extra is not None:
                        extra(documents, counts)
                    if progress is not None:
                        progress(counts["records"])
        if not counts[unit]:
            raise DataError(f"{', '.join(map(str, paths))} hold no usable record ({counts['bad_records']} bad)")
        if extra is not None:
            extra(None, tmp)
        meta = {**counts, "bad_examples": bad, "chat_template": encoder.template_name, "key": key}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.rename(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _build(paths: list[Path], encoder: ChatEncoder, skip_bad: bool, entry: Path, key: dict, progress,
           images: Optional[SFTImages] = None) -> None:
    first: list[int] = []  # each conversation's first trained target
    pixels: list[np.ndarray] = []  # each conversation's image patches and grids (empty without images)
    grids: list[np.ndarray] = []

    def encode(record, where: str):
        ex = parse_record(record, where)
        ids, trained = encoder.encode(ex)
        if images is not None:
            ids, trained, pix, grid = images.encode(ex, ids, trained)
            pixels.append(pix.reshape(-1) if pix is not None else np.zeros(0, np.float32))
            grids.append(grid.reshape(-1) if grid is not None else np.zeros(0, np.int64))
        if len(ids) < 2 or not trained[1:].any():
            if images is not None:
                pixels.pop(), grids.pop()
            raise DataError(f"{where}: the record renders to no token to train on")
        return [(ids, trained)]

    def extra(documents, counts):
        if documents is None:
            np.save(counts / "first_target.npy", np.asarray(first, dtype=np.int64), allow_pickle=False)
            if images is not None:
                with IndexedDatasetWriter(counts / "pixels", np.float32) as pix, \
                        IndexedDatasetWriter(counts / "grids", np.int64) as grid:
                    for p, g in zip(pixels, grids, strict=True):
                        pix.add_document(p)
                        grid.add_document(g)
            return
        ids, trained = documents[0]
        first.append(1 + int(np.argmax(trained[1:])))
        counts["tokens"] = counts.get("tokens", 0) + len(ids)
        counts["trained_tokens"] = counts.get("trained_tokens", 0) + int(trained[1:].sum())

    write_index(paths, encoder, skip_bad, entry, key, "conversations", encode, progress, extra)


# ----------------------------------------------------------------------------------------------- samples


def pack_best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing: longest first, each into the fullest row it still fits (a new row if none).
    Deterministic (ties by index). Every length must be <= capacity."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    rows: list[list[int]] = []
    free: list[int] = []  # remaining capacity of the open rows, sorted
    free_rows: list[int] = []  # the row of each entry of ``free``
    for i in order.tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free, n)
        if k == len(free):
            row, left = len(rows), capacity - n
            rows.append([i])
        else:
            row, left = free_rows[k], free[k] - n
            del free[k], free_rows[k]
            rows[row].append(i)
        if left > 0:
            j = bisect.bisect_left(free, left)
            free.insert(j, left)
            free_rows.insert(j, row)
    return rows


class SFTSamples:
    """Rows of ``seq_length`` tokens over conversations ``conv_ids`` of an SFTIndex (see the module docstring).

    ``num_samples`` rows are available (whole epochs: the rows of an epoch are reshuffled each epoch when
    ``shuffle``); ``dropped``: conversations left out (too long with overlong='drop', or no target within the
    first ``seq_length`` tokens); ``efficiency``: the fraction of non-padding tokens in an epoch's rows.
    """

    def __init__(self, index: SFTIndex, conv_ids: np.ndarray, seq_length: int, pad_id: int, packing: bool,
                 overlong: str, seed: int, num_samples: Optional[int], shuffle: bool, split_name: str = "train"):
        self.index, self.seq_length, self.pad_id, self.packing = index, seq_length, pad_id, packing
        self.seed, self.shuffle = seed, shuffle
        sizes = np.asarray(index.tokens.sizes, dtype=np.int64)[conv_ids]
        lengths = np.minimum(sizes, seq_length)
        keep = np.asarray(index.first_target)[conv_ids] < lengths
        if index.grids is not None:  # an image is never cut: a conversation with images is whole or left out
            keep &= (np.asarray(index.grids.sizes, dtype=np.int64)[conv_ids] == 0) | (sizes <= seq_length)
        self.truncated = int(((sizes > seq_length) & keep).sum()) if overlong == "truncate" else 0
        if overlong == "drop":
            keep &= sizes <= seq_length
        self.dropped = int((~keep).sum())
        self.conv_ids, self.lengths = np.asarray(conv_ids)[keep], lengths[keep]
        if not len(self.conv_ids):
            raise DataError(
                f"the {split_name} split has no conversation with a trained token within --seq-length {seq_length} "
                f"({len(conv_ids)} conversations, {self.dropped} left out); raise --seq-length or add data"
            )
        members = pack_best_fit(self.lengths, seq_length) if packing else [[i] for i in range(len(self.conv_ids))]
        self.row_start = np.zeros(len(members) + 1, dtype=np.int64)
        np.cumsum([len(m) for m in members], out=self.row_start[1:])
        self.row_members = np.asarray([i for m in members for i in m], dtype=np.int64)
        self.per_epoch = len(members)
        self.epochs = max(1, -(-num_samples // self.per_epoch)) if num_samples else 1
        self.efficiency = float(self.lengths.sum()) / (self.per_epoch * seq_length)
        self._order: tuple[int, np.ndarray] = (-1, np.arange(0))

    def __len__(self) -> int:
        return self.per_epoch * self.epochs

    def _row(self, i: int) -> int:
        epoch, j = divmod(i, self.per_epoch)
        if not self.shuffle:
            return j
        if self._order[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 2, epoch])))
            self._order = (epoch, rng.permutation(self.per_epoch))
        return int(self._order[1][j])

    def members(self, i: int) -> list[int]:
        """The conversation ids (in the SFTIndex) packed into sample i."""
        r = self._row(i)
        return [int(self.conv_ids[m]) for m in self.row_members[self.row_start[r]: self.row_start[r + 1]]]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        r = self._row(i)
        s = self.seq_length
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        mask = np.zeros(s, dtype=bool)
        docs = np.full(s, -1, dtype=np.int64)
        pos = 0
        for d, m in enumerate(self.row_members[self.row_start[r]: self.row_start[r + 1]].tolist()):
            c, n = int(self.conv_ids[m]), int(self.lengths[m])
            t = self.index.tokens.get(c, 0, n)
            tokens[pos: pos + n] = t
            labels[pos: pos + n - 1] = t[1:]
            mask[pos: pos + n - 1] = self.index.mask.get(c, 1, n - 1).astype(bool)
            docs[pos: pos + n] = d
            pos += n
        out = {"tokens": tokens, "labels": labels, "loss_mask": mask}
        if self.index.grids is not None:
            out.update(self._images(self.row_members[self.row_start[r]: self.row_start[r + 1]].tolist()))
        if self.packing:
            docs[pos:] = docs[pos - 1] + 1  # the padding is a document of its own
            starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
            out["document_ids"] = docs
            out["position_ids"] = np.arange(s) - np.repeat(starts, np.diff(np.r_[starts, s]))
        return out


    def _images(self, members: list[int]) -> dict[str, np.ndarray]:
        """The images of a row's conversations: pixel_values [patches, D], image_grid_thw [images, 3]."""
        pixels, grids = [], []
        for m in members:
            c = int(self.conv_ids[m])
            grid = self.index.grids.get(c).reshape(-1, 3)
            flat = self.index.pixels.get(c)
            pixels.append(flat.reshape(int(grid.prod(-1).sum()), -1) if len(grid) else None)
            grids.append(grid)
        width = next((p.shape[1] for p in pixels if p is not None), 0)
        return {"pixel_values": np.concatenate([p if p is not None else np.zeros((0, width), np.float32)
                                                for p in pixels]),
                "image_grid_thw": np.concatenate(grids).astype(np.int64)}


def split_samples(count: int, what: str, split: str, num_samples: dict[str, int], make) -> dict:
    """Train / valid samples over ``count`` records (conversations, pairs) split by ``split`` weights in file order
    (Megatron's document split): ``make(record ids, wanted, name)`` for each split asked for, None for the others."""
    ranges = split_document_ranges(parse_split(split), count)
    out: dict = {}
    for k, name in enumerate(("train", "valid")):
        wanted = num_samples.get(name, 0)
        if not wanted:
            out[name] = None
            continue
        lo, hi = ranges[k]
        if hi <= lo:
            raise DataError(f"split {name!r} of the {what} has 0 of its {count} records (data.split {split!r}); "
                            "change --split or add data")
        out[name] = make(np.arange(lo, hi), wanted, name)
    return out


def build_sft_datasets(index: SFTIndex, split: str, seq_length: int, num_samples: dict[str, int], seed: int,
                       packing: bool, overlong: str, pad_id: int) -> dict[str, Optional[SFTSamples]]:
    """Train / valid samples of the conversations (``split_samples``)."""
    return split_samples(index.num_conversations, "SFT data", split, num_samples, lambda ids, wanted, name: SFTSamples(
        index, ids, seq_length, pad_id, packing, overlong, seed, wanted, shuffle=name == "train", split_name=name))


IMAGE_KEYS = ("pixel_values", "image_grid_thw")  # a sample's images: concatenated over a batch's rows, not stacked


class SFTLoader(PretrainingLoader):
    """PretrainingLoader's batching and exact-resume position (consumed samples), over SFT sample dicts."""

    def __next__(self) -> dict[str, torch.Tensor]:
        batch_start = self.consumed_samples - self.consumed_samples % self.global_batch_size
        if batch_start + self.global_batch_size > len(self.dataset):
            raise StopIteration
        rows = [self.dataset[i] for i in self.sample_ids()]
        self.consumed_samples += self.micro_batch_size * self.dp_size
        batch = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0] if k not in IMAGE_KEYS}
        if "image_grid_thw" in rows[0]:  # the rows' images, in row order (as M-RoPE meets them)
            grids = [r["image_grid_thw"] for r in rows]
            if sum(len(g) for g in grids):
                pixels = [r["pixel_values"] for r in rows if len(r["pixel_values"])]
                batch["pixel_values"] = torch.from_numpy(np.concatenate(pixels))
                batch["image_grid_thw"] = torch.from_numpy(np.concatenate(grids))
        return batch


def progress_printer(enabled: bool):
    """A rich progress line counting records while an index is built (a no-op when off or not a terminal)."""
    from rich.console import Console

    console = Console(stderr=True)
    if not enabled or not console.is_terminal or not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    @contextlib.contextmanager
    def bar():
        with Progress(SpinnerColumn(), TextColumn("tokenizing SFT records: {task.completed:,}"), TimeElapsedColumn(),
                      console=console, transient=True) as p:
            task = p.add_task("sft", total=None)
            yield lambda n: p.update(task, completed=n)

    return bar()
