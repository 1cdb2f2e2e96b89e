"""Running without a launcher: ``python pretrain_llama.py ...`` (or a tool) as one process.

torchrun and srun-with-torchrun set ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``;
torch.distributed's env:// rendezvous fails with a bare traceback when they are missing. A
process started by hand is a world of one: give it that environment instead.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

# free_port draws from [_LOWEST_PORT, the ephemeral range's start), clear of the well-known and most
# registered services' ports; Linux's default range starts at 32768 where /proc cannot be read.
_LOWEST_PORT, _DEFAULT_EPHEMERAL_START = 10000, 32768


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, drawn at random below the OS's ephemeral range.

    A port the OS hands out (a bind to port 0) lies in that range, where it can be taken again
    before the rendezvous store listens on it: by any socket that binds or connects without naming
    a port, gloo's connections between ranks among them (CI once lost a job to EADDRINUSE so).
    Below the range only another explicit choice can collide, and the draw makes that unlikely."""
    top = _ephemeral_start()
    tries = 64 if top > _LOWEST_PORT + 1000 else 0
    for _ in range(tries):
        port = random.randrange(_LOWEST_PORT, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # an unusual range, or every draw taken: let the OS choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_to_one_process() -> None:
    """Fill in a one-process rendezvous where no launcher set one. A variable a launcher set is
    never overwritten, so a torchrun or SLURM job is unaffected."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
