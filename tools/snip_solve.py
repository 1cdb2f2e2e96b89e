#!/usr/bin/env python
"""Offline SNIP: plans for every policy at the same budgets, from a cycle's statistics.

    python tools/snip_solve.py CKPT/snip/snip_iter_0000100.json --targets 0.5 0.75 0.9
    python tools/snip_solve.py STATS.json --targets 0.75 --time-targets 0.4
    python tools/snip_solve.py STATS.json --targets 0.75 --write-plans plans/   # plan JSON per policy

A budget is an FP4 target (``--targets``: at least that share of linear-layer FLOPs in FP4,
and the estimated GEMM time of the baselines at that share, as the training run does) or a
time target (``--time-targets``: estimated linear-GEMM time / all-BF16 time at most T). For
each budget it prints, side by side, every policy's predicted divergence under SNIP's
estimates, the FP4 FLOP fraction it reaches and its estimated GEMM time: SNIP's ILP, uniform
FP4, random, min quantization error, min relative quantization error, keep first/last layer
high, and the layer-type heuristic, all at that budget. Times are estimates under the run's
GEMM speed model (``--gemm-speed-model`` to choose another). ``--write-plans`` saves each
plan as a file for ``--precision-plan``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_snip.precision.flops import LlamaLinearDims  # noqa: E402
from megatron_snip.precision.gemm_speed import SPEED_MODELS, peak_speed_model  # noqa: E402
from megatron_snip.precision.recipes import RecipeConfig  # noqa: E402
from megatron_snip.snip import policies  # noqa: E402
from megatron_snip.snip.estimators import cost_tables, local_error_baselines  # noqa: E402
from megatron_snip.snip.ilp import InfeasibleBudgetError, solve  # noqa: E402
from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules, to_precision_plan  # noqa: E402
from megatron_snip.snip.statistics import ProbeStatistics  # noqa: E402


def with_reference(table: dict, formats) -> dict:
    """Add bf16 (no error) to a module -> format table."""
    return {n: {f: (0.0 if f == "bf16" else per[f]) for f in formats} for n, per in table.items()}


def policy_plans(problem, stats: ProbeStatistics, formats, seed: int, solver: str) -> dict:
    """Every policy's unit -> format plan at the problem's budget (or the error saying why a
    policy cannot meet it, e.g. uniform FP4 under a time target FP4 cannot reach)."""
    absolute, relative = local_error_baselines(stats)
    makers = {
        "snip (ILP)": lambda: solve(problem, solver=solver).plan,
        "uniform fp4": lambda: policies.uniform(problem),
        "random": lambda: policies.random_plan(problem, seed=seed),
        "min quant error": lambda: policies.min_quant_error(problem, with_reference(absolute, formats), solver=solver),
        "min relative error": lambda: policies.min_quant_error(problem, with_reference(relative, formats),
                                                               solver=solver),
        "keep ends high": lambda: policies.keep_ends_high(problem, first=1, last=1),
        "layer-type heuristic": lambda: policies.layer_type_heuristic(problem),
    }
    plans = {}
    for name, make in makers.items():
        try:
            plans[name] = make()
        except InfeasibleBudgetError as e:
            plans[name] = e
    return plans


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("statistics", help="a snip_iter_*.json written by a --snip run")
    p.add_argument("--targets", type=float, nargs="*", default=None,
                   help="FP4 targets (default 0.75 when no --time-targets are given)")
    p.add_argument("--time-targets", type=float, nargs="*", default=[],
                   help="estimated GEMM time targets, as a ratio to all-bf16")
    p.add_argument("--gemm-speed-model", choices=[m for m in SPEED_MODELS if m != "measured"], default=None,
                   help="published-peak speed model for the time estimates (default: the run's)")
    p.add_argument("--formats", nargs="+", default=None, help="candidates (default: the run's)")
    p.add_argument("--budget", choices=["per-stage", "global"], default=None, help="default: the run's")
    p.add_argument("--loss-weight", type=float, default=1.0)
    p.add_argument("--update-weight", type=float, default=1.0)
    p.add_argument("--solver", choices=["auto", "gurobi", "highs"], default="auto")
    p.add_argument("--seed", type=int, default=0, help="of the random policy")
    p.add_argument("--write-plans", metavar="DIR", help="save each policy's plan as DIR/<policy>_<target>.json")
    a = p.parse_args(argv)

    try:
        record = json.loads(Path(a.statistics).read_text())
        stats = ProbeStatistics.from_dict(record["statistics"], source=a.statistics)
        run = record["run"]
    except (OSError, ValueError, KeyError) as e:
        p.error(f"{a.statistics}: not a SNIP statistics file ({type(e).__name__}: {e})")
    formats = tuple(a.formats or run["formats"])
    per_stage = (a.budget or run["budget"]) == "per-stage"
    dims = LlamaLinearDims(**run["dims"])
    modules = linear_modules(dims, run["tokens"], run["pipeline_stages"], run.get("virtual_stages", 1))
    costs = cost_tables(stats, a.loss_weight, a.update_weight, formats=formats)
    if a.gemm_speed_model is not None or "speeds" not in run:
        model = peak_speed_model(a.gemm_speed_model or "auto")
        speed = model.precision_speeds(RecipeConfig(), formats)  # this tool plans with the default recipe
        speed_name = model.name
    else:
        speed = {f: run["speeds"][f] for f in formats}
        speed_name = run["speed_model"]["name"]
    fp4_targets = a.targets if a.targets is not None else ([] if a.time_targets else [0.75])
    budgets = [(t, None) for t in fp4_targets] + [(0.0, t) for t in a.time_targets]
    for fp4_target, time_target in budgets:
        config = PlannerConfig(formats=formats, fp4_target=fp4_target, per_stage=per_stage, solver=a.solver,
                               speed=speed, time_target=time_target)
        label = (f"FP4 target {fp4_target:.2f}" if time_target is None
                 else f"time target {time_target:.3f} x bf16")
        try:
            problem = build_problem(modules, costs, config)
        except InfeasibleBudgetError as e:
            print(f"{label}: {e}")
            continue
        plans = policy_plans(problem, stats, formats, a.seed, a.solver)
        print(f"\n== {label} ({'per stage' if per_stage else 'global'}; estimated GEMM time at most "
              f"{problem.time_target:.4f} x bf16 under the {speed_name} speed model), statistics of iteration "
              f"{stats.iteration}, loss weight {a.loss_weight}, update weight {a.update_weight}")
        print(policies.format_comparison(problem, plans))
        if a.write_plans:
            os.makedirs(a.write_plans, exist_ok=True)
            tag = f"{fp4_target:.2f}" if time_target is None else f"time{time_target:.3f}"
            for name, plan in plans.items():
                if isinstance(plan, Exception):
                    continue
                slug = name.replace(" (ILP)", "").replace(" ", "_")
                to_precision_plan(plan, split=False).save(Path(a.write_plans) / f"{slug}_{tag}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
