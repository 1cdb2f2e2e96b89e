"""SNIP offline: a cycle's statistics file -> the ILP at a budget -> every policy's plan.

``tools/snip_solve.py`` prints the policies side by side; ``tools/compare_precision.py``
trains one branch per plan. Both read the ``snip_iter_*.json`` a ``--snip`` run writes next
to its checkpoints and build every plan here, so a policy means the same thing in both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.gemm_speed import peak_speed_model
from megatron_snip.precision.recipes import Precision, RecipeConfig
from megatron_snip.snip import policies
from megatron_snip.snip.estimators import cost_tables, local_error_baselines, operand_error_baselines
from megatron_snip.snip.ilp import InfeasibleBudgetError, Plan, SnipProblem, solve
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


PolicyMaker = Callable[[SnipProblem, ProbeStatistics, int, str], Plan]


def with_reference(table: dict, formats: Sequence[str]) -> dict:
    """A module -> format table with bf16, the reference, at zero error."""
    return {n: {f: (0.0 if f == "bf16" else per[f]) for f in formats} for n, per in table.items()}


def _min_error(relative: bool, operands: bool = False) -> PolicyMaker:
    """Minimum summed quantization error at the budget: of the forward output (this project's variant)
    or, with ``operands``, of every operand X, W, dY (the SNIP paper's)."""
    baselines = operand_error_baselines if operands else local_error_baselines

    def make(problem, stats, seed, solver):
        table = baselines(stats)[1 if relative else 0]
        return policies.min_quant_error(problem, with_reference(table, problem.formats), solver=solver)
    return make


def _snip_loss_term(problem, stats, seed, solver):
    """SNIP's ILP with the loss divergence alone (``--snip-update-weight 0``): it orders the module types
    as the training ablations do, the update term the layers (docs/quality.md)."""
    loss_only = cost_tables(stats, 1.0, 0.0, formats=problem.formats)
    if problem.split:
        return solve(replace(problem, fwd_cost=loss_only.forward, bwd_cost=loss_only.backward), solver=solver).plan
    return solve(replace(problem, cost=loss_only.joint), solver=solver).plan


def _threshold(problem, stats, seed, solver):
    relative = local_error_baselines(stats)[1]
    return policies.error_threshold(problem, relative)


# Every policy, by the name both tools use (docs/quality.md describes each).
POLICIES: dict[str, PolicyMaker] = {
    "snip": lambda problem, stats, seed, solver: solve(problem, solver=solver).plan,
    "snip-loss-term": _snip_loss_term,
    "uniform": lambda problem, stats, seed, solver: policies.uniform(problem),
    "nvidia-recipe": lambda problem, stats, seed, solver: policies.keep_last_high(problem),
    "random": lambda problem, stats, seed, solver: policies.random_plan(problem, seed=seed),
    "min-quant-error": _min_error(relative=False),
    "min-relative-error": _min_error(relative=True),
    "min-operand-error": _min_error(relative=False, operands=True),
    "min-relative-operand-error": _min_error(relative=True, operands=True),
    "threshold": _threshold,
    "keep-ends-high": lambda problem, stats, seed, solver: policies.keep_ends_high(problem, first=1, last=1),
    "layer-type": lambda problem, stats, seed, solver: policies.layer_type_heuristic(problem),
}


def policy_plans(problem: SnipProblem, stats: ProbeStatistics, names: Sequence[str] | None = None, *,
                 seed: int = 0, solver: str = "auto") -> dict[str, Plan | InfeasibleBudgetError]:
    """Each named policy's unit -> format plan at the problem's budget, or the error saying why
    that policy cannot meet it (e.g. uniform FP4 under a time target FP4 cannot reach)."""
    unknown = sorted(set(names or ()) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {sorted(POLICIES)}")
    plans: dict[str, Plan | InfeasibleBudgetError] = {}
    for name in names or POLICIES:
        try:
            plans[name] = POLICIES[name](problem, stats, seed, solver)
        except InfeasibleBudgetError as e:
            plans[name] = e
    return plans
