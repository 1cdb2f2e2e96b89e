"""SLURM preemption: on SIGTERM/SIGUSR1 finish the iteration, save, exit 0."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class ExitSignalHandler:
    """Records a termination signal; :meth:`should_exit` agrees on it across all ranks.

    SLURM signals every task, but not at the same instant, so the decision is an
    all-reduce (MAX) at an iteration boundary: all ranks stop at the same one.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def should_exit(self) -> bool:
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32,
                            device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
