"""Micro-batches for one data-parallel rank, positioned by consumed samples.

Like Megatron's pretraining sampler: the global sample stream is cut into
global batches; within a batch, micro-batch ``k`` of DP rank ``r`` holds samples
``start + k*mbs*dp + r*mbs + [0, mbs)``. Resuming at ``consumed_samples``
therefore continues the stream exactly, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class MicroBatches:
    """Iterator of micro-batch dicts ``{tokens, labels, loss_mask, position_ids[, attention_mask]}``.

    Each value is the dataset's per-sample array stacked to ``[mbs, ...]``.
    """

    def __init__(self, dataset: Sequence, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0):
        if len(dataset) == 0:
            raise ValueError("the dataset is empty: check --split and --data-path")
        self.dataset = dataset
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.consumed_samples = consumed_samples

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.consumed_samples + self.dp_rank * self.mbs
        samples = [self.dataset[(start + i) % len(self.dataset)] for i in range(self.mbs)]
        self.consumed_samples += self.mbs * self.dp_size
        return {k: torch.as_tensor(np.stack([np.asarray(s[k]) for s in samples])) for k in samples[0]}
