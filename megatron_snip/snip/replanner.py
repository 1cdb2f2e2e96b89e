"""The SNIP re-planner: probe, estimate, gather, solve on one rank, broadcast.

It sits beside the training loop: at every ``--snip-interval`` iterations (by
default the checkpoint interval) the trainer calls :meth:`SnipReplanner.cycle`
on every rank, after the optimizer step and before the checkpoint, and applies
the plan it returns, so the checkpoint holds the new plan. The cycle reads
statistics; it leaves parameters, gradients, optimizer state, RNG states and the
training data position untouched. It is given its collaborators (model chunks,
optimizer, the precision controller, the probe batches) and knows nothing of the
trainer.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatron_snip.fileio import write_text_atomic
from megatron_snip.model.parameter_names import global_parameter_names
from megatron_snip.model.quantized.controller import PrecisionController
from megatron_snip.numerics.recipes import RecipeConfig
from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.gemm_speed import GemmSpeedModel
from megatron_snip.precision.pipeline_layout import PipelineLayout
from megatron_snip.precision.plan import PrecisionPlan, parse_module_name
from megatron_snip.precision.te_precision_config import megatron_config_files
from megatron_snip.snip.config import SnipConfig, SnipConfigError
from megatron_snip.snip.decisions import CycleReport, decision_table, decisions
from megatron_snip.snip.estimators import cost_tables, divergences, unresolved_curvatures
from megatron_snip.snip.feasibility import InfeasibleBudgetError
from megatron_snip.snip.perturbation import unmatched_gain_excludes
from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules, solve_plan
from megatron_snip.snip.probes import ProbeConfig, gather_across_pipeline, run_probe_cycle
from megatron_snip.snip.statistics import STATISTICS_SCHEMA_VERSION, ProbeStatistics
from megatron_snip.snip.statistics_file import RunSettings, SpeedModelRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepShape:
    """How a training step cuts its global batch (the probe passes run the same micro-batches)."""

    num_microbatches: int
    micro_batch_size: int
    seq_length: int
    data_parallel_size: int

    @property
    def tokens(self) -> int:
        """Tokens per global batch."""
        return self.num_microbatches * self.micro_batch_size * self.data_parallel_size * self.seq_length


class SnipReplanner:
    """Re-plans the precision of every linear module from measured divergences."""

    def __init__(self, snip: SnipConfig, planner: PlannerConfig, *, chunks: Sequence[torch.nn.Module], optimizer,
                 controller: PrecisionController, dims: LlamaLinearDims, speed_model: GemmSpeedModel,
                 step: StepShape, layout: PipelineLayout, seed: int, recipe: RecipeConfig):
        self.snip, self.planner, self.recipe = snip, planner, recipe
        self.chunks, self.optimizer, self.controller = chunks, optimizer, controller
        self.dims, self.speed_model, self.step = dims, speed_model, step
        self.layout = layout
        self.probe = ProbeConfig.from_snip(snip, seed)
        if self.probe.gain_excludes:  # checked at start-up, not at the first cycle hours in
            error = unmatched_gain_excludes(global_parameter_names(chunks).values(), self.probe.gain_excludes)
            if error:
                raise SnipConfigError(error)
        self.modules = linear_modules(dims, step.tokens, layout)
        self.statistics: ProbeStatistics | None = None
        self.reports: list[CycleReport] = []
        self._config_notice = False  # said once that plans have no Megatron-LM precision config

    def cycle(self, iteration: int, probe_data: Iterator[dict], current: PrecisionPlan,
              fixed: Mapping[str, str | None]) -> CycleReport:
        """One full cycle, collective over all ranks: the new plan (``report.plan``, the same on every rank).

        ``probe_data``: this rank's micro-batches of the next global batch, through a loader of
        their own (the training iterator does not move); ``current``: the plan in force;
        ``fixed``: the passes a precision schedule imposes from the next step on
        (``PrecisionSchedule.fixed``), which must not be all of them.
        """
        start = time.perf_counter()
        stats = run_probe_cycle(self.chunks, self.optimizer, self.controller, probe_data,
                                num_microbatches=self.step.num_microbatches, seq_length=self.step.seq_length,
                                micro_batch_size=self.step.micro_batch_size, config=self.probe,
                                iteration=iteration)
        self.statistics = gather_across_pipeline(stats)
        report = self._solve_on_rank0(iteration, current, fixed)
        report.cycle_seconds = time.perf_counter() - start
        self.reports.append(report)
        return report

    def _solve_on_rank0(self, iteration: int, current: PrecisionPlan, fixed: Mapping[str, str | None]) -> CycleReport:
        box: list = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = self._solve(iteration, current, fixed)
            except InfeasibleBudgetError as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def _solve(self, iteration: int, current: PrecisionPlan, fixed: Mapping[str, str | None]) -> CycleReport:
        costs = cost_tables(self.statistics, self.snip.snip_loss_weight, self.snip.snip_update_weight,
                            formats=self.planner.formats)
        # Passes a precision schedule fixes from the next step on are pins the budgets do not count.
        problem = build_problem(self.modules, costs, self.planner, current=current, fixed=fixed)
        plan, solution = solve_plan(problem, self.planner, fixed)
        chosen = {name: (0.0 if fixed["fwd"] else costs.forward[name][plan[name].fwd],
                         0.0 if fixed["bwd"] else costs.backward[name][plan[name].bwd])
                  for name in costs.forward}
        per_layer: dict[int, float] = {}
        for name, (fwd, bwd) in chosen.items():
            layer = parse_module_name(name)[0]
            per_layer[layer] = per_layer.get(layer, 0.0) + fwd + bwd
        return CycleReport(
            iteration=iteration, plan=plan, solver=solution.solver, objective=solution.objective,
            gap=solution.gap, solve_seconds=solution.seconds, cycle_seconds=0.0,
            fp4_fraction=solution.fp4_fraction, stage_fp4_fraction=dict(solution.stage_fp4_fraction),
            time_ratio=solution.time_ratio, stage_time_ratio=dict(solution.stage_time_ratio),
            time_target=problem.time_target,
            loss_divergence=sum(f for f, _ in chosen.values()),
            update_divergence=sum(b for _, b in chosen.values()), layer_divergence=per_layer,
            decisions=decisions(plan, costs, self.planner.formats, speed=self.planner.speed, pins=self.planner.pins,
                                fixed=fixed),
            unresolved_curvatures=unresolved_curvatures(self.statistics))

    def write_statistics(self, directory: str, iteration: int) -> str | None:
        """The last cycle's statistics and decision as one JSON file, and its plan as megatron-core
        per-module precision configs next to it (rank 0 writes, atomically): ``snip_iter_N.json``,
        ``snip_iter_N.yaml`` (the plan at PP 1) and under PP > 1 ``snip_iter_N.pp<stage>[.vp<chunk>].yaml``
        (te_precision_config.megatron_config_files). Returns the JSON's path."""
        if self.statistics is None or dist.get_rank() != 0:
            return None
        os.makedirs(directory, exist_ok=True)
        stem = os.path.join(directory, f"snip_iter_{iteration:07d}")
        report = self.reports[-1] if self.reports else None
        speed = self.speed_model
        run = RunSettings(
            dims=self.dims, tokens=self.step.tokens, layout=self.layout, formats=tuple(self.planner.formats),
            budget=self.snip.snip_budget,
            fp4_target=self.snip.snip_fp4_target, time_target=self.snip.snip_time_target,
            split_passes=self.snip.snip_split_passes,
            speed_model=SpeedModelRecord(speed.name, dict(speed.throughput), speed.source),
            speeds=dict(self.planner.speed), recipe=self.recipe, pins=dict(self.planner.pins))
        write_text_atomic(stem + ".json", json.dumps({
            "schema_version": STATISTICS_SCHEMA_VERSION,
            "run": run.to_dict(), "statistics": self.statistics.to_dict(),
            "cycle": report.to_dict() if report is not None else None,
            "divergences": {n: {fmt: asdict(d) for fmt, d in per.items()}
                            for n, per in divergences(self.statistics).items()}}, indent=1))
        if report is not None:
            write_text_atomic(stem + ".decisions.txt", decision_table(report.decisions) + "\n")
            self._write_megatron_configs(stem, report.plan, iteration)
        return stem + ".json"

    def _write_megatron_configs(self, stem: str, plan: PrecisionPlan, iteration: int) -> None:
        try:
            files = megatron_config_files(plan, self.recipe, self.layout,
                                          source=f"the SNIP cycle at iteration {iteration}")
        except ValueError as e:
            if not self._config_notice:
                logger.info("[snip] no Megatron-LM precision config (snip_iter_*.yaml) for this run's plans: %s",
                               e)
                self._config_notice = True
            return
        for suffix, text in files.items():
            write_text_atomic(f"{stem}{suffix}.yaml", text)

