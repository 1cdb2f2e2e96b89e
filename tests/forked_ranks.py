"""A test's training job whose ranks are forked from a process that imported the trainer once.

Every process torchrun starts imports torch and megatron-core before its first step: 5-7 CPU-seconds on
this 2-core machine, most of what a short test run costs (a TP2 x PP2 run of 8 steps: 40 CPU-seconds
under torchrun, 7 forked). :func:`launch` starts the ranks as children of a multiprocessing forkserver
that made those imports once per test process (``drivers/trainer_imports.py``). Each rank gets what
torchrun gives a worker: a session of its own, the rendezvous environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) over the test's environment, one thread, the job's stdout
and stderr; then the script runs as ``__main__`` with its arguments. The program's code is the same
(the losses of a TP2 x PP2 run are bit-identical under both launchers).

What is torchrun's own (its exit status, signals passed on to the workers, its shutdown grace, workers
killed together) is tested through ``conftest.torchrun``, which the tests of faults, requeue, signals,
logging and the launch scripts keep using.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

# torchrun stops the other workers of a failed job with SIGTERM, then SIGKILL this long after.
STOP_GRACE_S = 30


def _context():
    """The forkserver context, its server started (once per test process) with the trainer imported."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["drivers.trainer_imports"])
    # The server finds the preload on PYTHONPATH (Python 3.11's forkserver does not take this sys.path).
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *([saved] if saved else [])])
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def _rank(script: str, argv: list[str], env: dict, stdout: str, stderr: str, cwd: str) -> None:
    """One rank, in the forked child: set up as a torchrun worker, then run ``script`` as ``__main__``."""
    import torch

    os.setsid()  # torchrun starts each worker in a session of its own
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # python -u, as torchrun runs workers
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # read by torch at its import, done already
    os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))  # as `python script` puts it first
    runpy.run_path(script, run_name="__main__")


def _stop(procs, sig: int) -> None:
    for p in procs:
        if p.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(p.pid, sig)


def launch(nproc: int, script: str | Path, argv: list[str], env: dict, cwd: str | Path,
           timeout: float) -> subprocess.CompletedProcess:
    """Run ``script argv`` as ``nproc`` ranks on this machine; its stdout and stderr (every rank's, as
    written) and its status: 0 if every rank exited 0, else the first failed rank's exit code (torchrun
    itself exits 1 then). Like torchrun, a failed rank stops the others (SIGTERM, SIGKILL after
    STOP_GRACE_S); past ``timeout`` seconds every rank is killed and subprocess.TimeoutExpired raised."""
    from megatron_snip.compat.launch import free_port

    ctx = _context()
    rendezvous = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(free_port()), "GROUP_RANK": "0", "ROLE_RANK": "0"}
    command = [str(script), *argv]
    with tempfile.TemporaryDirectory(prefix="ranks") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        out.touch()
        err.touch()
        procs = [ctx.Process(target=_rank, args=(str(script), list(argv), {
            **env, **rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)}, str(out), str(err), str(cwd)))
            for r in range(nproc)]
        deadline = time.monotonic() + timeout
        failed, stopping = None, None
        try:
            for p in procs:
                p.start()
            while any(p.exitcode is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
                if stopping is not None and now > stopping:
                    _stop(procs, signal.SIGKILL)
                wait([p.sentinel for p in procs if p.exitcode is None], timeout=1.0)
                if failed is None:
                    failed = next((p.exitcode for p in procs if p.exitcode not in (None, 0)), None)
                    if failed is not None:
                        _stop(procs, signal.SIGTERM)
                        stopping = time.monotonic() + STOP_GRACE_S
        finally:
            _stop(procs, signal.SIGKILL)
            for p in procs:
                p.join()
        return subprocess.CompletedProcess(command, failed or 0, out.read_text(), err.read_text())
