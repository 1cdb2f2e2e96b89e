"""``pretrain_llama.py``'s main: parse the command line, set up the device, train; errors as one line.

``--help`` and flag errors (an unknown flag, a bad or missing value: one line each) are answered before
megatron-core is imported (its imports take seconds); everything heavy is imported after the flags parse.
Every problem of the flags, files and launch is printed at once, by rank 0 alone (each rank finds the
same), and every rank exits with :data:`~megatron_snip.training.requeue.CONFIG_ERROR_STATUS`; the other
ranks first wait :data:`PEER_EXIT_DELAY_S` for rank 0 to exit, so that a launcher stopping the job at its first
failed rank does not stop rank 0 before it has said why.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_snip.arguments import ArgumentError, parse_args, resolve
from megatron_snip.arguments.errors import HostProblem
from megatron_snip.compat.launch import default_to_one_process
from megatron_snip.training import requeue

if TYPE_CHECKING:
    from megatron_snip.training.config import RunConfig
    from megatron_snip.training.trainer import Trainer


# How long the ranks other than 0 wait before exiting on refused flags. torchrun (and srun
# --kill-on-bad-exit) stops every worker once one has failed: a rank exiting first would take rank 0 down
# before it prints the problems (seen on a loaded machine: exit 78 and nothing on stderr). Rank 0's own exit
# ends the job sooner; the wait only bounds a rank 0 that found nothing wrong.
PEER_EXIT_DELAY_S = 10.0


def _error(e: Exception) -> None:
    # One write call: with unbuffered stderr, print() issues the message and its newline as two writes, and
    # ranks sharing torchrun's stderr interleave their lines (seen in CI).
    sys.stderr.write(f"pretrain_llama.py: error: {e}\n")
    sys.stderr.flush()


def _refused(e: ArgumentError, save: str | None) -> int:
    """Every problem at once, from rank 0 (every rank found the same), and the exit record asking not to
    requeue where --save already exists (best effort: an unwritable --save may be the problem). A folder
    this host cannot write (:class:`HostProblem`) is reported by the first rank of each host, naming it."""
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        if os.environ.get("LOCAL_RANK", "0") == "0":
            for problem in e.problems:
                if isinstance(problem, HostProblem):
                    _error(f"rank {rank} on {socket.gethostname()}: {problem}")
        time.sleep(PEER_EXIT_DELAY_S)
        return requeue.CONFIG_ERROR_STATUS
    problems = e.problems or [str(e)]
    if len(problems) == 1:
        _error(e)
    else:
        _error(f"{len(problems)} problems with the flags, files or launch:" + "".join(f"\n  - {p}" for p in problems))
    if save is not None and os.path.isdir(save):
        with contextlib.suppress(OSError):  # best effort: an unwritable --save may be the problem reported
            requeue.write_record(save, requeue.ExitRecord(None, requeue.CONFIG_ERROR, None, time.time()))
    return requeue.CONFIG_ERROR_STATUS


def _config(argv: list[str] | None) -> RunConfig:
    """Parse (argparse exits on --help), then validate; raises ArgumentError."""
    parsed = parse_args(argv)
    if parsed.local_rank is not None:  # torch.distributed.launch's --local-rank, where it set no $LOCAL_RANK
        os.environ.setdefault("LOCAL_RANK", str(parsed.local_rank))
    from megatron_snip.compat.cpu import silence_expected_warnings

    silence_expected_warnings()  # before megatron-core's imports (checkpoint and data checks) print them
    try:
        return resolve(parsed)
    except ArgumentError as e:
        e.save = parsed.save  # where the exit record goes
        raise


def trainer_from_command_line(argv: list[str] | None = None) -> Trainer:
    """For tools and test drivers that take ``pretrain_llama.py``'s flags and drive the trainer themselves.
    Raises ArgumentError on bad flags."""
    default_to_one_process()
    config = _config(argv)
    from megatron_snip.compat.device import setup_device
    from megatron_snip.training.trainer import build_trainer

    setup_device()
    return build_trainer(config)


def main(argv: list[str] | None = None, on_build: Callable[[Trainer], None] | None = None) -> int:
    """Exit status: 0 done, 78 refused flags, files or launch, 1 a checkpoint or numerical failure (every rank
    says which)."""
    default_to_one_process()  # started by hand, without torchrun/srun: a world of one
    try:
        config = _config(argv)
    except ArgumentError as e:
        return _refused(e, getattr(e, "save", None))
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_snip.compat.device import setup_device
    from megatron_snip.snip.config import SnipConfigError
    from megatron_snip.training import checkpointing
    from megatron_snip.training.logger import RunFilesError
    from megatron_snip.training.safety import NonFiniteError
    from megatron_snip.training.trainer import pretrain

    setup_device()
    try:
        pretrain(config, on_build)
    except SnipConfigError as e:  # found once the model is built (--snip-gain-exclude)
        _error(e)
        return requeue.CONFIG_ERROR_STATUS
    except checkpointing.CheckpointError as e:
        _error(e)
        return 1
    except NonFiniteError as e:
        _error(e)
        dist.barrier()  # every rank raised at this iteration: let each print before the first exit ends the job
        return 1
    except RunFilesError as e:  # every rank stopped together; the rank that could not write says what
        if e.own:
            _error(e)
        return 1
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0
