"""megatron-core's checkpoint writer, made to survive the signal that asks for a checkpoint.

``dist_checkpointing``'s writer (``strategies/filesystem_async.py``) collects the results of its
write processes through a queue served by a ``multiprocessing`` Manager, a process it spawns at a
process's first save and reuses after. SLURM's preemption SIGTERM reaches every process of the
job step, and torchrun's shutdown sends SIGTERM to each worker's whole process group: the spawned
Manager keeps no Python handler, dies of it, and the save the signal asked for (or any later one)
fails with BrokenPipeError. :func:`install` starts that Manager here instead, before the first
save, with the stop signals ignored and a watch that ends it when its worker is gone. The queue's
items are pickled before they reach the Manager (:class:`PickledQueue`): it holds bytes, so it never
imports what the write results' classes need (torch.distributed.checkpoint, hence all of torch: 2-3.5
CPU-seconds and 250 MB in every rank's Manager, measured on a 2-core CPU machine; 0.1 s and 20 MB now).

This module is imported by the spawned Manager to run :func:`_serve_through_signals`: keep its
imports light.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from multiprocessing import resource_tracker
from multiprocessing.managers import SyncManager

log = logging.getLogger(__name__)

# The signals that ask a run to save and stop (training/signals.py), and Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_manager: SyncManager | None = None  # the one Manager of this process, kept alive with it
_installed = False


def _serve_through_signals(worker: int) -> None:
    """Manager initializer, in the spawned process: ignore the stop signals, end when ``worker`` is gone
    (killed -9: nothing shuts the Manager down then, and it would outlive the job)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def watch() -> None:
        while os.getppid() == worker:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class PickledQueue:
    """A Manager's queue whose items travel as pickled bytes: the Manager process unpickles only
    ``bytes``. The methods megatron-core's writer calls (``put`` in the writing process, ``get_nowait``
    in the trainer), and ``get``."""

    def __init__(self, queue):
        self._queue = queue  # a picklable proxy: this object can be passed to another process too

    def put(self, item) -> None:
        self._queue.put(pickle.dumps(item))

    def get(self, *args, **kwargs):
        return pickle.loads(self._queue.get(*args, **kwargs))

    def get_nowait(self):
        return pickle.loads(self._queue.get_nowait())


def install() -> None:
    """Give megatron-core's checkpoint writer a results queue whose Manager outlives a stop signal.

    Idempotent; call before a save. Does nothing (with one warning) if megatron-core's writer has
    no such queue (another version), or if it made its own already.
    """
    global _manager, _installed
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _installed:
        return
    _installed = True
    if not hasattr(filesystem_async, "_results_queue"):
        log.warning("megatron-core's checkpoint writer has no _results_queue (another version?): a save asked "
                    "for by SIGTERM may fail if the signal reaches the writer's helper process")
        return
    if filesystem_async._results_queue is not None:  # megatron-core made its own: leave it
        return
    # Blocked during the spawn, so a signal arriving then cannot kill the Manager before its initializer
    # runs (the mask is inherited); this process gets the signal once unblocked. The resource tracker
    # first: starting it unblocks SIGINT and SIGTERM in this process, undoing the block.
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=_serve_through_signals, initargs=(os.getpid(),))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _manager = manager
    filesystem_async._results_queue = PickledQueue(manager.Queue())
