"""Offline SNIP: plans for every policy at the same budgets, from a cycle's statistics.

    python tools/snip_solve.py CKPT/snip/snip_iter_0000100.json --targets 0.5 0.75 0.9
    python tools/snip_solve.py STATS.json --targets 0.75 --time-targets 0.4
    python tools/snip_solve.py STATS.json --targets 0.75 --write-plans plans/   # plan JSON per policy
    python tools/snip_solve.py STATS.json --targets 0.75 --write-megatron-configs yaml/   # Megatron-LM YAML

A budget is an FP4 target (``--targets``: at least that share of linear-layer FLOPs in FP4,
and the estimated GEMM time of the baselines at that share, as the training run does) or a
time target (``--time-targets``: estimated linear-GEMM time / all-BF16 time at most T). For
each budget it prints, side by side, every policy's predicted divergence under SNIP's
estimates, the FP4 FLOP fraction it reaches and its estimated GEMM time: SNIP's ILP (also on
its loss term alone, with the Hutchinson or the empirical-Fisher curvature), uniform FP4,
NVIDIA's recipe (last layers high), random, min (relative) output quantization error, min
(relative) operand quantization error (the paper's best_quant_err / best_rel_quant_err), an
error-threshold switch (a GEMM goes high precision when its measured relative quantization error
crosses a threshold, the lowest threshold that meets the budget), keep first/last layer high,
and the layer-type heuristic, all at that budget (megatron_snip/snip/policies.py). Times are
estimates under the run's GEMM speed model (``--gemm-speed-model`` to choose another). ``--write-plans`` saves each
plan as a file for ``--precision-plan``; ``--write-megatron-configs`` as megatron-core's per-module
precision config for Megatron-LM's ``--te-precision-config-file`` (docs/snip.md, "Plans as Megatron-LM
precision configs"), one file per model chunk too under the run's pipeline layout. The run's pins
(``--first-last-layers-bf16``, a ``--te-precision-config-file`` under ``--snip``) hold in every plan.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_snip.precision.config import SPEED_MODELS
from megatron_snip.precision.te_precision_config import megatron_config_files
from megatron_snip.snip import baselines
from megatron_snip.snip.feasibility import InfeasibleBudgetError
from megatron_snip.snip.planner import to_precision_plan
from megatron_snip.snip.policies import POLICIES, policy_plans
from megatron_snip.snip.statistics_file import Budget, StatisticsFile


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
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=None, help="default: all")
    p.add_argument("--loss-weight", type=float, default=1.0)
    p.add_argument("--update-weight", type=float, default=1.0)
    p.add_argument("--solver", choices=["auto", "gurobi", "highs"], default="auto")
    p.add_argument("--seed", type=int, default=0, help="of the random policy")
    p.add_argument("--write-plans", metavar="DIR",
                   help="save each policy's plan as DIR/<policy>_<budget>.json (for --precision-plan)")
    p.add_argument("--write-megatron-configs", metavar="DIR",
                   help="save each policy's plan as DIR/<policy>_<budget>.yaml, megatron-core's per-module precision "
                        "config (Megatron-LM --te-precision-config-file; the plan at pipeline size 1), and under the "
                        "run's PP > 1 DIR/<policy>_<budget>.pp<stage>[.vp<chunk>].yaml per model chunk; plans a "
                        "Transformer Engine recipe cannot state (mxfp4, split passes) are skipped with a note")
    a = p.parse_args(argv)

    try:
        source = StatisticsFile.load(a.statistics)
    except ValueError as e:
        p.error(str(e))
    fp4_targets = a.targets if a.targets is not None else ([] if a.time_targets else [0.75])
    budgets = [Budget(t) for t in fp4_targets] + [Budget(time_target=t) for t in a.time_targets]
    per_stage = None if a.budget is None else a.budget == "per-stage"
    for budget in budgets:
        try:
            problem = source.problem(budget, formats=a.formats, per_stage=per_stage, loss_weight=a.loss_weight,
                                     update_weight=a.update_weight, solver=a.solver, speed_model=a.gemm_speed_model)
        except InfeasibleBudgetError as e:
            print(f"{budget.label}: {e}")
            continue
        plans = policy_plans(problem, source.stats, a.policies, seed=a.seed, solver=a.solver)
        print(f"\n== {budget.label} ({'per stage' if problem.per_stage else 'global'}; estimated GEMM time at most "
              f"{problem.time_target:.4f} x bf16 under the {source.speed_model_name(a.gemm_speed_model)} speed "
              f"model), statistics of iteration {source.stats.iteration}, loss weight {a.loss_weight}, "
              f"update weight {a.update_weight}")
        print(baselines.format_comparison(problem, plans))
        for name, plan in plans.items():
            if isinstance(plan, Exception):
                continue
            plan = to_precision_plan(plan, split=problem.split)
            if a.write_plans:
                os.makedirs(a.write_plans, exist_ok=True)
                plan.save(Path(a.write_plans) / f"{name}_{budget.tag}.json")
            if a.write_megatron_configs:
                write_megatron_configs(plan, source, Path(a.write_megatron_configs) / f"{name}_{budget.tag}",
                                       f"policy {name} at {budget.label} ({a.statistics})")
    return 0


def write_megatron_configs(plan, source: StatisticsFile, stem: Path, label: str) -> None:
    """``plan`` as STEM.yaml (and STEM.pp<s>[.vp<v>].yaml per model chunk) under the run's recipe and layout."""
    run = source.run
    try:
        files = megatron_config_files(plan, run.recipe, run.layout, source=label)
    except ValueError as e:
        print(f"no Megatron-LM precision config for {label}: {e}")
        return
    stem.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in files.items():
        Path(f"{stem}{suffix}.yaml").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
