"""Megatron-LM's level-1 timers (--timing-log-level 1 or 2): wall time of each iteration's
forward-backward and optimizer step on every rank, reported as (min, max) over ranks."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_snip.compat.device import current_device, has_cuda

NAMES = ("forward-backward", "optimizer")


class Timers:
    """Seconds spent in each of :data:`NAMES` since the last :meth:`min_max`; timing nothing at level 0."""

    def __init__(self, level: int):
        self.enabled = level >= 1
        self.seconds = dict.fromkeys(NAMES, 0.0)

    @contextmanager
    def time(self, name: str):
        """Add the wall time of the ``with`` body to timer ``name`` (CUDA work finished first)."""
        if not self.enabled:
            yield
            return
        if has_cuda():
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if has_cuda():
            torch.cuda.synchronize()
        self.seconds[name] += time.perf_counter() - start

    def min_max(self, iterations: int) -> dict[str, tuple[float, float]]:
        """Collective (every rank): name -> (min, max) over ranks of seconds per iteration over the last
        ``iterations`` iterations; the timers restart. Empty at level 0."""
        if not self.enabled:
            return {}
        local = torch.tensor([self.seconds[n] / iterations for n in NAMES], dtype=torch.float64,
                             device=current_device())
        low, high = local.clone(), local.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        self.seconds = dict.fromkeys(NAMES, 0.0)
        return {n: (low[i].item(), high[i].item()) for i, n in enumerate(NAMES)}
