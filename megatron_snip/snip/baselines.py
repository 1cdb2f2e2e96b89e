"""Baseline precision plans at the same FP4 budget as the SNIP ILP.

The SNIP paper compares its ILP plans with: uniform FP4, random layer
choice, minimum quantization error, minimum relative quantization error,
layer-type heuristics and keeping the first/last layers in high precision.
Each function here builds that baseline for a :class:`SnipProblem`: it
honours the problem's pins, meets its budgets (the FP4 share and, when the
problem has one, the estimated GEMM time; globally and, with ``per_stage``,
in every stage) and returns a plan ``unit key -> format`` that
:func:`evaluate_plan` (re-exported here) scores under the problem's costs, so
plans can be compared side by side (:func:`format_comparison`).
:func:`min_fp4_cost` is the ILP on any per-unit FP4 cost, e.g. one measured
by training (the comparison's oracle, ``snip_lab/oracle.py``).

A target that no plan can meet already fails when the problem is built
(:class:`InfeasibleTargetError`); :func:`uniform` raises the same error when
its one format cannot meet the target.

Unless stated otherwise a baseline uses two formats: ``fp4_format`` for the
units it puts in FP4 (default: "nvfp4" if a candidate, else the first FP4
candidate) and ``high_format`` for the rest (default: "fp8" if a candidate,
else the first non-FP4 candidate).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from megatron_snip.snip.feasibility import (
    FRACTION_TOL,
    TARGET_FLAG,
    InfeasibleBudgetError,
    InfeasibleTargetError,
    capacity_text,
)
from megatron_snip.snip.ilp import (
    FWD,
    CostTable,
    DecisionUnit,
    Plan,
    PlanEvaluation,
    SnipProblem,
    UnitKey,
    evaluate_plan,
    solve,
)
from megatron_snip.snip.planner import baseline_formats

__all__ = [
    "DEFAULT_TYPE_ORDER",
    "baseline_formats",
    "error_threshold",
    "evaluate_plan",
    "format_comparison",
    "keep_ends_high",
    "keep_last_high",
    "layer_type_heuristic",
    "min_fp4_cost",
    "min_quant_error",
    "min_relative_quant_error",
    "random_plan",
    "uniform",
]

# Layer-type heuristic: module types put in FP4 first to last. The MLP GEMMs
# hold most of the FLOPs (so the fewest modules need converting) and are
# commonly reported as the most tolerant; the attention output projection,
# which writes straight into the residual stream, goes last.
DEFAULT_TYPE_ORDER = ("linear_fc1", "linear_fc2", "linear_qkv", "linear_proj")

# random_plan's random weights: small enough that no draw outweighs a plan with fewer FP4 FLOPs
# (the units' random parts sum to at most RANDOM_TIE * units * the largest unit's FLOPs), large
# enough that the solver's 1e-9 objective tolerance tells the draws apart.
RANDOM_TIE = 1e-6


def uniform(problem: SnipProblem, fmt: str | None = None) -> dict[UnitKey, str]:
    """Every unpinned unit in ``fmt`` (default: the default FP4 format).

    Raises :class:`InfeasibleTargetError` when that plan misses the budget,
    e.g. a uniform FP8 plan with a target above what the pins put in FP4.
    """
    fmt = _baseline_format(problem, None, fp4=True) if fmt is None else fmt
    if fmt not in problem.formats:
        raise ValueError(f"uniform: unknown format {fmt!r}; candidates are {list(problem.formats)}")
    plan = {u.key: u.pin or fmt for u in problem.units}
    ev = evaluate_plan(problem, plan)
    if not ev.meets_target and problem.time_target is not None and ev.fp4_fraction >= problem.target - FRACTION_TOL:
        raise InfeasibleBudgetError(f"a uniform {fmt} plan misses the time target {problem.time_target:.6g}: its "
                                    f"estimated GEMM time is {ev.time_ratio:.6g} of the all-BF16 time")
    if not ev.meets_target:
        reached = min(ev.stage_fp4_fraction.values()) if problem.per_stage else ev.fp4_fraction
        raise InfeasibleTargetError(
            f"FP4 target {problem.target:.6g} is not met by a uniform {fmt} plan: it runs "
            f"{capacity_text(ev.fp4_fraction, ev.stage_fp4_fraction, problem.per_stage)} of the FLOPs "
            f"in FP4. Choose an FP4 format or lower {TARGET_FLAG}.",
            target=problem.target, largest_feasible=reached,
            global_max=ev.fp4_fraction, stage_max=ev.stage_fp4_fraction,
        )
    return plan


def random_plan(problem: SnipProblem, seed: int = 0, *, fp4_format: str | None = None,
                high_format: str | None = None, solver: str = "auto") -> dict[UnitKey, str]:
    """A random choice of FP4 units that meets the budgets as tightly as discrete units allow.

    Of the two-format plans that meet the budgets, those with the fewest FP4 FLOPs (in every
    budget scope); among them the one whose FP4 units have the least ``flops * (1 + RANDOM_TIE * r)``,
    ``r`` one ``numpy.random.default_rng(seed).random()`` draw per unit in the problem's unit order.
    Units of equal FLOPs (a type's GEMMs in every layer) are so chosen uniformly at random, and so
    is which of several equally tight mixes of types. (Filling in a random order instead overshoots
    the target by up to the last unit's share: 80% FP4 at a 75% target on a 4-layer model.)
    """
    r = np.random.default_rng(seed).random(len(problem.units))
    largest = max(u.flops for u in problem.units)
    weight = {u.key: u.flops / largest * (1.0 + RANDOM_TIE * x) for u, x in zip(problem.units, r)}
    return _two_format_ilp(problem, weight, fp4_format, high_format, solver, None, 0.0)


def min_fp4_cost(problem: SnipProblem, fp4_cost: Mapping[UnitKey, float], *, fp4_format: str | None = None,
                 high_format: str | None = None, solver: str = "auto",
                 time_limit: float | None = None) -> dict[UnitKey, str]:
    """The ILP over the two baseline formats with ``fp4_cost[unit key]`` (>= 0, any unit) the cost
    of running that unit in FP4 and the high format free: the plan meeting the budgets whose
    FP4 units cost least in total, solved to optimality (``mip_gap`` 0)."""
    missing = [u.key for u in problem.units if u.pin is None and u.key not in fp4_cost]
    if missing:
        raise ValueError(f"min_fp4_cost: no FP4 cost for {len(missing)} unit(s), e.g. {missing[:3]}")
    bad = {k: c for k, c in fp4_cost.items() if not (math.isfinite(c) and c >= 0)}
    if bad:
        raise ValueError(f"min_fp4_cost: costs must be finite and >= 0, got {dict(list(bad.items())[:3])}")
    return _two_format_ilp(problem, fp4_cost, fp4_format, high_format, solver, time_limit, 0.0)


def min_quant_error(problem: SnipProblem, error: CostTable, bwd_error: CostTable | None = None, *,
                    solver: str = "auto", time_limit: float | None = None) -> dict[UnitKey, str]:
    """The ILP with the cost replaced by a quantization-error statistic.

    ``error[module][format]`` is e.g. ``||E_f||_F^2`` of the forward GEMM
    output; in split mode ``error`` scores the forward pass and
    ``bwd_error`` the backward passes. Pins, budget and per-stage setting
    are the problem's; the switching penalty is dropped (a pure baseline).
    """
    return _ilp_plan(problem, error, bwd_error, solver, time_limit)


def min_relative_quant_error(problem: SnipProblem, rel_error: CostTable, bwd_rel_error: CostTable | None = None,
                             *, solver: str = "auto", time_limit: float | None = None) -> dict[UnitKey, str]:
    """As :func:`min_quant_error` with a relative statistic, e.g. ``||E_f||^2 / ||X W^T||^2``."""
    return _ilp_plan(problem, rel_error, bwd_rel_error, solver, time_limit)


def keep_ends_high(problem: SnipProblem, first: int = 1, last: int = 1, *, fp4_format: str | None = None,
                   high_format: str | None = None) -> dict[UnitKey, str]:
    """Keep the first ``first`` and last ``last`` layers high precision, the rest FP4.

    As the rule is practised, every unpinned unit outside the protected
    layers goes FP4 even when that overshoots the target (the evaluation
    shows the FP4 fraction reached). If the budget is still not met,
    protected layers are released innermost first (farthest from either
    end of the network), unit by unit, until it is.
    """
    if first < 0 or last < 0:
        raise ValueError(f"keep_ends_high: first and last must be >= 0, got {first}, {last}")
    lo, hi = _layer_span(problem)
    is_protected = {u.key: u.layer < lo + first or u.layer > hi - last for u in problem.units}
    fp4 = _baseline_format(problem, fp4_format, fp4=True)
    start = {u.key: fp4 for u in problem.units if not is_protected[u.key]}
    protected = [u for u in problem.units if is_protected[u.key]]
    return _fill(problem, _center_out(problem, protected), fp4_format, high_format, start)


def keep_last_high(problem: SnipProblem, *, fp4_format: str | None = None,
                   high_format: str | None = None) -> dict[UnitKey, str]:
    """NVIDIA's NVFP4 pretraining recipe at the problem's budget: layers go FP4 from the first
    on, so the last layers (about 15% of the linear FLOPs in the NVFP4 pretraining paper and
    Megatron-Bridge's NVFP4 presets; here whatever the budget leaves) stay high precision."""
    return _fill(problem, sorted(problem.units, key=lambda u: u.layer), fp4_format, high_format)


def error_threshold(problem: SnipProblem, rel_error: CostTable, *, fp4_format: str | None = None,
                    high_format: str | None = None) -> dict[UnitKey, str]:
    """An error-threshold switch: a GEMM runs FP4 unless its measured relative quantization error
    crosses a threshold (no production stack ships this as a named feature; Transformer Engine's
    debug tools can disable quantization per GEMM by configuration); the threshold is the lowest
    that meets the budget, i.e. units go FP4 in increasing order of ``rel_error[module][fp4 format]``."""
    fp4 = _baseline_format(problem, fp4_format, fp4=True)
    order = sorted(problem.units, key=lambda u: rel_error[u.module][fp4])
    return _fill(problem, order, fp4, high_format)


def layer_type_heuristic(problem: SnipProblem, order: Sequence[str] = DEFAULT_TYPE_ORDER, *,
                         fp4_format: str | None = None, high_format: str | None = None) -> dict[UnitKey, str]:
    """Module types in ``order`` go FP4 until the budget is met.

    A module's type is the last dotted part of its name ("linear_fc1" in
    "decoder.layers.7.mlp.linear_fc1"). Within a type, layers go center-out
    so the first and last layers, commonly the most sensitive, convert last;
    in split mode a module's forward unit precedes its backward unit. Types
    not in ``order`` follow, center-out.
    """
    rank = {t: r for r, t in enumerate(order)}
    by_type = sorted(_center_out(problem, problem.units),
                     key=lambda u: rank.get(u.module.rsplit(".", 1)[-1], len(rank)))
    return _fill(problem, by_type, fp4_format, high_format)


def format_comparison(problem: SnipProblem, plans: Mapping[str, Plan | Exception]) -> str:
    """A text table scoring each named plan under ``problem``, one line per plan (a policy that
    could not make a plan at this budget is given as the exception, and its line says why)."""
    timed = problem.speed is not None
    head = ("plan", "objective", "divergence", "switched", "FP4 global", "FP4 min stage")
    rows = [(*head, *(("est. time vs bf16", "time max stage") if timed else ()), "meets budget")]
    for name, plan in plans.items():
        if isinstance(plan, Exception):
            rows.append((name, f"n/a: {plan}", *[""] * (len(rows[0]) - 2)))
            continue
        ev: PlanEvaluation = evaluate_plan(problem, plan)
        time = (f"{ev.time_ratio:.4f}", f"{max(ev.stage_time_ratio.values()):.4f}") if timed else ()
        rows.append((name, f"{ev.objective:.6g}", f"{ev.divergence:.6g}", str(ev.n_switched),
                     f"{ev.fp4_fraction:.4f}", f"{min(ev.stage_fp4_fraction.values()):.4f}", *time,
                     "yes" if ev.meets_target else "NO"))
    widths = [max(len(r[c]) for r in rows if len(r[c]) < 40) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _two_format_ilp(problem: SnipProblem, fp4_cost: Mapping[UnitKey, float], fp4_format: str | None,
                    high_format: str | None, solver: str, time_limit: float | None,
                    mip_gap: float) -> dict[UnitKey, str]:
    """The ILP whose candidates are the baseline's FP4 and high formats (plus the pinned units'
    formats), a unit costing ``fp4_cost[key]`` in FP4 and nothing in the high format.

    A pinned format offered to every unit (e.g. bf16 under ``--first-last-layers-bf16``) costs
    twice the largest FP4 cost: it is slower than the high format and counts no FP4 FLOPs, so
    it is never chosen.
    """
    fp4, high = _baseline_format(problem, fp4_format, fp4=True), _baseline_format(problem, high_format, fp4=False)
    pinned = {u.pin for u in problem.units}
    formats = tuple(f for f in problem.formats if f in (fp4, high) or f in pinned)
    other = 2.0 * max((fp4_cost.get(u.key, 0.0) for u in problem.units), default=0.0) or 1.0

    def cost(u: DecisionUnit, f: str) -> float:
        if u.pin is not None:
            return 0.0  # its only choice
        return fp4_cost[u.key] if f == fp4 else 0.0 if f == high else other

    tables: dict[str, dict[str, dict[str, float]]] = {}
    for u in problem.units:
        table = "cost" if not problem.split else ("fwd_cost" if u.key[1] == FWD else "bwd_cost")
        tables.setdefault(table, {})[u.module] = {f: cost(u, f) for f in formats}
    two = replace(problem, formats=formats, fp4_formats=problem.fp4_formats & set(formats), **tables, current=None,
                  switch_penalty=0.0)
    return solve(two, solver, time_limit, mip_gap=mip_gap).plan


def _ilp_plan(problem, table, bwd_table, solver, time_limit) -> dict[UnitKey, str]:
    if problem.split != (bwd_table is not None):
        raise ValueError("give a backward statistic exactly when the problem is in split mode")
    costs = dict(fwd_cost=table, bwd_cost=bwd_table) if problem.split else dict(cost=table)
    baseline = replace(problem, **costs, current=None, switch_penalty=0.0)
    return solve(baseline, solver, time_limit).plan



def _baseline_format(problem: SnipProblem, fmt: str | None, *, fp4: bool) -> str:
    """The format a baseline assigns to the units it puts in FP4 (``fp4``) or leaves out of it.

    ``fmt`` is the caller's choice (checked against the candidates); None takes the candidate
    :func:`baseline_formats` picks."""
    name, kind = ("fp4_format", "FP4") if fp4 else ("high_format", "non-FP4")
    if fmt is not None:
        candidates = [f for f in problem.formats if (f in problem.fp4_formats) == fp4]
        if fmt not in candidates:
            raise ValueError(f"{name} {fmt!r} is not one of the {kind} candidates {candidates}")
        return fmt
    fmt = baseline_formats(problem.formats, problem.fp4_formats)[0 if fp4 else 1]
    if fmt is None:
        raise ValueError(f"the problem has no {kind} candidate format, so FP4 baselines do not apply")
    return fmt


def _layer_span(problem: SnipProblem) -> tuple[int, int]:
    layers = [u.layer for u in problem.units]
    return min(layers), max(layers)


def _center_out(problem: SnipProblem, units: Iterable[DecisionUnit]) -> list[DecisionUnit]:
    """``units`` ordered by distance from the nearer end of the network, largest first.

    Ties (the two layers equally far from the ends) go lower layer first;
    within a layer the problem's unit order is kept (sorting is stable).
    """
    lo, hi = _layer_span(problem)
    return sorted(units, key=lambda u: (-min(u.layer - lo, hi - u.layer), u.layer))


def _fill(problem: SnipProblem, order: Sequence[DecisionUnit], fp4_format: str | None,
          high_format: str | None, start: Mapping[UnitKey, str] | None = None) -> dict[UnitKey, str]:
    """Greedy budget fill shared by the order-based baselines.

    Starts from pins, then ``start``, then ``high_format`` for every other
    unit; walks ``order`` and switches an unpinned, not-yet-FP4 unit to
    ``fp4_format`` while its budget scope (its stage with per-stage
    constraints, else the whole model) is below the FP4 target or, where
    switching saves time, above the time target. ``order`` covering every
    unpinned unit guarantees the FP4 budget is met, since the problem was
    checked feasible when built; a time target the two formats cannot reach
    raises :class:`InfeasibleBudgetError`.
    """
    high = _baseline_format(problem, high_format, fp4=False)
    fp4 = _baseline_format(problem, fp4_format, fp4=True)
    plan = {u.key: u.pin or (start or {}).get(u.key, high) for u in problem.units}

    def scope(u: DecisionUnit) -> int | None:
        return u.stage if problem.per_stage else None

    # deficit[s] = target * FLOPs(s) - FP4 FLOPs(s) and, with a time target, excess[s] = time(s) -
    # T * FLOPs(s) (BF16-FLOP units); met within the same relative slack as evaluate_plan uses.
    timed = problem.time_target is not None
    deficit: dict[int | None, float] = {}
    excess: dict[int | None, float] = {}
    slack: dict[int | None, float] = {}
    for u in problem.units:
        s = scope(u)
        deficit[s] = deficit.get(s, 0.0) + u.flops * (problem.target - (plan[u.key] in problem.fp4_formats))
        if timed:
            excess[s] = excess.get(s, 0.0) + problem.unit_time(u, plan[u.key]) - problem.time_target * u.flops
        slack[s] = slack.get(s, 0.0) + u.flops * FRACTION_TOL
    for u in order:
        s = scope(u)
        if u.pin is not None or plan[u.key] in problem.fp4_formats:
            continue
        saves = problem.unit_time(u, plan[u.key]) - problem.unit_time(u, fp4) if timed else 0.0
        if deficit[s] > slack[s] or (timed and excess[s] > slack[s] and saves > 0):
            plan[u.key] = fp4
            deficit[s] -= u.flops
            if timed:
                excess[s] -= saves
    if timed and not evaluate_plan(problem, plan).meets_target:
        raise InfeasibleBudgetError(
            f"this baseline cannot meet the time target {problem.time_target:.6g}: moving its {high} units to "
            f"{fp4} does not make them fast enough under the speed table {dict(problem.speed)}")
    return plan
