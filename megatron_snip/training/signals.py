"""Stopping early with a checkpoint: on SIGTERM/SIGUSR1 (SLURM preemption, time limit) or when the
run's wall time passes ``--exit-duration-in-mins``, every rank finishes its iteration, all save, exit 0.
A rank that could not write a run file (a full disk, a revoked mount) stops every rank the same way,
without the save (:data:`RUN_FILES_FAILED`)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_snip.compat.device import current_device
from megatron_snip.training.requeue import EXIT_DURATION

RUN_FILES_FAILED = "run-files-failed"  # a rank set ExitSignalHandler.failed: stop, do not save


class ExitSignalHandler:
    """Records a termination signal and watches a wall-clock deadline; :meth:`should_exit` agrees on
    them across all ranks.

    SLURM signals every task, but not at the same instant, and each rank reads its own clock, so the
    decision is an all-reduce (MAX) at an iteration boundary, as Megatron-LM's. It is started
    asynchronously at one iteration and read at the next, so no iteration waits for it: all ranks
    still stop after the same iteration, one later than the signal or the deadline.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, deadline: float | None = None):
        """``deadline``: ``time.time()`` after which to stop (``--exit-duration-in-mins``), None for none."""
        self.deadline = deadline
        self.received: int | None = None
        self.failed = False  # this rank could not write a run file (set by the loop)
        self._pending: tuple[torch.Tensor, Callable[[], None]] | None = None  # flags, wait for them
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def should_exit(self) -> str | None:
        """Why to stop, as decided by every rank by the previous call: :data:`RUN_FILES_FAILED` (any rank's),
        a signal's name (any rank's; the same on all) or ``"exit-duration"``; None to go on."""
        decided = None
        if self._pending is not None:
            flags, wait = self._pending
            wait()
            signum, late, failed = (int(x) for x in flags.tolist())
            decided = (RUN_FILES_FAILED if failed else signal.Signals(signum).name if signum
                       else EXIT_DURATION if late else None)
        late = self.deadline is not None and time.time() > self.deadline
        # Filled on the device: a tensor built from a Python list would be a host-to-device copy, which
        # on a GPU waits for the whole step enqueued so far.
        flags = torch.zeros(3, dtype=torch.int32, device=current_device())
        if self.received or late or self.failed:
            flags[0], flags[1], flags[2] = self.received or 0, int(late), int(self.failed)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        if flags.is_cuda:
            # The stream waits for the all-reduce and copies its result to pinned host memory; the next call
            # waits for that copy only (long done by then), not for the step enqueued after it.
            work.wait()
            host = torch.empty(3, dtype=torch.int32, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._pending = (host, copied.synchronize)
        else:
            self._pending = (flags, work.wait)
        return decided

    def close(self) -> None:
        """Complete the outstanding all-reduce (every rank must call this, or none)."""
        if self._pending is not None:
            self._pending[1]()
            self._pending = None
