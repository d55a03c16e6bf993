"""PretrainingLoader: batch contents and order, data-parallel slices, exact resume, the end, bad sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megapipe.data.gpt_dataset import build_gpt_datasets
from megapipe.data.indexed import IndexedDatasetWriter
from megapipe.data.loader import PretrainingLoader
from megapipe.errors import ConfigError

SEQ = 6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("loader")
    lengths = np.random.default_rng(0).integers(1, 30, 40)
    with IndexedDatasetWriter(d / "a", np.int32) as w:
        w.add_documents(np.arange(lengths.sum()), lengths)
    return build_gpt_datasets([str(d / "a")], "1", SEQ, {"train": 100}, 7, str(d / "cache"))["train"]


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_micro_batches_are_consecutive_samples_shifted_into_labels(dataset):
    loader = PretrainingLoader(dataset, micro_batch_size=2, global_batch_size=8, dp_rank=0, dp_size=1)
    assert loader.num_microbatches == 4
    batches = take(loader, 6)
    for k, b in enumerate(batches):
        assert b["tokens"].dtype == torch.long and b["tokens"].shape == (2, SEQ) and b["labels"].shape == (2, SEQ)
        samples = np.stack([dataset[2 * k], dataset[2 * k + 1]])
        assert np.array_equal(b["tokens"].numpy(), samples[:, :-1])
        assert np.array_equal(b["labels"].numpy(), samples[:, 1:])
    assert loader.state_dict() == {"consumed_samples": 12}


def test_data_parallel_ranks_split_the_same_global_batches(dataset):
    single = take(PretrainingLoader(dataset, 2, 8, 0, 1), 8)  # two global batches
    ranks = [PretrainingLoader(dataset, 2, 8, r, 2) for r in range(2)]
    assert ranks[0].num_microbatches == 2
    per_rank = [take(loader, 4) for loader in ranks]
    union = [per_rank[r][m]["tokens"] for m in range(4) for r in range(2)]
    assert torch.equal(torch.cat(union), torch.cat([b["tokens"] for b in single]))
    seen = [set(torch.cat([b["tokens"][:, 0] for b in batches]).tolist()) for batches in per_rank]
    assert not seen[0] & seen[1]
    assert ranks[0].state_dict() == ranks[1].state_dict() == {"consumed_samples": 16}


def test_resume_continues_exactly(dataset):
    straight = take(PretrainingLoader(dataset, 2, 8, 1, 2), 10)
    first = PretrainingLoader(dataset, 2, 8, 1, 2)
    take(first, 3)  # stop in the middle of a global batch
    state = first.state_dict()
    resumed = PretrainingLoader(dataset, 2, 8, 1, 2, consumed_samples=state["consumed_samples"])
    reloaded = PretrainingLoader(dataset, 2, 8, 1, 2)
    reloaded.load_state_dict(state)
    for loader in (resumed, reloaded):
        rest = take(loader, 7)
        for a, b in zip(straight[3:], rest, strict=True):
            assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])


def test_stops_after_the_last_whole_global_batch(dataset):
    loader = PretrainingLoader(dataset, 2, 8, 0, 2)
    batches = list(loader)
    assert len(batches) == len(dataset) // 8 * loader.num_microbatches
    assert loader.state_dict()["consumed_samples"] == len(dataset) // 8 * 8
    with pytest.raises(StopIteration):
        next(loader)


@pytest.mark.parametrize(
    ("mbs", "gbs", "rank", "size", "match"),
    [(3, 8, 0, 1, "multiple of train.micro_batch_size 3"), (2, 2, 0, 2, "global_batch_size 2"),
     (0, 8, 0, 1, "micro_batch_size >= 1"), (2, 8, 2, 2, "dp_rank < dp_size")],
)
def test_bad_batch_sizes(dataset, mbs, gbs, rank, size, match):
    with pytest.raises(ConfigError, match=match):
        PretrainingLoader(dataset, mbs, gbs, rank, size)
