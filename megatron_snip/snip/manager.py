"""The SNIP precision manager: probe, estimate, gather, solve on one rank, broadcast, apply.

It sits beside the training loop: at every ``--snip-interval`` iterations (by
default the checkpoint interval) the trainer calls :meth:`PrecisionManager.cycle`
on every rank, after the optimizer step and before the checkpoint, so the
checkpoint holds the new plan. The cycle reads statistics and writes the plan;
it leaves parameters, gradients, optimizer state, RNG states and the training
data position untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass

import torch.distributed as dist

from megatron_snip.fileio import write_text_atomic
from megatron_snip.precision.plan import PrecisionPlan, parse_module_name
from megatron_snip.snip.estimators import cost_tables, divergences
from megatron_snip.snip.ilp import InfeasibleBudgetError
from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules, solve_plan
from megatron_snip.snip.probes import ProbeConfig, gather_across_pipeline, run_probe_cycle
from megatron_snip.snip.statistics import ProbeStatistics


@dataclass
class CycleReport:
    """What one cycle decided and what it cost; identical on every rank after the broadcast."""

    iteration: int
    plan: dict  # PrecisionPlan.to_dict()
    solver: str
    objective: float
    gap: float
    solve_seconds: float
    cycle_seconds: float
    fp4_fraction: float
    stage_fp4_fraction: dict[int, float]
    time_ratio: float  # the plan's estimated linear-GEMM time / all-bf16 (under the run's speed model)
    stage_time_ratio: dict[int, float]
    time_target: float  # the time budget the ILP held the plan to (given, or implied by the FP4 target)
    loss_divergence: float  # sum over modules of alpha * dL/loss of the chosen formats
    update_divergence: float  # sum over modules of beta * dU/||u||^2 of the chosen formats
    layer_divergence: dict[int, float]  # per layer, both terms


class PrecisionManager:
    """Re-plans the precision of every linear module from measured divergences."""

    def __init__(self, trainer, args: argparse.Namespace, planner: PlannerConfig):
        self.trainer, self.args = trainer, args
        self.probe = ProbeConfig(formats=tuple(f for f in args.snip_formats if f != "bf16"),
                                 hutchinson_probes=args.snip_probe_passes,
                                 perturbation_probes=args.snip_probe_passes, seed=args.seed)
        self.planner = planner
        self.modules = linear_modules(trainer.linear_dims, args.global_batch_size * args.seq_length,
                                      args.pipeline_model_parallel_size,
                                      args.virtual_pipeline_model_parallel_size or 1)
        self.statistics: ProbeStatistics | None = None
        self.reports: list[CycleReport] = []

    def due(self, iteration: int) -> bool:
        return iteration % self.args.snip_interval == 0

    def cycle(self, iteration: int) -> CycleReport | None:
        """One full cycle, collective over all ranks; applies the new plan before returning.
        None (nothing measured or changed) when the precision schedule fixes every GEMM."""
        start = time.perf_counter()
        t = self.trainer
        fixed = t.schedule.fixed(iteration + 1)
        if fixed["fwd"] and fixed["bwd"]:
            return None
        # The next global batch, read through a loader of its own: the training iterator does not move.
        probe_data = t.batches("train", t.state.consumed_samples)
        stats = run_probe_cycle(t.model, t.optimizer, t.precision, probe_data,
                                num_microbatches=self.args.num_microbatches, seq_length=self.args.seq_length,
                                micro_batch_size=self.args.micro_batch_size, config=self.probe,
                                iteration=iteration)
        self.statistics = gather_across_pipeline(stats)
        report = self._solve_on_rank0(iteration)
        t.set_plan(PrecisionPlan.from_dict(report.plan, source=f"SNIP cycle at iteration {iteration}"))
        report.cycle_seconds = time.perf_counter() - start
        self.reports.append(report)
        return report

    def _solve_on_rank0(self, iteration: int) -> CycleReport:
        box: list = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = self._solve(iteration)
            except InfeasibleBudgetError as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def _solve(self, iteration: int) -> CycleReport:
        costs = cost_tables(self.statistics, self.args.snip_loss_weight, self.args.snip_update_weight,
                            formats=self.planner.formats)
        # Passes a precision schedule fixes from the next step on are pins the budgets do not count.
        fixed = self.trainer.schedule.fixed(iteration + 1)
        problem = build_problem(self.modules, costs, self.planner, current=self.trainer.plan, fixed=fixed)
        plan, solution = solve_plan(problem, self.planner, fixed)
        chosen = {name: (0.0 if fixed["fwd"] else costs.forward[name][plan[name].fwd],
                         0.0 if fixed["bwd"] else costs.backward[name][plan[name].bwd])
                  for name in costs.forward}
        per_layer: dict[int, float] = {}
        for name, (fwd, bwd) in chosen.items():
            layer = parse_module_name(name)[0]
            per_layer[layer] = per_layer.get(layer, 0.0) + fwd + bwd
        return CycleReport(
            iteration=iteration, plan=plan.to_dict(), solver=solution.solver, objective=solution.objective,
            gap=solution.gap, solve_seconds=solution.seconds, cycle_seconds=0.0,
            fp4_fraction=solution.fp4_fraction, stage_fp4_fraction=dict(solution.stage_fp4_fraction),
            time_ratio=solution.time_ratio, stage_time_ratio=dict(solution.stage_time_ratio),
            time_target=problem.time_target,
            loss_divergence=sum(f for f, _ in chosen.values()),
            update_divergence=sum(b for _, b in chosen.values()), layer_divergence=per_layer)

    def write_statistics(self, directory: str, iteration: int) -> str | None:
        """The last cycle's statistics and decision as one JSON file (rank 0 writes, atomically)."""
        if self.statistics is None or dist.get_rank() != 0:
            return None
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"snip_iter_{iteration:07d}.json")
        report = asdict(self.reports[-1]) if self.reports else None
        speed = self.trainer.speed_model
        run = {"dims": asdict(self.trainer.linear_dims), "tokens": self.args.global_batch_size * self.args.seq_length,
               "pipeline_stages": self.args.pipeline_model_parallel_size,
               "virtual_stages": self.args.virtual_pipeline_model_parallel_size or 1, "formats": list(self.planner.formats),
               "budget": self.args.snip_budget, "fp4_target": self.args.snip_fp4_target,
               "time_target": self.args.snip_time_target, "split_passes": self.args.snip_split_passes,
               "speed_model": {"name": speed.name, "throughput": dict(speed.throughput), "source": speed.source},
               "speeds": dict(self.planner.speed)}
        write_text_atomic(path, json.dumps({
            "run": run, "statistics": self.statistics.to_dict(), "cycle": report,
            "divergences": {n: {fmt: asdict(d) for fmt, d in per.items()}
                            for n, per in divergences(self.statistics).items()}}, indent=1))
        return path


def log_cycle(logger, report: CycleReport, num_layers: int) -> None:
    """Console line and TensorBoard panels of one cycle (on the logging rank)."""
    from megatron_snip.snip.plan_image import plan_image

    plan = PrecisionPlan.from_dict(report.plan, source="cycle report")
    logger.log(report.iteration, {
        "fp4 flops fraction": report.fp4_fraction, "estimated gemm time vs bf16": report.time_ratio,
        "objective": report.objective,
        "loss divergence": report.loss_divergence, "update divergence": report.update_divergence,
        "solve seconds": report.solve_seconds, "cycle seconds": report.cycle_seconds,
    }, prefix="snip")
    logger.scalars({f"snip/layer divergence/{layer:03d}": v for layer, v in report.layer_divergence.items()},
                   report.iteration)
    logger.image("snip/plan (rows: layers; qkv, proj, fc1, fc2 x fwd|bwd)", plan_image(plan, num_layers),
                 report.iteration)
    logger.text(f"[snip] iteration {report.iteration}: solver {report.solver}, gap {report.gap:.2g}; per stage: FP4 "
                f"fraction " + ", ".join(f"{s}: {v:.3f}" for s, v in report.stage_fp4_fraction.items())
                + "; estimated GEMM time vs bf16 " + ", ".join(f"{s}: {v:.3f}" for s, v in report.stage_time_ratio.items())
                + f" (budget {report.time_target:.3f})")
