"""Time building vs loading the GPT dataset indices on a random 100M-token store (or --tokens N).

    .venv/bin/python tools/bench_dataset_index.py [--tokens 100_000_000] [--seq-length 1024] [--epochs 3]

Writes a random ``.bin/.idx`` pair under a temporary directory in /tmp (removed at the end), then times:
the first ``build_gpt_datasets`` (builds and caches every index), the second (loads the cache memory-mapped),
reading samples, and, as the baseline for the sample index, Megatron's C++ ``build_sample_idx`` on the same document
index when megatron-core's compiled helpers are installed. Prints each time and the ratios.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import tempfile
import time

import numpy as np

from megapipe.data.blend import build_blend_index
from megapipe.data.gpt_dataset import build_gpt_datasets, build_sample_index
from megapipe.data.indexed import IndexedDatasetWriter


def megatron_helpers():
    spec = importlib.util.find_spec("megatron")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    found = [f for d in dirs for f in glob.glob(os.path.join(d, "core", "datasets", "helpers_cpp*.so"))]
    if not found:
        return None
    module_spec = importlib.util.spec_from_file_location("helpers_cpp", found[0])
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000_000)
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--epochs", type=float, default=3.0, help="train samples requested, in epochs of the train split")
    ap.add_argument("--mean-doc-length", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="megapipe_bench_dataset_", dir="/tmp")
    try:
        rng = np.random.default_rng(0)
        lengths = rng.geometric(1 / args.mean_doc_length, size=2 * args.tokens // args.mean_doc_length + 16)
        lengths = lengths[: np.searchsorted(np.cumsum(lengths), args.tokens) + 1]
        lengths[-1] -= int(lengths.sum()) - args.tokens
        prefix = os.path.join(work, "random_text_document")

        def write():
            with IndexedDatasetWriter(prefix, np.uint16) as w:
                w.add_documents(rng.integers(0, 50_000, args.tokens, dtype=np.uint16), lengths)

        _, t_write = timed(write)
        print(f"store: {args.tokens:,} tokens in {len(lengths):,} documents, written in {t_write:.2f}s")

        train_tokens = args.tokens * 0.96  # a little under the 96.9% split, which is by document
        num = {"train": int(args.epochs * train_tokens / args.seq_length), "valid": 1000, "test": 10}
        cache = os.path.join(work, "cache")
        build = lambda: build_gpt_datasets([prefix], "969,30,1", args.seq_length, num, args.seed, cache)  # noqa: E731
        built, t_build = timed(build)
        loaded, t_load = timed(build)
        assert not built["train"].cache_hit and loaded["train"].cache_hit
        train = loaded["train"]
        print(f"train: {num['train']:,} samples requested; built {len(train):,} samples of {args.seq_length + 1} "
              f"tokens = {train.num_epochs} whole epochs of its {train.num_tokens:,} tokens")
        print(f"build (first call, writes the cache): {t_build:.3f}s")
        print(f"load  (second call, cache memory-mapped): {t_load:.4f}s   build/load = {t_build / t_load:.0f}x")

        picks = np.random.default_rng(1).integers(0, len(train), 10_000)
        _, t_read = timed(lambda: [train[int(i)] for i in picks])
        print(f"read 10,000 random samples: {t_read:.3f}s ({10_000 / t_read:,.0f} samples/s)")

        docs = np.asarray(train.document_index)
        stream = train.store.length[docs]
        n_samples = len(train.sample_index) - 1
        ours, t_ours = timed(lambda: build_sample_index(stream, args.seq_length, n_samples))
        helpers = megatron_helpers()
        if helpers is not None:
            sizes = train.store.length.astype(np.int32)
            doc_epochs = len(docs) // (train.doc_range[1] - train.doc_range[0])
            per_epoch = train.num_tokens
            ref, t_ref = timed(lambda: helpers.build_sample_idx_int32(
                sizes, docs.astype(np.int32), args.seq_length, doc_epochs, per_epoch, True, 1))
            same = np.array_equal(ref[: n_samples + 1], ours)
            print(f"sample index: numpy {t_ours:.3f}s vs Megatron C++ build_sample_idx {t_ref:.3f}s "
                  f"(baseline), ratio {t_ours / t_ref:.2f}x, identical: {same}")
        else:
            print(f"sample index: numpy {t_ours:.3f}s (megatron-core helpers not installed: no C++ baseline)")
        _, t_blend = timed(lambda: build_blend_index([0.7, 0.3], len(train)))
        print(f"blend index for {len(train):,} samples of two prefixes: {t_blend:.3f}s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
