"""Megatron-LM's --profile: a window of training iterations under torch.profiler or an nsys capture range.

As in Megatron-LM's training loop, on the ranks of ``--profile-ranks``:

- with ``--use-pytorch-profiler``: a ``torch.profiler.profile`` started before the loop with the schedule
  ``wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start``, stepped before every
  iteration and stopped after iteration ``end``; the trace (``*.pt.trace.json``, read by TensorBoard's
  profiler plugin, Perfetto or chrome://tracing) goes to ``--tensorboard-dir``. Its active steps are the
  iterations ``start`` to ``end - 1`` of the run counted from the first iteration this launch runs;
- otherwise, on CUDA: ``cudaProfilerStart`` (with NVTX ranges of every op) before iteration
  ``start + 1`` and ``cudaProfilerStop`` after iteration ``end``: the capture range of ``nsys profile
  --capture-range=cudaProfilerApi``.

Validation checks the flags (``arguments.validation``); the loop calls :meth:`StepProfiler.before_step` and
:meth:`StepProfiler.after_step` with the iteration count before and after each step.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from megatron_snip.training.config import LoggingConfig

log = logging.getLogger(__name__)


class StepProfiler:
    """Profiles the iterations ``--profile-step-start`` .. ``--profile-step-end`` on this rank (inert when
    ``--profile`` is off or the rank is not in ``--profile-ranks``)."""

    def __init__(self, config: LoggingConfig, rank: int):
        self.start, self.end = config.profile_step_start, config.profile_step_end
        self.active = config.profile and rank in config.profile_ranks
        self.torch_profiler = None
        self._nvtx: contextlib.AbstractContextManager | None = None
        self._use_torch = config.use_pytorch_profiler
        if self.active and self._use_torch:
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(self.start - 1, 0), warmup=1 if self.start > 0 else 0,
                                                 active=self.end - self.start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(config.tensorboard_dir),
                record_shapes=True, with_stack=True)
            self.torch_profiler.start()

    def before_step(self, iteration: int) -> None:
        """Before the step that takes the run from ``iteration`` to ``iteration + 1``."""
        if not self.active:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif iteration == self.start and torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        """After the step that ended at ``iteration``."""
        if self.active and iteration == self.end:
            self.close()

    def close(self) -> None:
        """Stop profiling, if it still runs (the loop ended before --profile-step-end)."""
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
            log.info("torch.profiler trace of iterations %d-%d written", self.start, self.end - 1)
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            torch.cuda.cudart().cudaProfilerStop()
            self._nvtx = None
        self.active = False
