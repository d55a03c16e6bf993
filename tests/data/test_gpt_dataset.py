"""GPT sample indices, splits, blending, the index cache and its errors, on tiny stores of unique token ids.

Every token of a test store is its own global position plus an offset (``base + arange``), so a token says exactly
which document and position of which prefix it came from.
"""

from __future__ import annotations

import glob
import importlib.util
import multiprocessing as mp
import os

import numpy as np
import pytest

from megapipe.config import parse_data_path
from megapipe.data.blend import build_blend_index
from megapipe.data.gpt_dataset import build_gpt_datasets, build_sample_index, parse_split, split_document_ranges
from megapipe.data.indexed import IndexedDatasetWriter
from megapipe.errors import DataError


def make_store(path, lengths, base=0) -> str:
    lengths = np.asarray(lengths, dtype=np.int64)
    with IndexedDatasetWriter(path, np.int32) as w:
        w.add_documents(base + np.arange(lengths.sum()), lengths)
    return str(path)


def file_times(root) -> dict[str, int]:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(root) for f in fs}


def all_samples(ds) -> np.ndarray:
    return np.stack([ds[i] for i in range(len(ds))])


# ------------------------------------------------------------------------------------------------ sample index
def naive_sample_index(stream_lengths, seq_length, num_samples):
    """Megatron's build_sample_idx (extra token on), one token at a time."""
    out, pos, off = [(0, 0)], 0, 0
    for _ in range(num_samples):
        need = seq_length  # walk seq_length tokens forward to the next sample's first token
        while True:
            left = stream_lengths[pos] - off
            if need < left:
                off += need
                break
            need -= left
            pos, off = pos + 1, 0
        out.append((pos, off))
    return np.array(out)


def test_sample_index_matches_naive_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = rng.integers(0, 12, rng.integers(1, 15))
        lengths[rng.integers(len(lengths))] += 2
        seq = int(rng.integers(1, 10))
        n = (int(lengths.sum()) - 1) // seq
        assert np.array_equal(build_sample_index(lengths, seq, n), naive_sample_index(lengths, seq, n))


def megatron_helpers():
    """Megatron's compiled dataset helpers, loaded alone (importing megatron.core would pull in everything)."""
    spec = importlib.util.find_spec("megatron")
    dirs = list(spec.submodule_search_locations or []) if spec else []
    found = [f for d in dirs for f in glob.glob(os.path.join(d, "core", "datasets", "helpers_cpp*.so"))]
    if not found:
        pytest.skip("megatron-core's compiled dataset helpers are not installed")
    module_spec = importlib.util.spec_from_file_location("helpers_cpp", found[0])
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_sample_index_matches_megatron_cpp_helper():
    helpers = megatron_helpers()
    rng = np.random.default_rng(1)
    for _ in range(300):
        sizes = rng.integers(0, 15, rng.integers(1, 20)).astype(np.int32)
        sizes[0] = max(sizes[0], 2)
        epochs, seq = int(rng.integers(1, 4)), int(rng.integers(2, 12))
        doc_idx = np.concatenate([rng.permutation(len(sizes)) for _ in range(epochs)]).astype(np.int32)
        tokens = int(sizes.sum())
        ref = helpers.build_sample_idx_int64(sizes, doc_idx, seq, epochs, tokens, True, 1)
        ours = build_sample_index(sizes[doc_idx].astype(np.int64), seq, (epochs * tokens - 1) // seq)
        assert np.array_equal(ref, ours)


# ----------------------------------------------------------------------------------------------- coverage
def test_one_epoch_covers_every_token_once_and_samples_chain(tmp_path):
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 40, 30)
    prefix = make_store(tmp_path / "a", lengths)
    seq = 7
    ds = build_gpt_datasets([prefix], "1", seq, {"train": None}, 5, str(tmp_path / "c"))["train"]
    total = int(lengths.sum())
    assert ds.num_epochs == 1 and len(ds) == -(-total // seq)
    samples = all_samples(ds)
    assert samples.shape == (len(ds), seq + 1) and samples.dtype == np.int64
    counts = np.bincount(samples[:, :-1].ravel(), minlength=total)
    # every token once; the last sample runs a few tokens into the next epoch's first documents
    assert counts.min() == 1 and counts.sum() == len(ds) * seq
    assert (counts == 2).sum() == len(ds) * seq - total and counts.max() <= 2
    # in stream order consecutive samples share one token, and a sample never jumps inside a document
    stream = samples[np.argsort(np.asarray(ds.shuffle_index))]
    assert np.array_equal(stream[1:, 0], stream[:-1, -1])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    jumps = np.diff(samples, axis=1) != 1  # a jump is only allowed from a document's last token to a first one
    assert np.all(np.isin(samples[:, :-1][jumps] + 1, starts) & np.isin(samples[:, 1:][jumps], starts))


def test_several_epochs_each_cover_every_token(tmp_path):
    lengths = [5, 17, 3, 30, 9, 16]  # 80 tokens, seq 8 divides them: epochs end on sample boundaries
    prefix = make_store(tmp_path / "a", lengths)
    ds = build_gpt_datasets([prefix], "1", 8, {"train": 25}, 3, str(tmp_path / "c"))["train"]
    assert ds.num_epochs == 3 and len(ds) == 30  # 25 samples need 3 epochs of 10, all built
    samples = all_samples(ds)
    for e in range(3):  # the shuffled order keeps epochs apart: samples 10e..10e+9 are exactly epoch e
        assert np.array_equal(np.sort(samples[10 * e : 10 * (e + 1), :-1].ravel()), np.arange(80))
    # a document's order differs between epochs, and the shuffles differ too
    assert not np.array_equal(samples[:10], samples[10:20])


def test_more_samples_keep_the_first_ones(tmp_path):
    prefix = make_store(tmp_path / "a", [13, 8, 21, 5, 40])
    small = build_gpt_datasets([prefix], "1", 6, {"train": 10}, 9, str(tmp_path / "c"))["train"]
    large = build_gpt_datasets([prefix], "1", 6, {"train": 100}, 9, str(tmp_path / "c"))["train"]
    assert len(large) > len(small)
    assert np.array_equal(all_samples(small), np.stack([large[i] for i in range(len(small))]))


def test_splits_never_share_documents(tmp_path):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 30, 50)
    prefix = make_store(tmp_path / "a", lengths)
    out = build_gpt_datasets([prefix], "80,15,5", 5, {"train": 300, "valid": 40, "test": 20}, 1, str(tmp_path / "c"))
    ranges = split_document_ranges(parse_split("80,15,5"), 50)
    assert ranges == [(0, 40), (40, 48), (48, 50)]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for name, (lo, hi) in zip(("train", "valid", "test"), ranges, strict=True):
        samples = all_samples(out[name])
        assert samples.min() >= starts[lo] and samples.max() < starts[hi], name
        assert len(np.unique(samples)) == starts[hi] - starts[lo]  # and it sees all of them


def test_megatron_split_rounding_and_empty_splits(tmp_path):
    assert split_document_ranges(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(parse_split("969,30,1"), 10) == [(0, 10), (10, 10), (10, 10)]
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    prefix = make_store(tmp_path / "a", [10] * 10)
    out = build_gpt_datasets([prefix], "969,30,1", 4, {"train": 5, "valid": 0}, 1, str(tmp_path / "c"))
    assert out["valid"] is None and out["test"] is None and len(out["train"]) >= 5


def test_shuffle_is_deterministic_per_seed(tmp_path):
    prefix = make_store(tmp_path / "a", [n for n in range(1, 40) if n != 4])  # 776 tokens: 97 samples of 8
    a = all_samples(build_gpt_datasets([prefix], "1", 8, {"train": 200}, 11, str(tmp_path / "c1"))["train"])
    b = all_samples(build_gpt_datasets([prefix], "1", 8, {"train": 200}, 11, str(tmp_path / "c2"))["train"])
    c = all_samples(build_gpt_datasets([prefix], "1", 8, {"train": 200}, 12, str(tmp_path / "c1"))["train"])
    assert np.array_equal(a, b)
    assert a.shape == c.shape and not np.array_equal(a, c)
    assert np.array_equal(np.sort(a[:, :-1].ravel()), np.sort(c[:, :-1].ravel()))  # same tokens, other order


# ---------------------------------------------------------------------------------------------------- blending
def naive_two_way(weights, size):
    w = np.asarray(weights, float) / sum(weights)
    taken = np.zeros(2, int)
    out = []
    for _ in range(size):
        d = int(np.argmin((taken + 0.5) / w))  # most overdue prefix; ties to the first
        out.append((d, taken[d]))
        taken[d] += 1
    return np.array(out)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1], [0.01, 0.99], [1, 2]])
def test_two_way_blend_matches_naive_loop(weights):
    dataset_index, dataset_sample_index = build_blend_index(weights, 2000)
    ref = naive_two_way(weights, 2000)
    assert np.array_equal(dataset_index, ref[:, 0]) and np.array_equal(dataset_sample_index, ref[:, 1])


@pytest.mark.parametrize(
    "weights",
    [[0.7, 0.3], [0.5, 0.3, 0.2], [3, 1, 1, 5, 0.1], [1] * 64, [50] + [1] * 50,
     list(np.random.default_rng(0).lognormal(0, 2, 100))],
)
def test_blend_keeps_every_share_within_one_sample(weights):
    size = 5000
    dataset_index, dataset_sample_index = build_blend_index(weights, size)
    w = np.asarray(weights) / sum(weights)
    onehot = np.eye(len(w), dtype=np.int32)[dataset_index]
    counts = np.cumsum(onehot, axis=0)
    assert np.array_equal(dataset_sample_index, (counts * onehot).sum(1) - 1)  # each prefix's samples in order
    n = np.arange(1, size + 1)[:, None]
    assert np.abs(counts - n * w).max() <= 1.25  # Megatron's C++ greedy: about 1 on these
    assert np.abs(counts / n - w)[99:].max() <= 0.01  # within 1% from the 100th sample on
    assert np.array_equal(build_blend_index(weights, 1000)[0], dataset_index[:1000])  # a longer blend extends it


def test_weighted_blend_of_two_prefixes(tmp_path):
    a = make_store(tmp_path / "a", [20] * 30)
    b = make_store(tmp_path / "b", [15] * 10, base=1_000_000)
    out = build_gpt_datasets(["0.7", a, "0.3", b], "9,1,0", 4, {"train": 500, "valid": 20}, 2, str(tmp_path / "c"))
    train = out["train"]
    assert len(train) == 500 and len(out["valid"]) == 20
    from_b = (all_samples(train)[:, 0] >= 1_000_000).astype(float)
    share = np.cumsum(from_b) / np.arange(1, 501)
    assert np.abs(share[99:] - 0.3).max() <= 0.01
    # each part was sized to what the blend takes from it, over whole epochs (b's train split is 135 tokens)
    parts = train.datasets
    assert int(from_b.sum()) == 150 and len(parts[1]) >= 150 and parts[1].num_epochs == 5


def test_unweighted_list_blends_by_tokens(tmp_path):
    a = make_store(tmp_path / "a", [30] * 30)  # 900 tokens
    b = make_store(tmp_path / "b", [30] * 10, base=1_000_000)  # 300 tokens
    assert parse_data_path([a, b]) == ([a, b], None)
    assert parse_data_path([f"0.7 {a}", f" 0.3  {b}"]) == ([a, b], [0.7, 0.3])
    train = build_gpt_datasets([a, b], "1", 6, {"train": 400}, 2, str(tmp_path / "c"))["train"]
    assert train.weights.tolist() == [0.75, 0.25]
    assert (all_samples(train)[:, 0] >= 1_000_000).sum() == 100


# -------------------------------------------------------------------------------------------------------- cache
def test_cache_is_reused_and_invalidated(tmp_path):
    a = make_store(tmp_path / "a", [25] * 20)
    b = make_store(tmp_path / "b", [10] * 20, base=10_000)
    cache = str(tmp_path / "c")
    args = (["0.6", a, "0.4", b], "1", 5, {"train": 150}, 4, cache)
    first = build_gpt_datasets(*args)["train"]
    assert not first.cache_hit
    entries = sorted(os.listdir(cache))
    assert sorted(e.split("-")[0] for e in entries) == ["blend", "gpt", "gpt"]
    before = file_times(cache)
    second = build_gpt_datasets(*args)["train"]
    assert second.cache_hit and file_times(cache) == before  # nothing rewritten, nothing added
    assert isinstance(second.datasets[0].shuffle_index.base, np.memmap)  # loaded memory-mapped, not read
    assert np.array_equal(all_samples(first), all_samples(second))
    # a few more samples within the same epochs reuse the index of each part
    assert build_gpt_datasets(*args[:3], {"train": 151}, *args[4:])["train"].datasets[0].cache_hit
    # rewriting a prefix (same tokens even) makes a new key for its indices, the other prefix's stay
    make_store(tmp_path / "b", [10] * 20, base=10_000)
    third = build_gpt_datasets(*args)["train"]
    assert third.datasets[0].cache_hit and not third.datasets[1].cache_hit
    assert third.datasets[1].cache_path != second.datasets[1].cache_path
    assert not [e for e in os.listdir(cache) if ".tmp-" in e]


def test_default_cache_lives_next_to_the_data(tmp_path):
    a = make_store(tmp_path / "a", [25] * 4)
    ds = build_gpt_datasets([a], "1", 5, {"train": 10}, 4, None)["train"]
    assert ds.cache_path.parent == tmp_path / "megapipe_index_cache"


def _build_in_child(args, queue):
    ds = build_gpt_datasets(*args)["train"]
    queue.put((ds.cache_hit, ds[0].tolist()))


def test_concurrent_processes_build_once(tmp_path):
    a = make_store(tmp_path / "a", [50] * 200)
    args = ([a], "1", 16, {"train": 20_000}, 4, str(tmp_path / "c"))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(args, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(hit for hit, _ in results) == [False, True]  # one built, the other waited and loaded
    assert results[0][1] == results[1][1]


def _dist_worker(rank, store_path, args, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        ds = build_gpt_datasets(*args)["train"]
        queue.put((rank, ds.cache_hit, ds[3].tolist()))
    finally:
        dist.destroy_process_group()


def test_rank0_builds_and_other_ranks_load(tmp_path):
    pytest.importorskip("torch")
    a = make_store(tmp_path / "a", [40] * 50)
    args = ([a], "1", 8, {"train": 300}, 4, str(tmp_path / "c"))
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_dist_worker, args=(r, str(tmp_path / "store"), args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [(r, hit) for r, hit, _ in results] == [(0, False), (1, True)]
    assert results[0][2] == results[1][2]


# -------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("data_path", "split", "seq", "num", "match"),
    [
        ([], "1", 4, {"train": 1}, "data_path is empty"),
        (["{d}/missing"], "1", 4, {"train": 1}, "not found"),
        (["0.7", "{a}", "{a}"], "1", 4, {"train": 1}, "malformed"),
        (["0.7", "{a}", "0.3"], "1", 4, {"train": 1}, "malformed"),
        (["0.5", "{a}", "0.5", "{a}"], "1", 4, {"train": 1}, "more than once"),
        (["{a}.bin"], "1", 4, {"train": 1}, "without .bin/.idx"),
        (["0", "{a}"], "1", 4, {"train": 1}, "must be a positive number"),
        (["-1", "{a}"], "1", 4, {"train": 1}, "must be a positive number"),
        (["{a}"], "a,b", 4, {"train": 1}, "data.split 'a,b'"),
        (["{a}"], "1,2,3,4", 4, {"train": 1}, "up to three"),
        (["{a}"], "-1,2", 4, {"train": 1}, "non-negative"),
        (["{a}"], "0,0,0", 4, {"train": 1}, "every split weight 0"),
        (["{a}"], "1", 0, {"train": 1}, "seq_length 0"),
        (["{a}"], "1", 4, {"training": 1}, "unknown split 'training'"),
        (["{a}"], "1", 4, {"train": -3}, "non-negative integer"),
        (["{a}"], "99,1", 4, {"train": 10, "valid": 5}, "split 'valid' of .* has 0 of its 10 documents"),
        (["{e}"], "1", 4, {"train": 1}, "has no tokens"),
    ],
)
def test_bad_inputs_raise_one_clear_error(tmp_path, data_path, split, seq, num, match):
    a = make_store(tmp_path / "a", [10] * 10)
    e = make_store(tmp_path / "e", [0, 0])
    data_path = [p.format(a=a, d=tmp_path, e=e) for p in data_path]
    with pytest.raises(DataError, match=match):
        build_gpt_datasets(data_path, split, seq, num, 1, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists() or not [n for n in os.listdir(tmp_path / "c") if ".tmp-" in n]


def test_unwritable_explicit_cache_dir_is_an_error(tmp_path):
    a = make_store(tmp_path / "a", [10] * 10)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataError, match="data.cache_dir"):
        build_gpt_datasets([a], "1", 4, {"train": 5}, 1, str(blocker / "cache"))
