"""SNIP offline: a cycle's statistics file -> the ILP at a budget -> every policy's plan.

``tools/snip_solve.py`` prints the policies side by side; ``tools/compare_precision.py``
trains one branch per plan. Both read the ``snip_iter_*.json`` a ``--snip`` run writes next
to its checkpoints and build every plan here, so a policy means the same thing in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_snip.numerics.registry import precision_format
from megatron_snip.research import policies
from megatron_snip.snip.estimators import local_error_baselines, operand_error_baselines
from megatron_snip.snip.ilp import InfeasibleBudgetError, Plan, SnipProblem, solve
from megatron_snip.snip.statistics import ProbeStatistics

from .variants import Variant, variant_plan

PolicyMaker = Callable[[SnipProblem, ProbeStatistics, int, str], Plan]


def with_reference(table: dict, formats: Sequence[str]) -> dict:
    """A module -> format table with bf16, the reference, at zero error."""
    return {n: {f: (per[f] if precision_format(f).quantized else 0.0) for f in formats} for n, per in table.items()}


def _min_error(relative: bool, operands: bool = False) -> PolicyMaker:
    """Minimum summed quantization error at the budget: of the forward output (this project's variant)
    or, with ``operands``, of every operand X, W, dY (the SNIP paper's)."""
    baselines = operand_error_baselines if operands else local_error_baselines

    def make(problem, stats, seed, solver):
        table = baselines(stats)[1 if relative else 0]
        return policies.min_quant_error(problem, with_reference(table, problem.formats), solver=solver)
    return make


def _snip_loss_term(curvature: str) -> PolicyMaker:
    """SNIP's ILP with the loss divergence alone (``--snip-update-weight 0``), its curvature from the
    probes' Hutchinson estimate or the empirical Fisher (``variants.fisher_curvature``)."""
    variant = Variant(f"loss term ({curvature})", update_weight=0.0, curvature=curvature)
    return lambda problem, stats, seed, solver: variant_plan(problem, stats, variant, solver)


def _threshold(problem, stats, seed, solver):
    relative = local_error_baselines(stats)[1]
    return policies.error_threshold(problem, relative)


# Every policy, by the name both tools use (docs/quality.md describes each).
POLICIES: dict[str, PolicyMaker] = {
    "snip": lambda problem, stats, seed, solver: solve(problem, solver=solver).plan,
    "snip-loss-term": _snip_loss_term("hutchinson"),
    "snip-fisher-loss-term": _snip_loss_term("fisher"),
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
