"""SNIP offline: a cycle's statistics file -> the ILP at a budget -> every policy's plan.

``tools/snip_solve.py`` prints the policies side by side; the lab's ``tools/lab/compare_precision.py``
(``snip_lab/``) trains one branch per plan. Both read the ``snip_iter_*.json`` a ``--snip`` run
writes next to its checkpoints and build every plan here, so a policy means the same thing in both.
A :class:`Variant` is SNIP's cost with other weights on its two terms or another curvature: the
loss-term policies plan with one, and the lab screens more of them (``snip_lab/variants.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from megatron_snip.numerics.registry import precision_format
from megatron_snip.snip import baselines
from megatron_snip.snip.config import CURVATURES
from megatron_snip.snip.estimators import (
    cost_tables,
    fisher_trace,
    local_error_baselines,
    operand_error_baselines,
)
from megatron_snip.snip.feasibility import InfeasibleBudgetError
from megatron_snip.snip.ilp import Plan, SnipProblem, solve
from megatron_snip.snip.statistics import ModuleStatistics, ProbeStatistics


class UnavailablePolicy(ValueError):
    """A policy the statistics cannot plan: they lack what it reads (the Hutchinson curvature of a
    ``--snip-curvature fisher`` run)."""


@dataclass(frozen=True)
class Variant:
    """SNIP's cost ``loss_weight * dL/loss + update_weight * dU/||u||^2`` with the loss term's
    curvature as the statistics measured it (``curvature`` None: the run's ``--snip-curvature``), or
    from the probes' Hutchinson estimate, or from :func:`fisher_curvature`."""

    name: str
    loss_weight: float = 1.0
    update_weight: float = 1.0
    curvature: str | None = None

    def __post_init__(self):
        if self.curvature is not None and self.curvature not in CURVATURES:
            raise ValueError(f"curvature must be one of {CURVATURES}, got {self.curvature!r}")


def fisher_curvature(m: ModuleStatistics) -> float:
    """The module's ``tr H`` as the empirical Fisher of its clean pass gives it (``estimators.fisher_trace``)."""
    return fisher_trace(m.output_grad_sq, m.output_numel, m.out_features)


def measured_curvature(stats: ProbeStatistics) -> str:
    """The curvature the probes measured: the run's ``--snip-curvature`` (statistics before it was recorded
    knew only the Hutchinson one)."""
    return stats.settings.get("curvature", "hutchinson")


def with_curvature(stats: ProbeStatistics, curvature: str | None) -> ProbeStatistics:
    """``stats`` with every module's curvature from ``curvature`` (None: as measured; "hutchinson": as the
    probes measured it, which statistics of a ``--snip-curvature fisher`` run do not hold: UnavailablePolicy)."""
    if curvature is None or curvature == measured_curvature(stats):
        return stats
    if curvature == "hutchinson":
        raise UnavailablePolicy(f"statistics of iteration {stats.iteration} hold no Hutchinson curvature: they were "
                                "measured with --snip-curvature fisher, which runs no Hutchinson passes")
    return replace(stats, modules={n: replace(m, curvature=fisher_curvature(m)) for n, m in stats.modules.items()})


def variant_plan(problem: SnipProblem, stats: ProbeStatistics, variant: Variant, solver: str = "auto") -> Plan:
    """The ILP's plan at ``problem``'s budget with the variant's costs (split problems: per pass)."""
    costs = cost_tables(with_curvature(stats, variant.curvature), variant.loss_weight, variant.update_weight,
                        formats=problem.formats)
    if problem.split:
        return solve(replace(problem, fwd_cost=costs.forward, bwd_cost=costs.backward), solver=solver).plan
    return solve(replace(problem, cost=costs.joint), solver=solver).plan


PolicyMaker = Callable[[SnipProblem, ProbeStatistics, int, str], Plan]


def with_reference(table: dict, formats: Sequence[str]) -> dict:
    """A module -> format table with bf16, the reference, at zero error."""
    return {n: {f: (per[f] if precision_format(f).quantized else 0.0) for f in formats} for n, per in table.items()}


def _min_error(relative: bool, operands: bool = False) -> PolicyMaker:
    """Minimum summed quantization error at the budget: of the forward output (this project's variant)
    or, with ``operands``, of every operand X, W, dY (the SNIP paper's)."""
    error_tables = operand_error_baselines if operands else local_error_baselines

    def make(problem, stats, seed, solver):
        table = error_tables(stats)[1 if relative else 0]
        return baselines.min_quant_error(problem, with_reference(table, problem.formats), solver=solver)
    return make


def _snip_loss_term(curvature: str) -> PolicyMaker:
    """SNIP's ILP with the loss divergence alone (``--snip-update-weight 0``), its curvature from the
    probes' Hutchinson estimate or the empirical Fisher (:func:`fisher_curvature`)."""
    variant = Variant(f"loss term ({curvature})", update_weight=0.0, curvature=curvature)
    return lambda problem, stats, seed, solver: variant_plan(problem, stats, variant, solver)


def _threshold(problem, stats, seed, solver):
    relative = local_error_baselines(stats)[1]
    return baselines.error_threshold(problem, relative)


# Every policy, by the name both tools use (results/notebook.md describes each).
POLICIES: dict[str, PolicyMaker] = {
    "snip": lambda problem, stats, seed, solver: solve(problem, solver=solver).plan,
    "snip-loss-term": _snip_loss_term("hutchinson"),
    "snip-fisher-loss-term": _snip_loss_term("fisher"),
    "uniform": lambda problem, stats, seed, solver: baselines.uniform(problem),
    "nvidia-recipe": lambda problem, stats, seed, solver: baselines.keep_last_high(problem),
    "random": lambda problem, stats, seed, solver: baselines.random_plan(problem, seed=seed),
    "min-quant-error": _min_error(relative=False),
    "min-relative-error": _min_error(relative=True),
    "min-operand-error": _min_error(relative=False, operands=True),
    "min-relative-operand-error": _min_error(relative=True, operands=True),
    "threshold": _threshold,
    "keep-ends-high": lambda problem, stats, seed, solver: baselines.keep_ends_high(problem, first=1, last=1),
    "layer-type": lambda problem, stats, seed, solver: baselines.layer_type_heuristic(problem),
}


def policy_plans(problem: SnipProblem, stats: ProbeStatistics, names: Sequence[str] | None = None, *,
                 seed: int = 0, solver: str = "auto") -> dict[str, Plan | InfeasibleBudgetError | UnavailablePolicy]:
    """Each named policy's (None: every policy's) unit -> format plan at the problem's budget, or the error
    saying why that policy cannot meet it (e.g. uniform FP4 under a time target FP4 cannot reach) or
    cannot plan from these statistics (:class:`UnavailablePolicy`)."""
    unknown = sorted(set(names or ()) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {sorted(POLICIES)}")
    plans: dict[str, Plan | InfeasibleBudgetError | UnavailablePolicy] = {}
    for name in POLICIES if names is None else names:
        try:
            plans[name] = POLICIES[name](problem, stats, seed, solver)
        except (InfeasibleBudgetError, UnavailablePolicy) as e:
            plans[name] = e
    return plans
