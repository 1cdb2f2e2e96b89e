"""The run's precision over time: the plan, the precision schedule on top of it, what is in force from the
next step on (its FLOP fractions and estimated GEMM time), the modules a fault blames and their promotion
(``--promote-on-fault``), and the history of plan changes that checkpoints keep.

Every rank holds one and changes it at the same iterations (the trainer calls it from its loop), so every
rank runs the same plan; only :meth:`PlanState.health` and :meth:`PlanState.blame` are collective.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_snip.model.quantized.controller import PrecisionController
from megatron_snip.numerics.recipes import Precision
from megatron_snip.numerics.registry import PRECISION_NAMES
from megatron_snip.precision.flops import LlamaLinearDims, estimated_time_ratio, flop_fractions
from megatron_snip.precision.gemm_speed import GemmSpeedModel
from megatron_snip.precision.plan import PrecisionPlan
from megatron_snip.precision.schedule import PrecisionSchedule
from megatron_snip.training.checkpoint_record import PlanChange, PlanEvent
from megatron_snip.training.config import SafetyConfig
from megatron_snip.training.quant_health import HealthTable, gather_health, promote
from megatron_snip.training.safety import Verdict


class PlanState:
    """The plan (SNIP's, a promotion's or the start-up one) and the schedule, applied to the model's linears."""

    def __init__(self, controller: PrecisionController, plan: PrecisionPlan, schedule: PrecisionSchedule,
                 dims: LlamaLinearDims, speed_model: GemmSpeedModel, speeds, history: Iterable[PlanChange] = ()):
        """``speeds``: the speed model's per-precision speeds for the run's recipe; ``history``: a resumed
        checkpoint's plan changes."""
        self.controller = controller
        self.schedule = schedule
        self.dims = dims
        self.speed_model = speed_model
        self.speeds = speeds
        self.history: list[PlanChange] = list(history)  # saved in checkpoints (CheckpointRecord)
        self.effective_plan: PrecisionPlan | None = None
        self.since = 1  # the iteration the effective plan was applied for (in force from then or the next one on)
        self.measured: tuple[int, HealthTable] | None = None  # the last fully measured health, and when
        self.set_plan(plan, 1)

    def set_plan(self, plan: PrecisionPlan, next_iteration: int) -> None:
        """Make ``plan`` the run's plan (with the schedule on top) from iteration ``next_iteration`` on."""
        self.plan = plan
        self.apply(next_iteration)

    def apply(self, next_iteration: int) -> None:
        """Apply the plan, with the schedule's entries for iteration ``next_iteration`` imposed, to every
        linear module."""
        effective = self.schedule.apply(self.plan, next_iteration, self.dims.num_layers)
        self.controller.apply(effective)
        if effective != self.effective_plan:
            self.since = next_iteration
        self.effective_plan = effective
        self.flop_fractions = flop_fractions(effective, self.dims)
        self.time_ratio = estimated_time_ratio(effective, self.dims, self.speeds,
                                               module_speeds=self.speed_model.module_speeds())

    @property
    def all_bf16(self) -> bool:
        """Whether no GEMM in force is quantized below bf16."""
        plan = self.effective_plan
        return plan.default.is_bf16 and all(p.is_bf16 for p in plan.modules.values())

    def formats_in_use(self, snip_formats: Iterable[str] = ()) -> list[str]:
        """The precisions the run's GEMMs can take: its plan's, its schedule's and ``snip_formats``
        (SNIP's candidates, with ``--snip``), in the registry's order."""
        used = {side for p in (self.plan.default, *self.plan.modules.values()) for side in (p.fwd, p.bwd)}
        used |= set(snip_formats)
        used |= {entry.precision for entry in self.schedule.entries}
        return [f for f in PRECISION_NAMES if f in used]

    def schedule_starts(self, next_iteration: int) -> str:
        """Apply the schedule's entries that start at ``next_iteration``; the log line."""
        self.apply(next_iteration)
        active = ", ".join(map(str, self.schedule.active(next_iteration)))
        return (f"precision schedule: from step {next_iteration} on {active}: "
                f"{self.flop_fractions.fp4:.1%} of linear FLOPs in FP4")

    def health(self, iteration: int) -> HealthTable:
        """Collective (every rank): the whole model's quantization health since the last reset, kept as the
        last full measurement for :meth:`blame`."""
        table = gather_health(self.controller, self.dims.num_layers)
        self.measured = (iteration, table)
        return table

    def blame(self, verdict: Verdict, quant_health: bool) -> tuple[list[str], str]:
        """On a non-finite step or a spike (collective with ``quant_health``): the quantized modules the
        health numbers blame, and "; " + what they show (nothing without ``--quant-health``). A spike on a
        step not measured in full is judged by the last full measurement."""
        if not quant_health or not (verdict.nonfinite or verdict.spike):
            return [], ""
        table = gather_health(self.controller, self.dims.num_layers)
        note = ""
        if verdict.spike and not table.full and self.measured is not None:  # errors are measured on logged steps
            table, note = self.measured[1], f" (measured at iteration {self.measured[0]})"
        blamed, detail = table.fault_modules(verdict.nonfinite)
        return blamed, f"; {detail}{note}" if detail else ""

    def fault_response(self, verdict: Verdict, safety: SafetyConfig
                       ) -> tuple[PrecisionPlan, dict[str, tuple[Precision, Precision]], str]:
        """What a fault (a non-finite step or a spike) does to the plan (collective with --quant-health):
        with --promote-on-fault the plan with each blamed module one step up (FP4 -> FP8 -> BF16) and the
        changes (empty when none can go up; without the flag: the plan unchanged, no changes); and
        :meth:`blame`'s detail."""
        blamed, detail = self.blame(verdict, safety.quant_health)
        promoted, changes = promote(self.plan, blamed) if safety.promote_on_fault else (self.plan, {})
        return promoted, changes, detail

    def promote(self, plan: PrecisionPlan, changes: dict[str, tuple[Precision, Precision]], verdict: Verdict,
                until: str) -> str:
        """Switch to the promoted ``plan`` from the next step on and record why; the log line. Called within
        the faulty step (``verdict.iteration``), whose schedule entries it applies with."""
        before = self.effective_plan
        self.set_plan(plan, verdict.iteration)
        if self.effective_plan != before:
            self.since = verdict.iteration + 1  # the faulty step ran the plan before
        self.history.append(PlanChange(verdict.iteration, PlanEvent.PROMOTION, dict(changes), verdict.describe()))
        return (f"[safety] promoted {', '.join(f'{n} {old} -> {new}' for n, (old, new) in changes.items())} "
                f"until {until} (--promote-on-fault)")

    def replanned(self, iteration: int, plan: PrecisionPlan) -> None:
        """SNIP's ``plan``, chosen after ``iteration``, in force from the next step on (recorded)."""
        before = self.plan
        self.set_plan(plan, iteration + 1)
        self.history.append(PlanChange(iteration, PlanEvent.SNIP_CYCLE, before.diff(plan, self.dims.num_layers)))
