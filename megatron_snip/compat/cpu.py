"""Run megatron-core on a machine without CUDA.

megatron-core assumes CUDA in three ways:

1. it calls ``torch.cuda`` for the device index, RNG states, streams, events,
   memory statistics and synchronisation;
2. it creates tensors with ``device=torch.cuda.current_device()`` / ``"cuda"``
   and moves tensors with ``.cuda()``;
3. it checks tensor types by string (``'torch.cuda.FloatTensor'``).

:func:`enable` answers all three while CUDA is absent: (1) CPU stand-ins on
``torch.cuda``; (2) and (3) a :class:`torch.overrides.TorchFunctionMode` that
rewrites CUDA device arguments to CPU and reports CUDA type strings. When CUDA
is available it does nothing, so on a GPU cluster the program is plain
megatron-core. Everything CPU-specific in the project lives in this module.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # Plain ints are what ``torch.cuda.current_device()`` returns to megatron.
    return isinstance(dev, int) and not isinstance(dev, bool)


def _to_cpu_device(dev):
    return _CPU if _is_cuda_device(dev) else dev


class _CudaAsCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to CPU and reports CUDA tensor type strings."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            # Page-locked host memory needs an accelerator (megatron's RoPE asks for it under context parallelism).
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts e.g. param.type() == 'torch.cuda.FloatTensor'.
            return args[0].type().replace("torch.", "torch.cuda.", 1)
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


class _Event:
    """CPU stand-in for ``torch.cuda.Event``: records wall-clock time; CPU work is already done."""

    def __init__(self, enable_timing: bool = False, **_):
        self._t = None

    def record(self, stream=None):
        import time

        self._t = time.perf_counter()

    def synchronize(self):
        """Nothing to wait for: CPU ops complete before they return."""

    def wait(self, stream=None):
        """Nothing to wait for: CPU ops complete before they return."""

    def query(self):
        return True

    def elapsed_time(self, end: _Event) -> float:
        return (end._t - self._t) * 1e3


class _Stream:
    """CPU stand-in for ``torch.cuda.Stream``: there is one stream, and it is always in order."""

    def __init__(self, *_, **__):
        """No device queue to create."""

    def wait_stream(self, other):
        """Already ordered."""

    def wait_event(self, event):
        """Already ordered."""

    def synchronize(self):
        """Nothing to wait for."""

    def record_event(self, event=None):
        event = event or _Event()
        event.record()
        return event

    def query(self):
        return True


_STREAM = _Stream()


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _cuda_stand_ins() -> dict:
    """``torch.cuda`` attributes and their CPU replacements."""
    return {
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "device_count": lambda: 1,
        "synchronize": lambda device=None: None,
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        # The CPU generator stands in for the CUDA one: megatron's RNG tracker
        # (tensor-parallel dropout/init streams) then switches real states.
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "default_generators": (torch.default_generator,),
        "current_stream": lambda device=None: _STREAM,
        "default_stream": lambda device=None: _STREAM,
        "Stream": _Stream,
        "Event": _Event,
        "stream": lambda s=None: contextlib.nullcontext(),
        "memory_allocated": lambda device=None: _rss_bytes(),
        "max_memory_allocated": lambda device=None: _rss_bytes(),
        "memory_reserved": lambda device=None: _rss_bytes(),
        "max_memory_reserved": lambda device=None: _rss_bytes(),
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
    }


def _apply_rng_state_changes_now() -> None:
    """Make megatron's RNG-state setter take effect.

    ``megatron.core.tensor_parallel.random`` sets CUDA RNG states through
    ``torch.cuda._lazy_call``, which without an initialised CUDA context only
    queues the call (with a stack trace) forever: the tracker's forks would
    never switch generators and every fork would leak memory.
    """
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._lazy_call = lambda callback, **_: callback()
    STATE.patched.append("megatron.core.tensor_parallel.random._lazy_call")


def _reenter_mode_in_autograd_engine(mode: _CudaAsCpuMode) -> None:
    """Keep the mode active for code the autograd engine runs.

    ``torch.autograd.backward``/``grad`` dispatch through ``__torch_function__``,
    and a mode is inactive while its own handler runs, so recompute forwards and
    backward hooks called from the engine would otherwise see CUDA devices.
    """
    import torch.autograd as autograd

    engine_run = autograd._engine_run_backward

    def run_with_mode(*args, **kwargs):
        with mode:
            return engine_run(*args, **kwargs)

    autograd._engine_run_backward = run_with_mode
    STATE.patched.append("torch.autograd._engine_run_backward")


# Warnings megatron-core prints on every CPU process about parts that need a
# GPU (apex, Transformer Engine, CUDA connection settings); expected here.
_CPU_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)
# torch (2.13) deprecates collectives that megatron-core 0.16 calls (sequence parallelism, context parallelism,
# the distributed optimizer); each rank would print them, and there is nothing for a user to do.
_MEGATRON_CORE_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def silence_expected_warnings() -> None:
    """Hide the warnings a user can do nothing about: torch's deprecation of megatron-core's collectives and,
    without a GPU, megatron-core's warnings about GPU-only extensions and settings."""
    import warnings

    warnings.filterwarnings("ignore", message=_MEGATRON_CORE_DEPRECATIONS, category=FutureWarning)
    if torch.cuda.is_available():
        return
    for message in _CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


@dataclass
class CompatState:
    """What :func:`enable` did, so tests and the start-up log can say so."""

    active: bool = False
    patched: list[str] = field(default_factory=list)
    mode: _CudaAsCpuMode | None = None


STATE = CompatState()


def enable() -> CompatState:
    """Make megatron-core run on CPU. Idempotent; a no-op when CUDA is available."""
    if STATE.active or torch.cuda.is_available():
        return STATE
    silence_expected_warnings()
    for name, fn in _cuda_stand_ins().items():
        setattr(torch.cuda, name, fn)
        STATE.patched.append(f"torch.cuda.{name}")
        if name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
            # megatron also reaches these through ``torch.cuda.random``.
            setattr(torch.cuda.random, name, fn)
    _apply_rng_state_changes_now()
    STATE.mode = _CudaAsCpuMode()
    STATE.mode.__enter__()
    _reenter_mode_in_autograd_engine(STATE.mode)
    STATE.active = True
    log.info("CUDA not available: megatron-core runs on CPU through megatron_snip.compat.cpu")
    return STATE
