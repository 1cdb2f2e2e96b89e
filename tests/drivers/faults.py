"""pretrain_llama.py with process and disk faults injected: test-only, not production flags.

Run under torchrun with pretrain_llama.py's flags; used by tests/test_faults.py.
Environment:
    FAULT         what happens, once, on rank FAULT_RANK (default 0):
                  kill_in_save   SIGKILL every worker of the job once this rank's shards of the
                                 checkpoint of iteration FAULT_AT are written (before the checkpoint
                                 is complete: other ranks' shards and the metadata are missing)
                  kill_in_probe  SIGKILL every worker during the first probe forward pass of the
                                 SNIP cycle at iteration FAULT_AT
                  term_in_probe  SIGTERM every worker (as SLURM does) at that same moment
                  enospc_in_save the shard files of the checkpoint of iteration FAULT_AT fail part-way
                                 with ENOSPC (the disk is full) on this rank
                  slow_save      the save of iteration FAULT_AT sends SIGTERM to torchrun's agent (as a
                                 stop of the job does), then takes FAULT_SLEEP seconds more before writing
                  disk_full      after iteration FAULT_AT's step, no file of this rank may grow (the file
                                 size limit, RLIMIT_FSIZE, set to the metrics record's size: writes fail
                                 with EFBIG, as on a full disk or quota)
                  unwritable_save  after iteration FAULT_AT's step, --save (SAVE_DIR) can no longer take new
                                 files: made read-only (chmod), or, for root, whom chmod does not stop,
                                 moved aside to SAVE_DIR.moved with a file put in its place
    FAULT_AT      the iteration (as logged)
    FLUSH_TENSORBOARD  if set, TensorBoard events are flushed at each log, so a killed run keeps them
"""

import errno
import os
import signal
import sys


def signal_job(sig: int) -> None:
    """Signal every process of this torchrun job below the agent, as a scheduler signals the job's whole
    process tree. torchrun starts each worker in a session (process group) of its own, which the checkpoint
    writers a worker forks inherit: signalling the groups reaches them too, even one forked a moment ago
    (a forked writer left alive would hold the job's output open). This worker's group last."""
    import psutil

    me = os.getpid()
    for worker in psutil.Process(os.getppid()).children():
        if worker.pid != me:
            signal_group(worker.pid, sig)
    signal_group(me, sig)


def signal_group(pid: int, sig: int) -> None:
    """Signal ``pid``'s process group if it leads one (a torchrun worker or agent started in its own session,
    with whatever it forked), else the process and its descendants; nothing if it has exited."""
    import psutil

    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:  # not a group leader (another launcher): the process and its descendants one by one
            for p in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
                p.send_signal(sig)
    except (ProcessLookupError, psutil.NoSuchProcess):
        pass  # it exited already: nothing left to signal


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written, as on a full disk."""

    def __init__(self, f, room: int):
        self._f, self._room = f, room

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if n > self._room:
            self._f.write(bytes(memoryview(data).cast("B")[: self._room]))
            self._f.flush()
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # write(2) names no file
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def instrument(trainer) -> None:
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    fault, at = os.environ.get("FAULT"), int(os.environ.get("FAULT_AT", "0"))
    here = dist.get_rank() == int(os.environ.get("FAULT_RANK", "0"))

    if os.environ.get("FLUSH_TENSORBOARD") and trainer.logger.writer is not None:
        log, writer = trainer.logger.scalars, trainer.logger.writer

        def flushed_log(*args, **kwargs):
            log(*args, **kwargs)
            writer.flush()

        trainer.logger.scalars = flushed_log

    def saving() -> bool:  # the checkpoint being written is that of the current iteration
        return here and trainer.state.iteration == at

    if fault == "kill_in_save":
        write = FileSystemWriterAsync.write_preloaded_data_multiproc

        def write_then_die(*args, **kwargs):
            write(*args, **kwargs)  # this rank's shard files are complete and fsynced
            if saving():
                signal_job(signal.SIGKILL)

        FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_then_die)
    elif fault == "enospc_in_save":
        def full_disk_open(path, mode="r", *args, **kwargs):
            f = open(path, mode, *args, **kwargs)
            return _FullDisk(f, room=4096) if saving() and "w" in mode else f

        filesystem_async.open = full_disk_open  # the shard writers' open (forked from this process)
    elif fault == "slow_save":
        import time

        write = FileSystemWriterAsync.write_preloaded_data_multiproc

        def stopped_then_slow(*args, **kwargs):
            if saving():
                os.kill(os.getppid(), signal.SIGTERM)  # the agent passes it on to every worker
                time.sleep(float(os.environ["FAULT_SLEEP"]))
            write(*args, **kwargs)

        FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(stopped_then_slow)
    elif fault in ("kill_in_probe", "term_in_probe"):
        cycle, in_cycle = trainer.snip.cycle, [False]

        def watched_cycle(iteration, *args, **kwargs):
            in_cycle[0] = iteration == at
            try:
                return cycle(iteration, *args, **kwargs)
            finally:
                in_cycle[0] = False

        def probe_forward(module, args):
            if in_cycle[0] and here:
                in_cycle[0] = False  # once
                signal_job(signal.SIGKILL if fault == "kill_in_probe" else signal.SIGTERM)

        trainer.snip.cycle = watched_cycle
        trainer.model[0].register_forward_pre_hook(probe_forward)
    elif fault in ("disk_full", "unwritable_save"):
        import resource

        step = trainer.train_step

        def step_then_fault(data):
            result = step(data)
            if here and trainer.state.iteration == at:
                save = os.environ["SAVE_DIR"]
                if fault == "disk_full":
                    size = os.path.getsize(os.path.join(save, "metrics.jsonl"))
                    resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
                elif os.geteuid() != 0:
                    os.chmod(save, 0o555)
                else:
                    os.rename(save, save + ".moved")
                    open(save, "w").close()
            return result

        trainer.train_step = step_then_fault
    elif fault:
        raise SystemExit(f"FAULT={fault!r}: unknown (see tests/drivers/faults.py)")


if __name__ == "__main__":
    from megatron_snip.compat.cpu import silence_expected_warnings

    silence_expected_warnings()
    from megatron_snip.cli.pretrain import main

    sys.exit(main(on_build=instrument))
