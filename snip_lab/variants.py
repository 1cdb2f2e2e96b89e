"""Estimator variants screened offline against the costs training measured (the oracle's).

A comparison run with the oracle arm (``tools/lab/compare_precision.py --ablations layers types``, or
``modules``) holds, per seed, the SNIP statistics of its branch point and, in ``oracle/costs.json``,
what each module costs in FP4 as the ablations measured it. Each variant here (SNIP's cost with
other weights on its two terms, or another curvature) plans at a budget from the same statistics;
under additivity (:func:`oracle.predicted_gap`) its plan's gap minus the oracle plan's is its
*predicted regret*. That screens an estimator change in seconds, before training tests it: a
variant whose predicted regret is no lower than SNIP's needs no training run (results/notebook.md,
"Estimator variants against the oracle's costs").

The screen inherits the oracle's limits: its costs come from the seeds the ablations ran on, and
the product model (layers x types) assumes a module's cost is its layer's share times its type's.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_snip.numerics.registry import is_fp4
from megatron_snip.precision.plan import PrecisionPlan, parse_module_name
from megatron_snip.snip.config import CURVATURES
from megatron_snip.snip.estimators import cost_tables, divergences, draws_z, unresolved_curvatures
from megatron_snip.snip.ilp import Plan, SnipProblem, evaluate_plan
from megatron_snip.snip.planner import to_precision_plan
from megatron_snip.snip.policies import Variant, measured_curvature, variant_plan, with_curvature
from megatron_snip.snip.statistics import ProbeStatistics
from megatron_snip.snip.statistics_file import Budget, StatisticsFile

from .oracle import OracleCosts, load_costs, oracle_plan, predicted_gap
from .ranks import spearman

VARIANTS = (
    Variant("snip"),
    Variant("loss term", update_weight=0.0),
    Variant("update term", loss_weight=0.0),
    Variant("update x0.3", update_weight=0.3),
    Variant("update x3", update_weight=3.0),
    Variant("fisher loss + update", curvature="fisher"),
    Variant("fisher loss term", update_weight=0.0, curvature="fisher"),
)


def fp4_modules(problem: SnipProblem, plan: Plan) -> list[str]:
    return [u.key for u in problem.units if is_fp4(plan[u.key])]


def module_type(name: str) -> str:
    return parse_module_name(name)[1].rsplit(".", 1)[-1]


def momentum_gain(persistence: float, beta1: float) -> float:
    """How much more squared drift Adam's first moment carries in its steady state than one step
    puts in, for a gradient error whose correlation between steps is ``persistence`` at every lag.

    ``m_t = beta1 m_(t-1) + (1 - beta1) e_t``: one step moves m by ``(1 - beta1) e``, squared
    ``(1 - beta1)^2 s^2``; in the steady state the repeated part ``rho s^2`` adds up whole and the
    independent part ``(1 - rho) s^2`` averages down to ``(1 - beta1) / (1 + beta1)`` of itself::

        gain = (rho + (1 - rho) (1 - beta1) / (1 + beta1)) / (1 - beta1)^2

    1 / (1 - beta1^2) for an independent error (5.3 at beta1 = 0.9), 1 / (1 - beta1)^2 for one that
    repeats exactly (100). Adam's second moment is held fixed (the error is small against the gradient).
    """
    if not -1.0 <= persistence <= 1.0 or not 0.0 <= beta1 < 1.0:
        raise ValueError(f"persistence {persistence} must lie in [-1, 1] and beta1 {beta1} in [0, 1)")
    return (persistence + (1.0 - persistence) * (1.0 - beta1) / (1.0 + beta1)) / (1.0 - beta1) ** 2


def measured_update_stats(stats: ProbeStatistics, by_type: Mapping[str, Mapping[str, Mapping[str, float]]],
                          beta1: float | None = None) -> ProbeStatistics:
    """``stats`` with each module's update term rescaled to what ``tools/lab/snip_validate.py
    --validate-by-type`` measured for its type: the local part by the type's exact own-weight drift over
    SNIP's local sum, the propagated part by its other-weight drift over SNIP's propagated sum.

    With ``beta1``, both are weighted further by :func:`momentum_gain` of the type's backward
    persistence, and each format's update terms scaled back to SNIP's total over the modules: the
    types are re-ranked by what Adam's momentum keeps, the balance with the loss term unchanged.

    Args:
        by_type: format -> module type -> the row ``--validate-by-type`` writes ("SNIP local",
            "bwd: own", "SNIP propagated", "bwd: other", "bwd: persistence"), from the same statistics.
    Returns:
        statistics whose ``cost_tables`` carry the rescaled update terms (the loss term as before).
    Raises:
        ValueError: a measured format or module type of ``stats`` is missing from ``by_type``, or its
            SNIP sums differ from those of ``stats`` (a record of another probe cycle).
    """
    for fmt, rows in by_type.items():
        if fmt not in stats.formats:
            continue
        for kind, terms in type_terms(stats, fmt).items():
            row = rows.get(kind, {})
            for est, key in (("update, local", "SNIP local"), ("update, propagated", "SNIP propagated")):
                if key in row and not math.isclose(row[key], terms[est], rel_tol=1e-6, abs_tol=1e-30):
                    raise ValueError(f"the record's {fmt} '{key}' of {kind} is {row[key]:.6g} where these statistics "
                                     f"give {terms[est]:.6g}: it was measured on another probe cycle")
    scales: dict[str, dict[str, tuple[float, float]]] = {}
    for name, m in stats.modules.items():
        kind = module_type(name)
        for fmt in m.errors:
            row = by_type.get(fmt, {}).get(kind)
            if row is None:
                raise ValueError(f"the --validate-by-type measurements hold no {fmt} row for {kind}")
            gain = momentum_gain(row["bwd: persistence"], beta1) if beta1 is not None else 1.0
            scales.setdefault(name, {})[fmt] = (gain * _ratio(row["bwd: own"], row["SNIP local"]),
                                                gain * _ratio(row["bwd: other"], row["SNIP propagated"]))
    if beta1 is not None:
        table = divergences(stats)
        for fmt in {f for per in scales.values() for f in per}:
            pairs = [(table[n][fmt], scales[n][fmt]) for n in scales if fmt in scales[n]]
            before = sum(d.update_local + d.update_propagated for d, _ in pairs)
            after = sum(d.update_local * a + d.update_propagated * b for d, (a, b) in pairs)
            k = before / after if after > 0 else 1.0
            for n in scales:
                if fmt in scales[n]:
                    a, b = scales[n][fmt]
                    scales[n][fmt] = (a * k, b * k)
    # The local part is the error's own drift (``update_sq``), the propagated one ``propagated`` (statistics
    # before version 3: it grows with ``input_grad_sq``).
    return replace(stats, modules={n: replace(m, errors={
        f: replace(e, update_sq=e.update_sq * scales[n][f][0], input_grad_sq=e.input_grad_sq * scales[n][f][1])
        if e.propagated is None else
        replace(e, update_sq=e.update_sq * scales[n][f][0], propagated=e.propagated * scales[n][f][1])
        for f, e in m.errors.items()}) for n, m in stats.modules.items()})


def _ratio(measured: float, estimated: float) -> float:
    return measured / estimated if estimated > 0 else 1.0  # a zero term stays zero whatever its scale


def type_terms(stats: ProbeStatistics, fmt: str) -> dict[str, dict[str, float]]:
    """Module type -> SNIP's terms in ``fmt`` summed over the type's modules (dimensionless, as the
    ILP weighs them): the loss term with either curvature, the update term's local and propagated
    parts."""
    out: dict[str, dict[str, float]] = {}
    # The Hutchinson curvature only where the probes measured it; the empirical Fisher's from every clean pass.
    curvatures = [c for c in CURVATURES if c == "fisher" or measured_curvature(stats) == "hutchinson"]
    for curvature in curvatures:
        for name, per in divergences(with_curvature(stats, curvature)).items():
            row = out.setdefault(module_type(name), dict.fromkeys(
                [f"loss ({c})" for c in curvatures] + ["update, local", "update, propagated"], 0.0))
            row[f"loss ({curvature})"] += per[fmt].forward
            if curvature == curvatures[0]:
                row["update, local"] += per[fmt].update_local / stats.update_sq
                row["update, propagated"] += per[fmt].update_propagated / stats.update_sq
    return out


def curvature_resolution(stats: ProbeStatistics) -> dict[str, float] | None:
    """How well the Hutchinson draws resolve the modules' curvatures: the median over the modules of
    ``|mean| / standard error`` of their draws, and the fractions unresolved
    (:func:`estimators.unresolved_curvatures`) and negative. None without 2 or more draws."""
    unresolved = unresolved_curvatures(stats)
    if unresolved is None:
        return None
    n = len(stats.modules)
    return {"modules": n,
            "median |mean| / standard error": statistics.median(draws_z(m.curvature_probes)
                                                                for m in stats.modules.values()),
            "unresolved": len(unresolved) / n,
            "negative": sum(m.curvature < 0 for m in stats.modules.values()) / n}


def variant_costs(stats: ProbeStatistics, variant: Variant, fmt: str) -> dict[str, dict[str, float]]:
    """Module -> ``{fmt: the variant's cost}`` (its objective's joint cost table)."""
    return cost_tables(with_curvature(stats, variant.curvature), variant.loss_weight, variant.update_weight,
                       formats=[fmt]).joint


def ablation_rank_correlations(table: Mapping[str, Mapping[str, float]], costs: OracleCosts,
                               fmt: str) -> dict[str, float]:
    """Spearman correlation of a module -> format -> cost table's ``fmt`` costs with what training measured:
    over the modules (their measured costs), and summed per module type (over the 4 types) and per layer
    against those groups' ablations (the arms ``ablate-linear_<type>`` and ``ablate-layer<i>``): does it rank
    them as training does. NaN where the costs hold no such ablations."""
    names = [n for n in table if n in costs.modules]
    out = {"modules": spearman([table[n][fmt] for n in names], [costs.modules[n] for n in names])}
    for kind, key in (("types", module_type), ("layers", lambda n: f"layer{parse_module_name(n)[0]}")):
        predicted: dict[str, float] = {}
        for name, per in table.items():
            predicted[key(name)] = predicted.get(key(name), 0.0) + per[fmt]
        groups = [g for g in predicted if f"ablate-{g}" in costs.groups]
        out[kind] = (spearman([predicted[g] for g in groups], [costs.groups[f"ablate-{g}"] for g in groups])
                     if len(groups) > 1 else math.nan)
    return out


@dataclass(frozen=True)
class Screen:
    """One seed's screen at one budget: variant (and "oracle") -> (FP4 share, predicted gap), the
    plans, each as the precision plan ``--precision-plan`` trains, and the modules each runs in FP4."""

    seed: int
    budget: Budget
    rows: dict[str, tuple[float, float]]
    plans: dict[str, PrecisionPlan]
    fp4: dict[str, list[str]]

    def regret(self, name: str) -> float:
        return self.rows[name][1] - self.rows["oracle"][1]


def screen(stats: StatisticsFile, costs: OracleCosts, budget: Budget, seed: int, *, formats: Sequence[str],
           variants: Sequence[Variant] = VARIANTS, extra_stats: Mapping[str, ProbeStatistics] | None = None,
           solver: str = "auto") -> Screen:
    """Every variant's plan and the oracle's at ``budget`` from one seed's branch-point statistics,
    each with its FP4 share and its gap predicted from the measured costs; ``extra_stats`` adds a row
    per entry, planned with SNIP's cost from other statistics of the same trunk (the update terms
    rescaled by :func:`measured_update_stats`, or another comparison's branch point:
    :func:`branch_points`)."""
    problem = stats.problem(budget, formats=formats, solver=solver)
    plans = {v.name: variant_plan(problem, stats.stats, v, solver) for v in variants}
    plans |= {name: variant_plan(problem, other, VARIANTS[0], solver) for name, other in (extra_stats or {}).items()}
    plans["oracle"] = oracle_plan(problem, costs, solver)
    fp4 = {name: fp4_modules(problem, plan) for name, plan in plans.items()}
    return Screen(seed, budget, {name: (evaluate_plan(problem, plan).fp4_fraction, predicted_gap(costs, fp4[name]))
                                 for name, plan in plans.items()},
                  {name: to_precision_plan(plan, split=problem.split) for name, plan in plans.items()}, fp4)


def load_run(out: Path, costs_path: Path | None = None) -> tuple[dict, OracleCosts, dict[int, StatisticsFile]]:
    """A comparison run's settings, its oracle costs (``costs_path``, default the run's own
    ``oracle/costs.json``) and each seed's branch-point statistics."""
    settings, stats = branch_points(out)
    if costs_path is not None:
        return settings, load_costs(costs_path), stats
    costs_path = out / "oracle" / "costs.json"
    if not costs_path.exists():
        raise ValueError(f"{costs_path} does not exist: {out} is not the --out of a finished comparison with "
                         "the oracle arm (--policies oracle with --ablations); give --oracle-costs")
    return settings, OracleCosts(**json.loads(costs_path.read_text())), stats


def branch_points(out: Path) -> tuple[dict, dict[int, StatisticsFile]]:
    """A comparison run's settings and each seed's branch-point statistics (the seeds whose trunk is done)."""
    settings_path = out / "comparison.json"
    if not settings_path.exists():
        raise ValueError(f"{settings_path} does not exist: {out} is not the --out of a "
                         "tools/lab/compare_precision.py run")
    settings = json.loads(settings_path.read_text())
    stats = {}
    for seed in settings["seeds"]:
        path = out / f"seed{seed}" / "trunk" / "ckpt" / "snip" / f"snip_iter_{settings['trunk_iters']:07d}.json"
        if path.exists():
            stats[seed] = StatisticsFile.load(path)
    if not stats:
        raise ValueError(f"{out}: no seed's trunk has written its SNIP statistics yet")
    return settings, stats


def type_costs(costs: OracleCosts) -> Mapping[str, float]:
    """Module type -> its ablation's measured cost (the arms named ``ablate-<type>``)."""
    return {arm[len("ablate-"):]: c for arm, c in costs.groups.items() if arm.startswith("ablate-linear_")}
