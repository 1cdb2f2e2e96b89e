"""A SNIP cycle's statistics file (``snip_iter_N.json``) and the ILP it defines at a budget.

A ``--snip`` run writes one file per cycle next to its checkpoints (docs/snip.md, "The statistics
file"). ``tools/snip_report.py`` plots it, ``tools/snip_solve.py`` re-solves it at other budgets, and
the comparisons in ``snip_lab/`` build every policy's plan from it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_snip.numerics.recipes import Precision, RecipeConfig
from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.gemm_speed import peak_speed_model
from megatron_snip.snip.estimators import cost_tables
from megatron_snip.snip.ilp import SnipProblem
from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules
from megatron_snip.snip.statistics import STATISTICS_SCHEMA_VERSION, ProbeStatistics


@dataclass(frozen=True)
class Budget:
    """An FP4 target (share of linear FLOPs in FP4, at least) or a time target (estimated
    linear-GEMM time / all-BF16 time, at most; the FP4 share is then free)."""

    fp4_target: float = 0.0
    time_target: float | None = None

    @property
    def tag(self) -> str:
        """File-name tag: ``fp4-0.75`` or ``time-0.400``."""
        return f"fp4-{self.fp4_target:.2f}" if self.time_target is None else f"time-{self.time_target:.3f}"

    @property
    def label(self) -> str:
        return (f"FP4 target {self.fp4_target:.2f}" if self.time_target is None
                else f"time target {self.time_target:.3f} x bf16")


@dataclass(frozen=True)
class StatisticsFile:
    """A ``snip_iter_*.json``: the gathered statistics and the run settings they were taken under."""

    path: str
    stats: ProbeStatistics
    run: dict

    @classmethod
    def load(cls, path: str | Path) -> StatisticsFile:
        """Raises ValueError naming the file when it is not a SNIP statistics file."""
        try:
            record = json.loads(Path(path).read_text())
            version = record.get("schema_version", 0)
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: not a SNIP statistics file written by a --snip run "
                             f"({type(e).__name__}: {e})") from e
        if version > STATISTICS_SCHEMA_VERSION:
            raise ValueError(f"{path}: statistics file schema version {version} is newer than this program's "
                             f"{STATISTICS_SCHEMA_VERSION}; read it with the megatron-snip that wrote it")
        try:
            return cls(str(path), ProbeStatistics.from_dict(record["statistics"], source=str(path)), record["run"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a SNIP statistics file written by a --snip run "
                             f"({type(e).__name__}: {e})") from e

    def problem(self, budget: Budget, *, formats: Sequence[str] | None = None, per_stage: bool | None = None,
                loss_weight: float = 1.0, update_weight: float = 1.0, solver: str = "auto",
                speed_model: str | None = None) -> SnipProblem:
        """The ILP at ``budget`` with the run's candidates, budget scope and speeds unless given, and
        the run's pins (``--first-last-layers-bf16``, ``--te-precision-config-file`` under ``--snip``).

        Raises :class:`InfeasibleBudgetError` when no plan can meet the budget.
        """
        run = self.run
        formats = tuple(formats or run["formats"])
        per_stage = run["budget"] == "per-stage" if per_stage is None else per_stage
        modules = linear_modules(LlamaLinearDims(**run["dims"]), run["tokens"], run["pipeline_stages"],
                                 run.get("virtual_stages", 1))
        costs = cost_tables(self.stats, loss_weight, update_weight, formats=formats)
        config = PlannerConfig(formats=formats, fp4_target=budget.fp4_target, per_stage=per_stage, solver=solver,
                               speed=self.speeds(formats, speed_model), time_target=budget.time_target,
                               pins={n: Precision.parse(p) for n, p in run.get("pins", {}).items()})
        return build_problem(modules, costs, config)

    def speeds(self, formats: Sequence[str], speed_model: str | None = None) -> dict[str, float]:
        """precision -> GEMM throughput relative to bf16: the run's, or a published-peak model's."""
        if speed_model is None and "speeds" in self.run and all(f in self.run["speeds"] for f in formats):
            return {f: self.run["speeds"][f] for f in formats}
        model = peak_speed_model(speed_model or "auto")
        return dict(model.precision_speeds(RecipeConfig(), formats))  # offline plans use the default recipe

    def speed_model_name(self, speed_model: str | None = None) -> str:
        if speed_model is None and "speed_model" in self.run:
            return self.run["speed_model"]["name"]
        return peak_speed_model(speed_model or "auto").name
