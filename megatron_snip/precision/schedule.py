"""Precision schedules: from an iteration on, some GEMMs of every module run in a fixed precision.

The NVFP4 pretraining recipe (NVIDIA, "Pretraining Large Language Models with NVFP4",
Appendix D) switches the forward GEMMs to higher precision for the last part of training,
while the backward GEMMs keep their format. ``--precision-schedule`` expresses that and more:

    fwd=bf16@0.82      from 82% of --train-iters on, every forward GEMM in bf16
    all=fp8@9000       from iteration 9000 on, every GEMM in fp8
    bwd=fp8@0.9        from 90% on, the backward GEMMs (dgrad, wgrad) in fp8

An entry overrides the plan (a ``--precision``, a plan file, a checkpoint's or SNIP's) for the
passes it names; where two are active, the one that started later wins (at equal starts, the
one listed later). SNIP treats the
active entries as pins that its budgets do not count (it plans the GEMMs the schedule leaves
to it). Iterations count from 1: ``@N`` means the N-th training step is the first to run so.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatron_snip.numerics.recipes import Precision
from megatron_snip.numerics.registry import precision_format
from megatron_snip.precision.plan import PrecisionPlan, module_names

PASSES = ("fwd", "bwd", "all")
_ENTRY = re.compile(r"(fwd|bwd|all)=([a-z0-9:]+)@([0-9.]+%?)")


@dataclass(frozen=True)
class ScheduleEntry:
    """From training step ``start`` (1-based) on, ``passes`` of every linear module run in ``precision``."""

    passes: str  # "fwd" (fprop), "bwd" (dgrad and wgrad) or "all"
    precision: str  # a registered precision name
    start: int  # first training step (>= 1) that runs with it

    def __post_init__(self):
        if self.passes not in PASSES:
            raise ValueError(f"schedule entry: passes must be one of {', '.join(PASSES)}, got {self.passes!r}")
        precision_format(self.precision)
        if self.start < 1:
            raise ValueError(f"schedule entry: start must be a training step >= 1, got {self.start}")

    def __str__(self) -> str:
        return f"{self.passes}={self.precision}@{self.start}"


@dataclass(frozen=True)
class PrecisionSchedule:
    """The entries of ``--precision-schedule``, with their start steps resolved."""

    entries: tuple[ScheduleEntry, ...] = ()

    @classmethod
    def parse(cls, specs: list[str] | None, train_iters: int) -> PrecisionSchedule:
        """From ``PASSES=PRECISION@START`` texts; START is a step (``9000``) or a fraction of
        ``train_iters`` (``0.82`` or ``82%``: the last 18% of the steps). ValueError naming the
        entry and the expected form."""
        entries = []
        for spec in specs or []:
            match = _ENTRY.fullmatch(spec.strip())
            if match is None:
                raise ValueError(f"--precision-schedule {spec!r}: expected PASSES=PRECISION@START, e.g. fwd=bf16@0.82 "
                                 f"or all=fp8@9000 (PASSES: {', '.join(PASSES)})")
            passes, precision, start = match.groups()
            try:
                precision_format(precision)
            except ValueError as e:
                raise ValueError(f"--precision-schedule {spec!r}: {e}") from None
            entries.append(ScheduleEntry(passes, precision, _start_step(start, train_iters, spec)))
        return cls(tuple(entries))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def to_list(self) -> list[str]:
        """The entries as texts with resolved steps (what checkpoints store; ``parse`` reads them back)."""
        return [str(e) for e in self.entries]

    def active(self, step: int) -> list[ScheduleEntry]:
        """Entries in force at training step ``step`` (1-based), in the order they took effect."""
        return sorted((e for e in self.entries if e.start <= step), key=lambda e: e.start)

    def starts(self) -> set[int]:
        """The steps at which the precisions change."""
        return {e.start for e in self.entries}

    def fixed(self, step: int) -> dict[str, str | None]:
        """``{"fwd": precision or None, "bwd": precision or None}`` that the schedule imposes at ``step``."""
        out: dict[str, str | None] = {"fwd": None, "bwd": None}
        for e in self.active(step):
            for side in (("fwd", "bwd") if e.passes == "all" else (e.passes,)):
                out[side] = e.precision
        return out

    def apply(self, plan: PrecisionPlan, step: int, num_layers: int) -> PrecisionPlan:
        """``plan`` with the schedule's fixed passes at ``step`` imposed on every module."""
        fixed = self.fixed(step)
        if fixed == {"fwd": None, "bwd": None}:
            return plan

        def imposed(p: Precision) -> Precision:
            return Precision(fixed["fwd"] or p.fwd, fixed["bwd"] or p.bwd)

        return PrecisionPlan({n: imposed(plan[n]) for n in module_names(num_layers)}, imposed(plan.default))


def _start_step(text: str, train_iters: int, spec: str) -> int:
    if text.endswith("%") or "." in text:
        fraction = float(text.rstrip("%")) / (100.0 if text.endswith("%") else 1.0)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"--precision-schedule {spec!r}: a fraction of --train-iters must lie in [0, 1]")
        return int(math.floor(fraction * train_iters)) + 1
    return int(text)
