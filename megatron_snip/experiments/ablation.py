"""Per-module training ablations: the ground truth SNIP's estimates are meant to predict.

An ablation arm trains with one group of linear modules in FP4 (one layer, or one module type
across layers) and every other module in the high format, with no budget. Its measured loss gap
to BF16 is what that group costs in training; SNIP's predicted divergence of the same plan, and
the relative quantization error the local baselines rank by, are scored against it by rank
correlation (docs/quality.md).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from megatron_snip.snip.ilp import Plan, SnipProblem, evaluate_plan
from megatron_snip.snip.policies import baseline_formats
from megatron_snip.snip.statistics import ProbeStatistics

KINDS = ("layers", "types")


def ablation_plans(problem: SnipProblem, kinds: tuple[str, ...]) -> dict[str, Plan]:
    """arm name -> plan: ``ablate-layer<i>`` (layer i in FP4) and ``ablate-<type>`` (that module
    type in FP4 in every layer); everything else in the problem's default high format."""
    fp4, high = baseline_formats(problem.formats, problem.fp4_formats)
    if fp4 is None or high is None:
        raise ValueError(f"ablations need an FP4 and a non-FP4 candidate; the candidates are {list(problem.formats)}")
    groups: dict[str, set] = {}
    for u in problem.units:
        if "layers" in kinds:
            groups.setdefault(f"ablate-layer{u.layer}", set()).add(u.key)
        if "types" in kinds:
            groups.setdefault(f"ablate-{u.module.rsplit('.', 1)[-1]}", set()).add(u.key)
    return {arm: {u.key: u.pin or (fp4 if u.key in keys else high) for u in problem.units}
            for arm, keys in groups.items()}


def predictions(problem: SnipProblem, stats: ProbeStatistics, plan: Plan) -> dict[str, float]:
    """What each estimator predicts of ``plan``: SNIP's divergence (loss + update terms, as the
    ILP weighs them) and the summed relative quantization error of the local baseline."""
    from megatron_snip.snip.estimators import local_error_baselines
    from megatron_snip.snip.offline import with_reference

    relative = with_reference(local_error_baselines(stats)[1], problem.formats)
    ev = evaluate_plan(problem, plan)
    rel = evaluate_plan(replace(problem, cost=relative, fwd_cost=None, bwd_cost=None, current=None,
                                switch_penalty=0.0), plan) if not problem.split else None
    return {"snip_divergence": ev.divergence, "relative_error": rel.objective if rel else float("nan"),
            "fp4_fraction": ev.fp4_fraction}


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties; nan below three pairs)."""
    if len(x) != len(y):
        raise ValueError("spearman: x and y differ in length")
    if len(x) < 3:
        return float("nan")

    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = v.argsort(kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):  # ties share their mean rank
            r[v == value] = r[v == value].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])
