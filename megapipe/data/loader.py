"""Megatron-style pretraining batches: consecutive sample ids, sliced per data-parallel rank, exact resume.

Global batch g holds samples ``[g * global_batch_size, (g + 1) * global_batch_size)`` of the dataset (whose order is
already shuffled). It is taken in ``num_microbatches`` steps of ``micro_batch_size * dp_size`` consecutive samples;
at each step rank r gets the r-th slice of ``micro_batch_size``. The position is one number, ``consumed_samples``
(all ranks together, as Megatron counts it), so a loader rebuilt from ``state_dict()`` continues with the next unseen
micro-batch, also under a different dp_size as long as the global batch is the same.
"""

from __future__ import annotations

import numpy as np
import torch

from megapipe.errors import ConfigError


class PretrainingLoader:
    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(
                f"train.micro_batch_size {micro_batch_size}, dp_size {dp_size} and dp_rank {dp_rank} must satisfy "
                "micro_batch_size >= 1 and 0 <= dp_rank < dp_size"
            )
        step = micro_batch_size * dp_size
        if global_batch_size < step or global_batch_size % step:
            raise ConfigError(
                f"train.global_batch_size {global_batch_size} must be a multiple of train.micro_batch_size "
                f"{micro_batch_size} x data-parallel size {dp_size} = {step}"
            )
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = int(consumed_samples)
        self.transform = None  # batch dict -> batch dict (e.g. document ids from end-of-document tokens)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank per global batch (gradient-accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])

    def sample_ids(self) -> range:
        """The dataset indices of this rank's next micro-batch (without advancing)."""
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        return range(first, first + self.micro_batch_size)

    def __iter__(self) -> PretrainingLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        # Only whole global batches: stop when the one this micro-batch belongs to does not fit in the dataset.
        batch_start = self.consumed_samples - self.consumed_samples % self.global_batch_size
        if batch_start + self.global_batch_size > len(self.dataset):
            raise StopIteration
        samples = np.stack([self.dataset[i] for i in self.sample_ids()]).astype(np.int64, copy=False)
        self.consumed_samples += self.micro_batch_size * self.dp_size
        batch = {
            "tokens": torch.from_numpy(np.ascontiguousarray(samples[:, :-1])),
            "labels": torch.from_numpy(np.ascontiguousarray(samples[:, 1:])),
        }
        return self.transform(batch) if self.transform is not None else batch
