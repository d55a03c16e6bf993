"""Weighted blending of several sample datasets into one, in a fixed deterministic order.

Two prefixes: sample n goes to the one whose next sample is most overdue, prefix d's k-th sample being due at
(k + 0.5) / weight_d (ties: the first prefix). That is a greedy pick like Megatron's largest-error rule, but because
the due times are fixed in advance the whole index is one sort instead of a loop over samples; after any n samples
each prefix holds n * weight ± 0.5. More prefixes: they are paired up Huffman-style (the two lightest first) into a
binary tree, each node splits its samples between its two children that way, so the index costs O(n log D). Measured
against Megatron's C++ greedy, the largest deviation from n * weight stays about one sample as there (≤ 1.23 on
random, skewed and equal blends of up to 100 prefixes), so shares are within 1% of the weights from the 100th sample
on. The first n samples never depend on the total size (extending a run keeps the order).
"""

from __future__ import annotations

import heapq
import math

import numpy as np


def normalize_weights(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def split_two(w0: float, w1: float, size: int) -> np.ndarray:
    """0/1 per sample: the first ``size`` picks of the two-way most-overdue-first merge."""
    w = normalize_weights([w0, w1])
    due0, due1 = [(np.arange(min(size, math.ceil(size * wd) + 2), dtype=np.float64) + 0.5) / wd for wd in w]
    # the k-th pick of side 0 comes after k picks of its own and every side-1 pick due strictly earlier
    at = np.arange(len(due0)) + np.searchsorted(due1, due0, side="left")
    side = np.ones(size, dtype=np.int8)
    side[at[at < size]] = 0
    return side


def _pairing_tree(w: np.ndarray):
    """Huffman tree over the prefixes: a leaf is an int, a node a (weight, left, right) tuple."""
    heap = [(float(wd), d, d) for d, wd in enumerate(w)]  # (weight, lowest prefix id inside, tree)
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = sorted([heapq.heappop(heap), heapq.heappop(heap)], key=lambda t: t[1])  # ties: the earlier prefixes
        heapq.heappush(heap, (a[0] + b[0], a[1], (a[0], b[0], a[2], b[2])))
    return heap[0][2]


def build_blend_index(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)`` of the first ``size`` blended samples for positive ``weights``."""
    w = normalize_weights(weights)
    dataset_index = np.empty(size, dtype=np.int16 if len(w) < 2**15 else np.int32)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    todo = [(_pairing_tree(w), np.arange(size, dtype=np.int64))]
    while todo:
        tree, positions = todo.pop()
        if isinstance(tree, int):
            dataset_index[positions] = tree
            dataset_sample_index[positions] = np.arange(len(positions))  # positions are increasing
            continue
        w_left, w_right, left, right = tree
        side = split_two(w_left, w_right, len(positions))
        todo += [(left, positions[side == 0]), (right, positions[side == 1])]
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """``blend[i]`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``; length = the requested size."""

    def __init__(self, datasets: list, weights, dataset_index: np.ndarray, dataset_sample_index: np.ndarray,
                 index_cache_hit: bool = False):
        self.datasets = datasets  # None where a prefix contributes no sample
        self.index_cache_hit = index_cache_hit
        self.weights = normalize_weights(weights)
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    @property
    def cache_hit(self) -> bool:
        """True when this blend and every part of it were loaded from the index cache, nothing rebuilt."""
        return self.index_cache_hit and all(d.cache_hit for d in self.datasets if d is not None)
