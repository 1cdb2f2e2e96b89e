"""``--snip-time-target`` checked against the device: after each SNIP re-plan, the first log window run
entirely under the new plan is compared with the last log window run entirely in bf16, and a plan whose
steps miss the target by more than 10% is reported (``precision.missed_time_target`` says how).

The bf16 reference is a measurement of this run, never an estimate: the most recent log window whose
every step ran all-bf16 (SNIP's warm-up, ``--snip-warmup-plan bf16`` by default, gives one before the
first cycle). A run without one (resumed from a checkpoint's SNIP plan, or warmed up in another plan)
says once that it cannot check, rather than inventing a reference. Only under the measured speed model,
whose table gives the bf16 GEMM seconds the inference needs (the peak estimates know no seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_snip.precision.gemm_speed import GemmSpeedModel
from megatron_snip.training.config import RunConfig
from megatron_snip.training.precision_setup import bf16_gemm_seconds, missed_time_target
from megatron_snip.training.progress import LogWindow


@dataclass
class TimeTargetCheck:
    """The check of one run; ``bf16_gemm``: seconds this rank's linear GEMMs take per step in bf16 by the
    measured speed table (``precision.bf16_gemm_seconds``)."""

    time_target: float
    bf16_gemm: float
    bf16_step: float | None = None  # mean step seconds of the last all-bf16 window
    pending: bool = False           # a re-plan waits for its first whole window
    told_unchecked: bool = False

    @classmethod
    def of_run(cls, config: RunConfig, model: GemmSpeedModel, module_names: list[str]) -> TimeTargetCheck | None:
        """The check of a run with --snip and --snip-time-target under a measured speed ``model``, else None;
        ``module_names``: this rank's linear modules."""
        bf16_gemm = bf16_gemm_seconds(model, module_names, config.training.num_microbatches)
        if not (config.snip.enabled and config.snip.snip_time_target is not None and bf16_gemm):
            return None
        return cls(config.snip.snip_time_target, bf16_gemm)

    def replanned(self, iteration: int, all_bf16: bool) -> str | None:
        """A SNIP re-plan after ``iteration`` came into force (``all_bf16``: its plan quantizes nothing, so there
        is nothing to check): check its first whole window. Once per run, the line saying a run without a bf16
        window cannot be checked."""
        self.pending = not all_bf16
        if all_bf16:
            return None
        if self.bf16_step is None and not self.told_unchecked:
            self.told_unchecked = True
            return (f"[snip] iteration {iteration}: the measured step is not checked against --snip-time-target "
                    f"{self.time_target:g}: no log window of this run ran in bf16 to compare it with (it started "
                    "from a plan that is not bf16: a checkpoint's or --snip-warmup-plan's)")
        return None

    def window(self, iteration: int, window: LogWindow, plan_since: int, all_bf16: bool) -> str | None:
        """At the progress line of ``iteration``, closing ``window``, with the plan in force applied since
        iteration ``plan_since`` (``PlanState.since``) and ``all_bf16`` or not: the line for the log when this
        is a re-plan's first whole window and it misses the target, else None."""
        if plan_since > iteration - window.iterations + 1:  # the plan changed within: it measures neither
            return None
        step = window.seconds / window.iterations
        if all_bf16:
            self.bf16_step, self.pending = step, False
            return None
        if not self.pending or self.bf16_step is None:
            return None
        self.pending = False
        missed = missed_time_target(self.time_target, self.bf16_step, self.bf16_gemm, step)
        return None if missed is None else f"[snip] iteration {iteration}: {missed}"
