"""Numerical safety of a training step: non-finite losses and gradients caught before the optimizer step.

After the forward/backward pass (gradients reduced over DP, before
``optimizer.step()``) every rank reduces three numbers over the whole world
in one tiny all-reduce: whether any of its gradients is non-finite, whether
its loss is, and the loss itself (the last stage has it). They are computed
on the device and read once, after the all-reduce: the check costs the step
one host synchronisation (Megatron-LM's own check makes one per micro-batch
and one per gradient bucket). Every rank thus reaches the same verdict at
the same iteration:

- ``fail`` (default): all ranks raise :class:`NonFiniteError`, naming the
  iteration, the parameters with non-finite gradients and the ranks that hold
  them; the update is not applied, so nothing non-finite reaches the weights
  or a checkpoint (the save path checks again: ``checkpointing.check_finite``).
- ``skip``: the update is not applied (weights, optimizer moments and LR
  schedule untouched), the iteration and its data are consumed, the skip is
  counted; after ``--max-consecutive-skips`` skips in a row, all ranks raise.

megatron-core's own DDP check (``check_for_nan_in_grad``) is not used: it
raises on the rank that sees the NaN only, before the DP collective, and the
other ranks then wait in that collective until the timeout.

A loss spike (loss above ``factor`` x the median of the recent applied
losses) is reported the same way but, as in Megatron-LM, is not fatal.

Which quantized module is to blame, and promoting it, is the trainer's
business (``quant_health.py``); this module only judges the step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_snip.compat.device import current_device
from megatron_snip.model.parameter_names import global_parameter_names
from megatron_snip.training.config import SafetyConfig


class NonFiniteError(FloatingPointError):
    """Raised on every rank at the same iteration; the message names iteration, parameters and ranks."""


@dataclass(frozen=True)
class Verdict:
    """What the world agreed on for one step (identical on every rank)."""

    iteration: int
    nonfinite_grad: bool
    nonfinite_loss: bool
    loss: float | None            # the loss of the step (every rank), None if non-finite or unknown
    spike_reference: float | None  # the median it was compared with, when it is a spike
    culprits: str = ""            # "rank 1 (tp 1, pp 0, dp 0): name.weight (2 non-finite); ..." if non-finite

    @property
    def nonfinite(self) -> bool:
        return self.nonfinite_grad or self.nonfinite_loss

    @property
    def spike(self) -> bool:
        return self.spike_reference is not None

    def describe(self) -> str:
        if self.nonfinite:
            what = " and ".join(x for x, bad in (("loss", self.nonfinite_loss), ("gradients", self.nonfinite_grad))
                                if bad)
            return f"non-finite {what} at iteration {self.iteration}" + (f": {self.culprits}" if self.culprits else "")
        return (f"spiky loss at iteration {self.iteration}: {self.loss:.4f} > {self.loss / self.spike_reference:.2f} "
                f"x the median {self.spike_reference:.4f} of the last applied losses")


def is_spike(loss: float, recent: Sequence[float], factor: float) -> float | None:
    """The median of ``recent`` if ``loss`` exceeds ``factor`` times it (needs 3 values), else None."""
    if len(recent) < 3:
        return None
    reference = statistics.median(recent)
    return reference if reference > 0 and loss > factor * reference else None


def _grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer will use: megatron-core DDP's ``main_grad``, else ``grad``."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def _local_grads_nonfinite(chunks: Sequence[torch.nn.Module]) -> torch.Tensor:
    """Whether any gradient of this rank is non-finite, as a bool scalar on the device (no host sync): one
    min-max reduction per DDP buffer (NaN propagates through both, an infinity shows in one; neither can
    overflow; on a CPU ten times faster than the infinity norm)."""
    tensors = [b.grad_data for c in chunks
               for b in getattr(c, "buffers", []) + getattr(c, "expert_parallel_buffers", [])]
    if not tensors:  # not wrapped in megatron-core DDP
        tensors = [g for c in chunks for p in c.parameters() if (g := _grad(p)) is not None]
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=current_device())
    extremes = torch.stack([torch.stack(torch.aminmax(t)) for t in tensors])
    return ~torch.isfinite(extremes).all()


def _local_culprits(chunks: Sequence[torch.nn.Module]) -> list[str]:
    """``name (n non-finite)`` for every parameter of this rank whose gradient is non-finite (slow path)."""
    found = []
    for param, name in global_parameter_names(chunks).items():
        g = _grad(param)
        if g is not None:
            bad = int((~torch.isfinite(g)).sum())
            if bad:
                found.append(f"{name} ({bad} non-finite of {g.numel()})")
    return found


_LISTED = 4  # parameters named per rank in a message


def _rank_label() -> str:
    cp = (f"cp {parallel_state.get_context_parallel_rank()}, "
          if parallel_state.get_context_parallel_world_size() > 1 else "")
    return (f"rank {dist.get_rank()} (tp {parallel_state.get_tensor_model_parallel_rank()}, {cp}"
            f"pp {parallel_state.get_pipeline_model_parallel_rank()}, dp {parallel_state.get_data_parallel_rank()})")


def gather_culprits(local: list[str]) -> str:
    """Collective: every rank's ``local`` list joined, ranks with nothing left out."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (_rank_label(), local))
    parts = [f"{label}: {', '.join(names[:_LISTED])}" + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED
                                                          else "") for label, names in everyone if names]
    return "; ".join(parts) if parts else "no rank holds a non-finite gradient (the loss is non-finite)"


@dataclass
class NumericalGuard:
    """Checks every step before the optimizer runs; keeps the skip counts and the loss window.

    Its :meth:`state_dict` goes into checkpoints, so a resumed run counts and detects as the
    uninterrupted one would.
    """

    config: SafetyConfig
    skipped: int = 0              # iterations skipped in the whole run
    consecutive: int = 0          # skipped in a row up to now
    spikes: int = 0
    recent: deque = field(default_factory=deque)  # recent applied losses (the spike reference)

    def check(self, chunks: Sequence[torch.nn.Module], loss: torch.Tensor | None, iteration: int) -> Verdict:
        """Collective over all ranks; ``loss`` is this rank's, a device scalar (None off the last stage).
        One host synchronisation, after the all-reduce; none when both checks are off."""
        cfg = self.config
        if not (cfg.check_nan or cfg.check_spiky_loss):
            return Verdict(iteration, False, False, None, None)
        device = current_device()
        no = torch.zeros((), dtype=torch.bool, device=device)
        grad_bad = _local_grads_nonfinite(chunks) if cfg.check_nan else no
        value = torch.full((), -math.inf, dtype=torch.float64, device=device) if loss is None else loss.double()
        known = torch.isfinite(value)
        loss_bad = ~known if cfg.check_nan and loss is not None else no
        flags = torch.stack([grad_bad.double(), loss_bad.double(), torch.where(known, value, -math.inf)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        grad_bad, loss_bad, world_loss = flags.tolist()  # the check's one host sync
        grad_bad, loss_bad = bool(grad_bad), bool(loss_bad)
        world_loss = world_loss if math.isfinite(world_loss) else None
        culprits = gather_culprits(_local_culprits(chunks)) if grad_bad or loss_bad else ""
        reference = None
        if cfg.check_spiky_loss and world_loss is not None and not (grad_bad or loss_bad):
            reference = is_spike(world_loss, self.recent, cfg.spiky_loss_factor)
        return Verdict(iteration, grad_bad, loss_bad, world_loss, reference, culprits)

    def record(self, verdict: Verdict, applied: bool) -> None:
        """Count the step's outcome; raise on every rank when the policy says to stop."""
        if verdict.spike:
            self.spikes += 1
        if not applied:
            self.skipped += 1
            self.consecutive += 1
            if self.consecutive > self.config.max_consecutive_skips:
                raise NonFiniteError(f"{_rank_label()}: {verdict.describe()}; {self.consecutive} consecutive "
                                     f"iterations skipped (--max-consecutive-skips "
                                     f"{self.config.max_consecutive_skips}): giving up")
            return
        self.consecutive = 0
        if verdict.loss is not None and not verdict.spike:
            self.recent.append(verdict.loss)
            while len(self.recent) > self.config.spiky_loss_window:
                self.recent.popleft()

    def should_apply(self, verdict: Verdict, detail: str = "") -> bool:
        """Whether the update runs; under ``fail`` a non-finite step raises on every rank
        (``detail``: more to say, e.g. which quantized modules)."""
        if not verdict.nonfinite:
            return True
        if self.config.policy == "fail":
            raise NonFiniteError(f"{_rank_label()}: {verdict.describe()}{detail}; --non-finite-grad-policy fail: "
                                 f"the update was not applied and nothing was saved")
        return False

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive, "spikes": self.spikes,
                "recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.consecutive, self.spikes = state["skipped"], state["consecutive"], state["spikes"]
        self.recent = deque(state["recent"])
