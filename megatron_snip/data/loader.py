"""Micro-batches for one data-parallel rank, positioned by consumed samples.

Like Megatron's pretraining sampler: the global sample stream is cut into
global batches; within a batch, micro-batch ``k`` of DP rank ``r`` holds samples
``start + k*mbs*dp + r*mbs + [0, mbs)``. Resuming at ``consumed_samples``
therefore continues the stream exactly, whatever the layout. Worker processes
(``--num-workers``) prepare the next micro-batches while the model computes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader

from megatron_snip.compat.device import has_cuda


class MicroBatchSampler:
    """Yields the dataset indices of this DP rank's micro-batches, forever, from ``consumed_samples``."""

    def __init__(self, dataset_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0):
        if dataset_size == 0:
            raise ValueError("the dataset is empty: check --split and --data-path")
        self.size, self.mbs, self.dp_rank, self.dp_size = dataset_size, micro_batch_size, dp_rank, dp_size
        self.consumed_samples = consumed_samples

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples
        while True:
            first = start + self.dp_rank * self.mbs
            yield [(first + i) % self.size for i in range(self.mbs)]
            start += self.mbs * self.dp_size


def micro_batches(dataset: Sequence, micro_batch_size: int, dp_rank: int, dp_size: int,
                  consumed_samples: int = 0, num_workers: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Iterator of micro-batch dicts ``{tokens, labels, loss_mask, position_ids[, attention_mask]}``.

    Each value is the dataset's per-sample tensor stacked to ``[mbs, ...]``.
    """
    sampler = MicroBatchSampler(len(dataset), micro_batch_size, dp_rank, dp_size, consumed_samples)
    # Each iterator of a DataLoader draws its workers' base seed from a generator: its own here, not torch's
    # global one, which on a CPU is also the one dropout draws from (compat/cpu.py), so that opening a loader
    # (at a resume, for an evaluation) never shifts the model's random stream.
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, pin_memory=has_cuda(),
                        persistent_workers=False, generator=torch.Generator())
    return iter(loader)
