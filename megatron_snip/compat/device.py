"""Which device this process computes on: the one place (besides ``compat/cpu.py``) that asks about CUDA.

Entry points call :func:`setup_device` once, before any process group or model: on a GPU machine
it selects this process's GPU (``$LOCAL_RANK``), without one it turns on the CPU layer
(:mod:`megatron_snip.compat.cpu`). Library code only asks :func:`has_cuda` / :func:`current_device`.
"""

from __future__ import annotations

import os

import torch

from megatron_snip.compat import cpu


def has_cuda() -> bool:
    """Whether this process has a GPU (the CPU layer never pretends one is there)."""
    return torch.cuda.is_available()


def current_device() -> torch.device:
    """The device this process's tensors live on."""
    return torch.device("cuda", torch.cuda.current_device()) if has_cuda() else torch.device("cpu")


def setup_device() -> str:
    """Select this process's GPU, or enable the CPU layer; idempotent. Returns the device for the start-up log."""
    if has_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return f"cuda:{torch.cuda.current_device()}"
    cpu.enable()
    return "cpu (megatron_snip.compat.cpu)"


def check_device_setup() -> None:
    """RuntimeError when megatron-core would run on CPU without the CPU layer (an entry point forgot
    :func:`setup_device`): better than its first ``torch.cuda`` call failing deep inside."""
    if not has_cuda() and not cpu.STATE.active:
        raise RuntimeError("no GPU and the CPU layer is off: call megatron_snip.compat.device.setup_device() "
                           "in the entry point before initialize_distributed()")
