#!/usr/bin/env python
"""Offline SNIP: plans for every policy at one or more FP4 targets, from a cycle's statistics.

    python tools/snip_solve.py CKPT/snip/snip_iter_0000100.json --targets 0.5 0.75 0.9
    python tools/snip_solve.py STATS.json --targets 0.75 --write-plans plans/   # plan JSON per policy

For each target it prints every policy's predicted divergence under SNIP's
estimates (loss term, update term, total) and the FP4 FLOP fraction it reaches,
side by side: SNIP's ILP, uniform FP4, random, min quantization error, min
relative quantization error, keep first/last layer high, and the layer-type
heuristic. ``--write-plans`` saves each as a plan file for ``--precision-plan``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_snip.precision.flops import LlamaLinearDims  # noqa: E402
from megatron_snip.snip import policies  # noqa: E402
from megatron_snip.snip.estimators import cost_tables, local_error_baselines  # noqa: E402
from megatron_snip.snip.ilp import InfeasibleTargetError, solve  # noqa: E402
from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules, to_precision_plan  # noqa: E402
from megatron_snip.snip.statistics import ProbeStatistics  # noqa: E402


def with_reference(table: dict, formats) -> dict:
    """Add bf16 (no error) to a module -> format table."""
    return {n: {f: (0.0 if f == "bf16" else per[f]) for f in formats} for n, per in table.items()}


def policy_plans(problem, stats: ProbeStatistics, formats, seed: int, solver: str) -> dict:
    """Every policy's unit -> format plan at the problem's budget."""
    absolute, relative = local_error_baselines(stats)
    return {
        "snip (ILP)": solve(problem, solver=solver).plan,
        "uniform fp4": policies.uniform(problem),
        "random": policies.random_plan(problem, seed=seed),
        "min quant error": policies.min_quant_error(problem, with_reference(absolute, formats), solver=solver),
        "min relative error": policies.min_quant_error(problem, with_reference(relative, formats), solver=solver),
        "keep ends high": policies.keep_ends_high(problem, first=1, last=1),
        "layer-type heuristic": policies.layer_type_heuristic(problem),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("statistics", help="a snip_iter_*.json written by a --snip run")
    p.add_argument("--targets", type=float, nargs="+", default=[0.75])
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
    modules = linear_modules(dims, run["tokens"], run["pipeline_stages"])
    costs = cost_tables(stats, a.loss_weight, a.update_weight, formats=formats)
    for target in a.targets:
        config = PlannerConfig(formats=formats, fp4_target=target, per_stage=per_stage, solver=a.solver)
        try:
            problem = build_problem(modules, costs, config)
        except InfeasibleTargetError as e:
            print(f"target {target}: {e}")
            continue
        plans = policy_plans(problem, stats, formats, a.seed, a.solver)
        print(f"\n== FP4 target {target:.2f} ({'per stage' if per_stage else 'global'}), "
              f"statistics of iteration {stats.iteration}, loss weight {a.loss_weight}, "
              f"update weight {a.update_weight}")
        print(policies.format_comparison(problem, plans))
        if a.write_plans:
            os.makedirs(a.write_plans, exist_ok=True)
            for name, plan in plans.items():
                slug = name.replace(" (ILP)", "").replace(" ", "_")
                to_precision_plan(plan, split=False).save(Path(a.write_plans) / f"{slug}_{target:.2f}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
