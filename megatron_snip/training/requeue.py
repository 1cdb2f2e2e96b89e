"""Whether a stopped job should be requeued: the run's own record of a clean exit save.

A launcher's exit status cannot tell a preemption from a crash: ``torchrun`` that passed SIGTERM
on to its workers exits 1 with a ``SignalException``, as after a worker's crash. So the run leaves a
record beside the checkpoint tracker once its last save is complete (rank 0, written atomically)::

    SAVE/exit_record.json   {"iteration": 1250, "reason": "SIGUSR1", "train_iters": 100000, "time": 1767225600.0}

``reason``: the signal's name (SIGTERM, SIGUSR1), ``exit-duration`` (``--exit-duration-in-mins``),
``exit-interval`` (``--exit-interval``), ``finished`` (``--train-iters`` reached) or ``config-error``
(the flags, files or launch were refused before anything was built; ``iteration`` is then null and the
record is written only where ``--save`` already exists). A run removes the
record when its training loop starts, and a crash writes none. Since a run can also crash before
it gets that far, the reader passes the time it launched the run (``--since``): an older record is
an earlier run's.

Decision (``python -m megatron_snip.training.requeue SAVE --since EPOCH_SECONDS``, after the run):

- ``requeue`` (exit status 75, EX_TEMPFAIL): the run saved and stopped early because of a signal or
  ``--exit-duration-in-mins``; the next job resumes from that checkpoint;
- ``done`` (0): training finished, or stopped where ``--exit-interval`` asked;
- ``crash`` (1): no record of this run (it crashed, or was killed before its save completed);
  requeueing would repeat a deterministic failure;
- ``config`` (78, sysexits' EX_CONFIG, also pretrain_llama.py's own exit status for refused flags): the
  run refused its configuration; fix the flags, requeueing would refuse them again.

This module imports nothing heavy: the SLURM script runs it after every job step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from megatron_snip.fileio import write_text_atomic

RECORD = "exit_record.json"
FINISHED, EXIT_DURATION, EXIT_INTERVAL, CONFIG_ERROR = "finished", "exit-duration", "exit-interval", "config-error"
# Exit status of pretrain_llama.py for refused flags, files or launch (sysexits' EX_CONFIG).
CONFIG_ERROR_STATUS = 78
# Exit statuses of the command line, by decision.
STATUS = {"done": 0, "crash": 1, "requeue": 75, "config": CONFIG_ERROR_STATUS}


@dataclass(frozen=True)
class ExitRecord:
    iteration: int | None  # the iteration of the checkpoint the run saved last (the tracker's); None: config-error
    reason: str       # a signal's name, "exit-duration", "exit-interval" or "finished"
    train_iters: int | None  # --train-iters of the run (None: refused before it was known)
    time: float       # when the record was written, seconds since the epoch


def record_path(save: str) -> str:
    return os.path.join(save, RECORD)


def write_record(save: str, record: ExitRecord) -> None:
    """Write ``record`` under ``save`` (one rank, after the checkpoint it names is complete)."""
    write_text_atomic(record_path(save), json.dumps(asdict(record)) + "\n")


def clear_record(save: str) -> None:
    """Remove an earlier run's record (one rank, when a run starts training)."""
    try:
        os.remove(record_path(save))
    except FileNotFoundError:
        pass


def read_record(save: str) -> ExitRecord | None:
    """The record under ``save``, or None if there is none; ValueError if it is not a record."""
    try:
        with open(record_path(save)) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        return ExitRecord(**json.loads(text))
    except (TypeError, ValueError) as e:  # bad JSON, missing or unknown fields
        raise ValueError(f"{record_path(save)} is not an exit record ({e}): {text[:200]!r}") from e


def decide(record: ExitRecord | None, since: float) -> tuple[str, str]:
    """(``"requeue"`` | ``"done"`` | ``"crash"`` | ``"config"``, why) for a run launched at ``since`` (seconds
    since the epoch) that left ``record`` (None: none)."""
    if record is None:
        return "crash", "the run left no exit record: it failed, or was killed before its exit save completed"
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.time))
    if record.time < since:
        return "crash", (f"the exit record (iteration {record.iteration}, written {written}) is older than this run, "
                         f"which left none: it failed, or was killed before its exit save completed")
    if record.reason == CONFIG_ERROR:
        return "config", (f"the run refused its flags, files or launch (record written {written}; the job's log "
                          f"lists every problem): fix them; a requeue would be refused the same way")
    where = f"iteration {record.iteration} of {record.train_iters} (record written {written})"
    if record.reason == FINISHED:
        return "done", f"training finished at {where}"
    if record.reason == EXIT_INTERVAL:
        return "done", f"stopped by --exit-interval at {where}, as asked"
    if record.reason == EXIT_DURATION or record.reason.startswith("SIG"):
        return "requeue", f"saved and stopped by {record.reason} at {where}; the next job resumes there"
    return "crash", f"the exit record names an unknown reason {record.reason!r} at {where}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m megatron_snip.training.requeue",
        description="After a run of pretrain_llama.py: print 'requeue', 'done', 'crash' or 'config' and why, and "
                    f"exit {STATUS['requeue']}, {STATUS['done']}, {STATUS['crash']} or {STATUS['config']}. Only a "
                    "clean exit save after a signal or --exit-duration-in-mins asks for a requeue.")
    p.add_argument("save", help="the run's --save directory")
    p.add_argument("--since", type=float, required=True,
                   help="when the run was launched, in seconds since the epoch (date +%%s): an older record is "
                        "an earlier run's")
    args = p.parse_args(argv)
    try:
        decision, why = decide(read_record(args.save), args.since)
    except ValueError as e:
        decision, why = "crash", str(e)
    print(f"{decision}: {why}", flush=True)
    return STATUS[decision]


if __name__ == "__main__":
    sys.exit(main())
