"""Tokenize text corpora into Megatron ``.bin/.idx`` datasets (``PREFIX_{key}_document``), fast and bounded.

The main process cuts the inputs into blocks of whole records and writes results in input order; ``workers``
processes parse and tokenize blocks (one at a time each, the Rust engine on their own thread). At most
``2 * workers`` blocks are in flight, so memory does not grow with the input, and the output bytes are the same
whatever the worker count. A failure or an interrupt removes the temporaries: no ``.bin/.idx`` pair is left.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import deque
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megapipe.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from megapipe.data.paths import bin_path, idx_path
from megapipe.data.readers import BLOCK_BYTES, Block, expand_inputs, iter_blocks, parse_block, total_size
from megapipe.data.sidecar import (
    check_data_tokenizer,
    describe,
    merged_tokenizer,
    recorded_tokenizer,
    sidecar_path,
    tokenizer_record,
)
from megapipe.data.tokenizer import Tokenizer
from megapipe.errors import DataError, MegapipeError
from megapipe.fileio import refuse_overlap


@dataclass
class PreprocessStats:
    outputs: dict[str, str] = field(default_factory=dict)  # json key -> output prefix
    documents: int = 0  # records turned into documents
    tokens: int = 0  # over every key, EOD included
    input_bytes: int = 0
    skipped: int = 0  # bad records left out (--skip-bad-records)
    empty: int = 0  # documents with no tokens, left out (as Megatron does)
    seconds: float = 0.0
    skipped_examples: list[str] = field(default_factory=list)
    dtype: str = ""
    backend: str = ""

    def rates(self) -> dict[str, float]:
        s = max(self.seconds, 1e-9)
        return {"docs/s": self.documents / s, "tokens/s": self.tokens / s, "MB/s": self.input_bytes / s / 1e6}


@dataclass
class _Encoded:
    arrays: list[tuple[np.ndarray, np.ndarray]]  # per key: flat tokens, document lengths
    documents: int
    empty: int
    skipped: list[str]
    nbytes: int


def output_prefix(prefix: str | Path, key: str) -> str:
    """Megatron's naming: ``PREFIX_{key}_document``."""
    return f"{prefix}_{key}_document"


def preprocess(
    inputs: list[str],
    output_prefix_: str | Path,
    tokenizer: Tokenizer,
    json_keys: list[str] | tuple[str, ...] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    skip_bad_records: bool = False,
    quiet: bool = True,
    block_bytes: int | None = None,
) -> PreprocessStats:
    """Tokenize every record's ``json_keys`` texts into ``{output_prefix}_{key}_document.bin/.idx``."""
    keys = list(json_keys)
    if not keys or len(set(keys)) != len(keys):
        raise DataError(f"--json-keys must name distinct keys, got {keys}")
    check_workers(workers)
    if append_eod and tokenizer.eod_id is None:
        raise DataError(f"--append-eod needs an end-of-document token, and tokenizer {tokenizer.path} has none")
    paths = expand_inputs(inputs)
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size))
    stats = PreprocessStats(outputs={k: output_prefix(output_prefix_, k) for k in keys}, dtype=str(dtype),
                            backend=tokenizer.backend)
    refuse_overlap([f for p in stats.outputs.values() for f in dataset_files(p)],
                   [*(p for p in paths if p.exists()), *(i for i in inputs if Path(i).exists()), tokenizer.path], DataError)
    record = tokenizer_record(tokenizer)
    job = (tokenizer, keys, append_eod, dtype, skip_bad_records)
    block_bytes = block_bytes or BLOCK_BYTES
    size = total_size(paths)
    if size is not None and size <= block_bytes:
        workers = 1  # one block: starting processes would cost more than it saves (same output either way)
    blocks = iter_blocks(paths, keys, block_bytes)
    start = time.perf_counter()
    with ExitStack() as stack:
        pool = stack.enter_context(_worker_pool(workers, job)) if workers > 1 else None
        stack.enter_context(_sigterm_as_interrupt())
        writers = [stack.enter_context(IndexedDatasetWriter(
            stats.outputs[k], dtype, sidecar={"tokenizer": record, "json_key": k, "append_eod": append_eod}))
            for k in keys]
        progress = stack.enter_context(_Progress(size, quiet))

        def consume(enc: _Encoded) -> None:
            for writer, (flat, lengths) in zip(writers, enc.arrays, strict=True):
                writer.add_documents(flat, lengths)
                stats.tokens += int(flat.size)
            stats.documents += enc.documents
            stats.empty += enc.empty
            stats.skipped += len(enc.skipped)
            stats.skipped_examples += enc.skipped[: max(0, 3 - len(stats.skipped_examples))]
            stats.input_bytes += enc.nbytes
            progress.update(enc.nbytes, stats)

        if pool is None:
            _init_worker(*job, in_pool=False)
            for block in blocks:
                consume(_encode_block(block))
        else:
            pending: deque = deque()
            for block in blocks:
                pending.append(pool.apply_async(_encode_block, (block,)))
                while len(pending) >= 2 * workers:
                    consume(_result(pool, pending.popleft()))
            while pending:
                consume(_result(pool, pending.popleft()))
        if stats.tokens == 0:  # an empty dataset would only fail later, in training, far from the cause
            raise DataError(_nothing_to_write(inputs, keys, stats))
    stats.seconds = time.perf_counter() - start
    return stats


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_workers(workers: int) -> None:
    """At least 1; at most 4 per CPU this process may use (more only add memory and start-up time: each worker
    holds a tokenizer and two blocks in flight)."""
    limit = 4 * available_cpus()
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    if workers > limit:
        raise DataError(f"--workers {workers} is more than 4 per CPU ({available_cpus()} CPUs here, so at most "
                        f"{limit}); more processes only add memory and start-up time")


def _nothing_to_write(inputs: list[str], keys: list[str], stats: PreprocessStats) -> str:
    if stats.documents:
        return f"every one of the {stats.documents:,} records has empty text under {', '.join(keys)}: nothing to write"
    if stats.skipped:
        return (f"every one of the {stats.skipped:,} records was bad and skipped (e.g. {stats.skipped_examples[0]}): "
                "nothing to write")
    return f"the input ({', '.join(inputs)}) holds no records: nothing to write"


# --- workers -------------------------------------------------------------------------------------------------

_JOB: dict = {}
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _init_worker(tokenizer, keys, append_eod, dtype, skip_bad, in_pool=True) -> None:
    if in_pool:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the pool
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _JOB.update(tokenizer=tokenizer, keys=keys, append_eod=append_eod, dtype=dtype, skip_bad=skip_bad)


def _encode_block(block: Block) -> _Encoded:
    tok, keys, skip_bad = _JOB["tokenizer"], _JOB["keys"], _JOB["skip_bad"]
    texts, numbers, skipped = parse_block(block, keys, skip_bad)
    try:
        encoded = [tok.encode_batch_arrays(col, parallel=False) for col in texts]
    except Exception:  # text that is not valid Unicode (lone surrogates from JSON escapes) ends here
        if not _drop_unencodable(block, keys, texts, numbers, skipped, skip_bad):
            raise
        encoded = [tok.encode_batch_arrays(col, parallel=False) for col in texts]
    arrays, empty = [], 0
    for flat, offsets in encoded:
        lengths = np.diff(offsets)
        keep = lengths > 0  # a document without tokens is left out, as Megatron does
        empty += int((~keep).sum())
        lengths = lengths[keep]
        if _JOB["append_eod"]:
            flat = np.insert(flat, offsets[1:][keep], _JOB["tokenizer"].eod_id)
            lengths = lengths + 1
        arrays.append((flat.astype(_JOB["dtype"], copy=False), lengths))
    return _Encoded(arrays, len(texts[0]), empty, skipped, block.nbytes)


def _drop_unencodable(block, keys, texts, numbers, skipped, skip_bad) -> bool:
    """Remove (in place) the records whose text cannot be encoded as UTF-8; False when there are none."""
    bad = set()
    for k, col in zip(keys, texts, strict=True):
        for i, t in enumerate(col):
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                where = f"{block.source}:{numbers[i]}"
                if not skip_bad:
                    raise DataError(f"{where}: the record has text under '{k}' that is not valid Unicode "
                                    "(a lone surrogate escape); fix it or pass --skip-bad-records") from None
                if i not in bad:
                    skipped.append(f"{where}: text under '{k}' is not valid Unicode")
                bad.add(i)
    for col in texts:
        col[:] = [t for i, t in enumerate(col) if i not in bad]
    return bool(bad)


def _worker_pids(pool) -> set[int]:
    """The pool's worker processes. multiprocessing.Pool has no public way to list them (its ``_pool`` list is
    private), and without it a worker that died would leave its block's result waiting forever."""
    return {p.pid for p in pool._pool}


def _result(pool, result):
    """A block's result. multiprocessing.Pool replaces a worker that died (out of memory, killed) and loses its
    block, whose result then never comes: notice that instead of waiting forever."""
    workers = _worker_pids(pool)
    while True:
        try:
            return result.get(timeout=0.25)
        except mp.TimeoutError:
            if _worker_pids(pool) != workers:
                raise MegapipeError("a preprocess worker process died (out of memory? killed?); nothing was "
                                    "written") from None


@contextmanager
def _worker_pool(workers: int, job: tuple):
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    # The pool's helper threads must not take SIGINT/SIGTERM: a signal they take leaves the main thread blocked
    # in a read, never interrupted. They inherit the mask in place while they start; workers clear it.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=job)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        yield pool
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()


@contextmanager
def _sigterm_as_interrupt():
    """SIGTERM unwinds like Ctrl-C, so the writers remove their temporaries."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Progress:
    """A rich progress bar over input bytes (ETA when the size is known) with docs/s, tokens/s, MB/s."""

    def __init__(self, total: int | None, quiet: bool):
        self.bar = None
        if quiet:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        columns = [TextColumn("[bold]preprocess"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                   TextColumn("{task.fields[rates]}")]
        self.bar = Progress(*columns, console=Console(stderr=True), transient=False)
        self.task = self.bar.add_task("preprocess", total=total, rates="")
        self.start = time.perf_counter()

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.bar is None:
            pass
        elif exc_type is None:
            self.bar.stop()
        else:  # on failure, only the error line remains
            self.bar.live.transient = True
            self.bar.live.stop()

    def update(self, nbytes: int, stats: PreprocessStats) -> None:
        if self.bar is None:
            return
        s = max(time.perf_counter() - self.start, 1e-9)
        rates = (f"{stats.documents / s:,.0f} docs/s  {stats.tokens / s:,.0f} tok/s  "
                 f"{stats.input_bytes / s / 1e6:,.1f} MB/s")
        self.bar.update(self.task, advance=nbytes, rates=rates)


def summary_rows(stats: PreprocessStats) -> list[tuple[str, str]]:
    r = stats.rates()
    rows = [
        ("documents", f"{stats.documents:,}"),
        ("tokens", f"{stats.tokens:,}"),
        ("input", f"{stats.input_bytes / 1e6:,.2f} MB"),
        ("skipped records", f"{stats.skipped:,}"),
        ("empty documents left out", f"{stats.empty:,}"),
        ("time", f"{stats.seconds:,.2f} s"),
        ("rate", f"{r['docs/s']:,.0f} docs/s, {r['tokens/s']:,.0f} tokens/s, {r['MB/s']:,.1f} MB/s"),
        ("token dtype / backend", f"{stats.dtype} / {stats.backend}"),
    ]
    rows += [(f"output ({k})", f"{p}.bin/.idx") for k, p in stats.outputs.items()]
    return rows


# --- merge and inspect ---------------------------------------------------------------------------------------

def resolve_prefixes(inputs: list[str]) -> list[str]:
    """Dataset prefixes from prefixes, ``.bin``/``.idx`` names, or directories (every pair inside, sorted)."""
    prefixes: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(str(i.with_suffix("")) for i in p.glob("*.idx") if i.with_suffix(".bin").is_file())
            if not found:
                raise DataError(f"directory {item} holds no .bin/.idx dataset")
            prefixes += found
            continue
        prefix = item[:-4] if item.endswith((".bin", ".idx")) else item
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise DataError(f"dataset {prefix} has no {prefix + suffix}")
        prefixes.append(prefix)
    return prefixes


def dataset_files(prefix: str | Path) -> list[Path]:
    """The files a dataset at ``prefix`` consists of (the pair and its sidecar)."""
    return [bin_path(prefix), idx_path(prefix), sidecar_path(prefix)]


def merge_datasets(inputs: list[str], output_prefix_: str | Path, overwrite: bool = False,
                   allow_mixed_tokenizers: bool = False) -> IndexedDataset:
    """Concatenate datasets (documents in the order given) into one, like Megatron's merge_datasets. The output
    may not be one of the inputs nor lie inside an input directory; an existing output needs ``overwrite``; inputs
    tokenized with different tokenizers need ``allow_mixed_tokenizers``."""
    prefixes = resolve_prefixes(inputs)
    if not prefixes:
        raise DataError("no dataset to merge (pass --input PREFIX...)")
    refuse_overlap(dataset_files(output_prefix_),
                   [f for p in prefixes for f in (bin_path(p), idx_path(p))] + [i for i in inputs if Path(i).is_dir()],
                   DataError)
    existing = [str(f) for f in (bin_path(output_prefix_), idx_path(output_prefix_)) if f.exists()]
    if existing and not overwrite:
        raise DataError(f"output {existing[0]} already exists: pick another --output-prefix or pass --overwrite")
    datasets = [IndexedDataset(p) for p in prefixes]  # every input checked before anything is written
    dtypes = {str(d.dtype) for d in datasets}
    if len(dtypes) > 1:
        other = next(d for d in datasets if d.dtype != datasets[0].dtype)
        raise DataError(f"cannot merge {other.prefix}: its tokens are {other.dtype}, those of {datasets[0].prefix} "
                        f"are {datasets[0].dtype} (all inputs must share one token dtype)")
    tokenizer = merged_tokenizer(prefixes, allow_mixed_tokenizers)
    sidecar = {"tokenizer": tokenizer, "merged_from": [str(Path(p).absolute()) for p in prefixes]}
    with IndexedDatasetWriter(output_prefix_, datasets[0].dtype, sidecar=sidecar) as writer:
        for prefix in prefixes:
            writer.add_dataset(prefix)
    return IndexedDataset(output_prefix_)


def inspect_dataset(prefix: str, tokenizer: Tokenizer | None = None, sample_tokens: int = 64) -> dict:
    """Counts, dtype, length statistics and (with a tokenizer) the start of the first document decoded."""
    ds = IndexedDataset(resolve_prefixes([prefix])[0])
    recorded = recorded_tokenizer(ds.prefix)
    if tokenizer is not None:
        check_data_tokenizer([ds.prefix], tokenizer, hint="or decode it with the tokenizer that made it")
    sizes = ds.sizes
    info = {
        "prefix": ds.prefix,
        "documents": ds.num_documents,
        "sequences": len(ds),
        "tokens": ds.num_tokens,
        "dtype": str(ds.dtype),
        "min_length": int(sizes.min()) if len(sizes) else 0,
        "mean_length": float(sizes.mean()) if len(sizes) else 0.0,
        "max_length": int(sizes.max()) if len(sizes) else 0,
        "tokenizer": describe(recorded) if recorded else f"not recorded (no {sidecar_path(ds.prefix).name})",
    }
    if tokenizer is not None and len(ds):
        ids = ds.get(0, 0, min(int(sizes[0]), sample_tokens))
        if int(ids.max(initial=0)) >= tokenizer.vocab_size:
            raise DataError(f"dataset {prefix} holds token id {int(ids.max())}, beyond the vocabulary "
                            f"({tokenizer.vocab_size}) of tokenizer {tokenizer.path}")
        info["sample"] = tokenizer.decode(ids.tolist())
    return info
