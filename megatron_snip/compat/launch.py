"""Running without a launcher: ``python pretrain_llama.py ...`` (or a tool) as one process.

torchrun and srun-with-torchrun set ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``;
torch.distributed's env:// rendezvous fails with a bare traceback when they are missing. A
process started by hand is a world of one: give it that environment instead.
"""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
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
