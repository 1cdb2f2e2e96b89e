"""Per-module training ablations: the ground truth SNIP's estimates are meant to predict.

An ablation arm trains with one group of linear modules in FP4 (one layer, one module type
across layers, or one module) and every other module in the high format, with no budget. Its
measured loss gap to BF16 is what that group costs in training; SNIP's predicted divergence of the
same plan, and the relative quantization error the local baselines rank by, are scored against it
by rank correlation (results/notebook.md). The oracle arm plans with these costs (oracle.py).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_snip.snip.estimators import cost_tables, local_error_baselines
from megatron_snip.snip.ilp import Plan, SnipProblem, evaluate_plan
from megatron_snip.snip.planner import baseline_formats
from megatron_snip.snip.policies import with_reference
from megatron_snip.snip.statistics import ProbeStatistics

KINDS = ("layers", "types", "modules")
# The arm with no group in FP4 (every unpinned module in the high format): the ablation arms' common
# base, whose gap the oracle subtracts from theirs (oracle.py).
NONE_ARM = "ablate-none"
# What each estimator predicts of an ablation plan (keys of :func:`predictions`), scored against training.
ESTIMATORS = ("snip_divergence", "snip_loss_term", "snip_update_term", "relative_error")


def ablation_groups(problem: SnipProblem, kinds: tuple[str, ...]) -> dict[str, tuple[str, str, set]]:
    """arm name -> (kind, group, unit keys in FP4): ``ablate-layer<i>`` ("layers", layer i),
    ``ablate-<type>`` ("types", that module type in every layer), ``ablate-layer<i>-<type>``
    ("modules", one module)."""
    groups: dict[str, tuple[str, str, set]] = {}
    for u in problem.units:
        kind_type = u.module.rsplit(".", 1)[-1]
        for kind, arm, group in (("layers", f"ablate-layer{u.layer}", str(u.layer)),
                                 ("types", f"ablate-{kind_type}", kind_type),
                                 ("modules", f"ablate-layer{u.layer}-{kind_type}", u.module)):
            if kind in kinds:
                groups.setdefault(arm, (kind, group, set()))[2].add(u.key)
    return groups


def ablation_plans(problem: SnipProblem, kinds: tuple[str, ...], none: bool = False) -> dict[str, Plan]:
    """arm name -> plan: each group of :func:`ablation_groups` in FP4, everything else in the
    problem's default high format; with ``none`` also :data:`NONE_ARM`, nothing in FP4."""
    fp4, high = baseline_formats(problem.formats, problem.fp4_formats)
    if fp4 is None or high is None:
        raise ValueError(f"ablations need an FP4 and a non-FP4 candidate; the candidates are {list(problem.formats)}")
    fp4_units = {arm: keys for arm, (_, _, keys) in ablation_groups(problem, kinds).items()}
    if none:
        fp4_units[NONE_ARM] = set()
    return {arm: {u.key: u.pin or (fp4 if u.key in keys else high) for u in problem.units}
            for arm, keys in fp4_units.items()}


def predictions(problem: SnipProblem, stats: ProbeStatistics, plan: Plan) -> dict[str, float]:
    """What each estimator predicts of ``plan``: SNIP's divergence (loss + update terms, as the
    ILP weighs them), each of its two terms alone (the loss divergence dL/loss and the update
    divergence dU/||u||^2, unweighted), and the summed relative quantization error of the local
    baseline."""
    def under(table: dict) -> float:  # the plan's summed cost under another module -> format table
        if problem.split:
            return float("nan")
        return evaluate_plan(replace(problem, cost=table, fwd_cost=None, bwd_cost=None, current=None,
                                     switch_penalty=0.0), plan).objective

    ev = evaluate_plan(problem, plan)
    return {"snip_divergence": ev.divergence,
            "snip_loss_term": under(cost_tables(stats, 1.0, 0.0, formats=problem.formats).joint),
            "snip_update_term": under(cost_tables(stats, 0.0, 1.0, formats=problem.formats).joint),
            "relative_error": under(with_reference(local_error_baselines(stats)[1], problem.formats)),
            "fp4_fraction": ev.fp4_fraction}
