"""SLURM preemption: on SIGTERM/SIGUSR1 finish the iteration, save, exit 0."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from megatron_snip.compat.device import current_device


class ExitSignalHandler:
    """Records a termination signal; :meth:`should_exit` agrees on it across all ranks.

    SLURM signals every task, but not at the same instant, so the decision is an
    all-reduce (MAX) at an iteration boundary. It is started asynchronously at
    one iteration and read at the next, so no iteration waits for it: all ranks
    still stop after the same iteration, one later than the signal.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        self._pending: tuple[torch.Tensor, dist.Work] | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def should_exit(self) -> bool:
        """True when any rank had received a signal by the previous call."""
        decided = False
        if self._pending is not None:
            flag, work = self._pending
            work.wait()
            decided = bool(flag.item())
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32,
                            device=current_device())
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        return decided

    def close(self) -> None:
        """Complete the outstanding all-reduce (every rank must call this, or none)."""
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None
