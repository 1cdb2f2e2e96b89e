"""Screen estimator variants offline against the oracle's measured costs.

    python tools/lab/screen_estimators.py runs/oracle_prose8                 # the run's budgets
    python tools/lab/screen_estimators.py runs/oracle_prose8 --targets 0.75 0.9 --json screen.json
    python tools/lab/screen_estimators.py runs/qs8 --by-type 'by_type_s{seed}.json'   # + the measured update drift

Reads a finished comparison with the oracle arm (``tools/lab/compare_precision.py --policies oracle
... --ablations layers types``): each seed's branch-point SNIP statistics and ``oracle/costs.json``
(or ``--oracle-costs FILE``: then the comparison's trunks are enough).
For every budget and seed it plans with each estimator variant (SNIP's cost with other weights on
its loss and update terms, or the loss term's curvature from the empirical Fisher instead of the
Hutchinson probes; snip_lab/variants.py) and with the oracle, and prints each plan's
FP4 share, its gap predicted from the measured costs (additivity) and its predicted regret (that
gap minus the oracle plan's), the mean over seeds. Below, each module type's summed terms beside
what its ablation measured, and per seed how well the Hutchinson draws resolve the curvatures
(docs/snip.md, "Unresolved curvatures").

With ablations of two or more seeds, each budget also gets the cross-fit (snip_lab/crossfit.py): the
oracle planned without one ablation seed, every plan priced with the other seeds' costs and with the
held-out seed's; the oracle's excess beyond the variants' is its optimism, how much its choice
exploited noise in the costs (results/notebook.md, "Estimator variants against the oracle's costs").

``--other NAME=DIR`` adds a row planned with SNIP's default cost from another comparison's
branch-point statistics of the same trunks, measured with other probe settings (e.g. DIR run with
``-- ... --snip-gain-exclude embedding``): what those settings would plan, against the same oracle.

``--by-type`` adds two rows from each seed's ``tools/lab/snip_validate.py --validate-by-type --output``
on the same trunk: SNIP's update term rescaled per module type to the exact drift measured, and
that weighted by how much of it Adam's momentum keeps (its persistence between batches,
``variants.momentum_gain``), re-normalised to SNIP's total (results/notebook.md, "Why SNIP ranks qkv
and fc1 above fc2"). Nothing trains: a variant whose predicted regret is no lower than
SNIP's is not worth a training run; one that is lower still needs one (results/notebook.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from megatron_snip.numerics.registry import is_fp4
from megatron_snip.snip.estimators import UNRESOLVED_Z, local_error_baselines, operand_error_baselines
from megatron_snip.snip.feasibility import InfeasibleBudgetError
from megatron_snip.snip.statistics_file import Budget
from snip_lab.ablation import NONE_ARM
from snip_lab.branches import REFERENCE, Branch, branch_results, final_losses
from snip_lab.crossfit import Fold, cross_fit
from snip_lab.oracle import ORACLE, oracle_groups
from snip_lab.variants import (
    VARIANTS,
    ablation_rank_correlations,
    branch_points,
    curvature_resolution,
    load_run,
    measured_update_stats,
    screen,
    type_costs,
    type_terms,
    variant_costs,
)

# The error baselines' tables (their policies' costs, megatron_snip/snip/policies.py) ranked beside the variants.
BASELINE_TABLES = {
    "operand error (min-operand-error)": lambda stats: operand_error_baselines(stats)[0],
    "relative operand error": lambda stats: operand_error_baselines(stats)[1],
    "output error (min-quant-error)": lambda stats: local_error_baselines(stats)[0],
    "relative output error (min-relative-error, threshold)": lambda stats: local_error_baselines(stats)[1],
}


def ranked_table(stats, name: str, fmt: str) -> dict[str, dict[str, float]]:
    """The cost table of the variant or error baseline ``name``."""
    if name in BASELINE_TABLES:
        return BASELINE_TABLES[name](stats)
    return variant_costs(stats, next(v for v in VARIANTS if v.name == name), fmt)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="the --out directory of a tools/lab/compare_precision.py run with the oracle arm")
    p.add_argument("--oracle-costs", metavar="FILE", default=None,
                   help="the oracle's costs (another comparison's OUT/oracle/costs.json), for a run whose oracle arm "
                        "has not written its own (its trunks are enough)")
    p.add_argument("--targets", type=float, nargs="+", default=None,
                   help="FP4 targets (default: the run's FP4 targets)")
    p.add_argument("--solver", choices=["auto", "gurobi", "highs"], default="auto")
    p.add_argument("--json", metavar="FILE", help="also write every seed's rows here")
    p.add_argument("--by-type", metavar="PATTERN",
                   help="each seed's tools/lab/snip_validate.py --validate-by-type --output of its trunk's branch "
                        "point, "
                        "'{seed}' standing for the seed (e.g. 'by_type_s{seed}.json'): adds the update term "
                        "rescaled to the measured drift, and weighted by what Adam's momentum keeps")
    p.add_argument("--other", metavar="NAME=DIR", action="append", default=[],
                   help="a row NAME planned with SNIP's cost from the branch-point statistics of the comparison DIR, "
                        "the same trunks measured with other probe settings (repeatable)")
    p.add_argument("--write-plans", metavar="DIR",
                   help="also write every row's plan, DIR/seedS/<row>_fp4-<target>.json (spaces as '-'), for "
                        "pretrain_llama.py --precision-plan: a variant worth training, from the same trunk")
    a = p.parse_args(argv)
    if a.write_plans is not None:
        try:
            Path(a.write_plans).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            p.error(f"--write-plans {a.write_plans}: cannot create the folder ({e.strerror}); give a writable path")
    if a.by_type is not None and "{seed}" not in a.by_type:
        p.error(f"--by-type {a.by_type}: the pattern must hold '{{seed}}' (one file per seed, e.g. "
                "'by_type_s{seed}.json')")
    bad = [t for t in a.targets or () if not 0.0 < t <= 1.0]
    if bad:
        p.error(f"--targets {' '.join(map(str, bad))}: an FP4 target is a share of the linear FLOPs, in (0, 1] "
                "(e.g. --targets 0.75 0.9)")
    try:
        settings, costs, stats = load_run(Path(a.run), a.oracle_costs and Path(a.oracle_costs))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        extra = by_type_rows(a.by_type, stats, adam_beta1(settings)) if a.by_type else {}
    except ValueError as e:
        print(f"error: --by-type {a.by_type}: {e}", file=sys.stderr)
        return 2
    for other in a.other:
        try:
            for seed, row in other_rows(other, stats).items():
                extra.setdefault(seed, {}).update(row)
        except ValueError as e:
            print(f"error: --other {other}: {e}", file=sys.stderr)
            return 2
    targets = a.targets or [float(tag[len("fp4-"):]) for tag in settings["budgets"] if tag.startswith("fp4-")]
    fmt = next(f for f in settings["formats"] if is_fp4(f))
    print(f"{a.run}: oracle costs from the {costs.source} ablations of seeds {costs.seeds}; "
          f"statistics of seeds {sorted(stats)} at iteration {settings['trunk_iters']}")
    record, fits = [], []
    for target in targets:
        try:
            screens = [screen(sf, costs, Budget(target), seed, formats=settings["formats"],
                              extra_stats=extra.get(seed), solver=a.solver)
                       for seed, sf in stats.items()]
        except InfeasibleBudgetError as e:
            print(f"error: --targets {target}: {e}", file=sys.stderr)
            return 2
        print(f"\nFP4 target {target:.2f}: predicted from the measured costs (mean over {len(screens)} seeds)\n")
        print("| variant | FP4 FLOPs | predicted gap | predicted regret |\n|---|---:|---:|---:|")
        for name in [v.name for v in VARIANTS] + list(next(iter(extra.values()), {})) + ["oracle"]:
            share = statistics.fmean(s.rows[name][0] for s in screens)
            gap = statistics.fmean(s.rows[name][1] for s in screens)
            regret = statistics.fmean(s.regret(name) for s in screens)
            print(f"| {name} | {share:.1%} | {gap:+.4f} | {regret:+.4f} |")
        record += [{"seed": s.seed, "fp4_target": target, "rows": s.rows} for s in screens]
        folds = print_cross_fit(Path(a.run), settings, stats, screens, target, a.solver)
        fits += [{"fp4_target": target, "held_out": f.held_out, "in_sample": f.in_sample,
                  "held_out_price": f.held_out_price} for f in folds]
        if a.write_plans:
            for s in screens:
                folder = Path(a.write_plans) / f"seed{s.seed}"
                folder.mkdir(parents=True, exist_ok=True)
                for name, plan in s.plans.items():
                    plan.save(folder / f"{name.replace(' ', '-')}_fp4-{target:.2f}.json")
    measured = type_costs(costs)
    print(f"\nSpearman correlation of each variant's {fmt} cost, and of the error baselines' tables, with the "
          "measured cost, over the modules, and summed per module type and per layer against those groups' "
          "ablations (mean over seeds):\n")
    print("| variant | modules | module types | layers |\n|---|---:|---:|---:|")
    groups = {}
    for name in [v.name for v in VARIANTS] + list(BASELINE_TABLES):
        try:
            per_seed = [ablation_rank_correlations(ranked_table(sf.stats, name, fmt), costs, fmt)
                        for sf in stats.values()]
        except ValueError as e:  # statistics too old to hold the operands' errors
            print(f"| {name} | {e} | | |")
            continue
        groups[name] = {kind: statistics.fmean(r[kind] for r in per_seed) for kind in ("modules", "types", "layers")}
        print(f"| {name} | {groups[name]['modules']:+.2f} | {groups[name]['types']:+.2f} | "
              f"{groups[name]['layers']:+.2f} |")
    print(f"\nSNIP's terms in {fmt} summed per module type (statistics of seed {min(stats)}) and the type's measured "
          "cost (its ablation)\n")
    terms = type_terms(stats[min(stats)].stats, fmt)
    columns = list(next(iter(terms.values())))
    print("| type | " + " | ".join(columns) + " | measured |\n|---|" + "---:|" * (len(columns) + 1))
    for kind, row in terms.items():
        print(f"| {kind} | " + " | ".join(f"{row[c]:.2g}" for c in columns)
              + f" | {measured.get(kind, float('nan')):.4f} |")
    resolution = {seed: curvature_resolution(sf.stats) for seed, sf in stats.items()}
    if any(r is not None for r in resolution.values()):
        print(f"\nHow well the Hutchinson draws resolve the curvatures ({UNRESOLVED_Z:g} standard errors; "
              "docs/snip.md, \"Unresolved curvatures\")\n")
        print("| seed | modules | median \\|mean\\| / standard error | unresolved | negative |\n"
              "|---|---:|---:|---:|---:|")
        for seed, r in resolution.items():
            if r is not None:
                print(f"| {seed} | {r['modules']} | {r['median |mean| / standard error']:.2f} | {r['unresolved']:.0%} "
                      f"| {r['negative']:.0%} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"run": a.run, "screens": record, "cross_fit": fits, "type_terms": terms,
                                            "rank_correlations": groups,
                                            "type_costs": dict(measured), "curvature_resolution": resolution},
                                           indent=1))
    return 0


def print_cross_fit(run: Path, settings: dict, stats: dict, screens: list, target: float, solver: str) -> list[Fold]:
    """Print the cross-fit at ``target`` (snip_lab/crossfit.py) and return its folds; nothing where the run's
    oracle costs did not come from its own ablations of two or more seeds."""
    problem = stats[min(stats)].problem(Budget(target), formats=settings["formats"], solver=solver)
    groups = oracle_groups(problem, tuple(settings.get("ablations", ())))
    if not groups:
        return []
    seeds = settings["seeds"]
    losses = final_losses(branch_results(run, [Branch(arm, None, s) for arm in [*groups, NONE_ARM, REFERENCE]
                                                for s in seeds]))
    plans = {s.seed: {name: modules for name, modules in s.fp4.items() if name != ORACLE} for s in screens}
    try:
        folds = cross_fit(problem, groups, losses, REFERENCE, plans, solver)
    except ValueError as e:
        print(f"\nNo cross-fit: {e}")
        return []
    if not folds:
        return []
    print(f"\nCross-fit at FP4 target {target:.2f} (snip_lab/crossfit.py): the oracle planned on the ablation costs "
          "of all seeds but one; each plan's gap predicted with those costs (in-sample) and with the held-out "
          f"seed's alone, mean over the held-out seeds {[f.held_out for f in folds]}\n")
    print("| plan | in-sample | held out | excess |\n|---|---:|---:|---:|")
    for name in folds[0].in_sample:
        print(f"| {name} | {statistics.fmean(f.in_sample[name] for f in folds):+.4f} "
              f"| {statistics.fmean(f.held_out_price[name] for f in folds):+.4f} "
              f"| {statistics.fmean(f.excess(name) for f in folds):+.4f} |")
    optimism = [f.optimism() for f in folds]
    spread = f" ± {statistics.stdev(optimism):.4f} (sd over folds)" if len(optimism) > 1 else ""
    print(f"\nThe oracle's optimism (its excess minus the other plans' mean): "
          f"{statistics.fmean(optimism):+.4f}{spread}")
    trained = trained_excess(run / "results.json", Budget(target).label)
    if trained is not None:
        print(f"Trained (results.json): the oracle's gap is {trained:+.4f} above its additive prediction (that "
              "prediction from the costs of every ablation seed, one more than each fold's)")
    return folds


def trained_excess(report: Path, label: str) -> float | None:
    """The trained oracle's validation gap minus its additive prediction at the budget ``label``, from a
    comparison's report; None without one."""
    if not report.exists():
        return None
    rows = [r for r in json.loads(report.read_text())["rows"]
            if r["arm"] == ORACLE and r["budget"] == label and r.get("additive_prediction") is not None]
    return rows[0]["gap"] - rows[0]["additive_prediction"] if rows else None


MEASURED, MEASURED_MOMENTUM = "update measured by type", "update measured by type x momentum"


def adam_beta1(settings: dict) -> float:
    """The run's ``--adam-beta1`` (Megatron's default 0.9 where its flags do not set it)."""
    args = settings.get("train_args", [])
    return float(args[args.index("--adam-beta1") + 1]) if "--adam-beta1" in args else 0.9


def other_rows(spec: str, stats: dict) -> dict[int, dict]:
    """seed -> {NAME: the statistics of comparison DIR's branch point} for ``--other NAME=DIR``; refused
    unless DIR holds every seed's statistics of the same trunk (the same iteration, modules and clean loss)."""
    name, sep, folder = spec.partition("=")
    if not sep or not name or not folder:
        raise ValueError("give NAME=DIR, e.g. 'no embedding drift=runs/qs8n'")
    _, other = branch_points(Path(folder))
    out = {}
    for seed, sf in stats.items():
        theirs = other.get(seed)
        if theirs is None:
            raise ValueError(f"{folder} has no statistics of seed {seed}'s trunk; run its comparison with --seeds "
                             f"{' '.join(map(str, sorted(stats)))}")
        mine, their = sf.stats, theirs.stats
        if (mine.iteration, sorted(mine.modules), mine.loss) != (their.iteration, sorted(their.modules), their.loss):
            raise ValueError(f"seed {seed}: {folder}'s branch point is not this run's (iteration, modules or clean "
                             "loss differ): it must be the same trunk with other probe settings")
        out[seed] = {name: their}
    return out


def by_type_rows(pattern: str, stats: dict, beta1: float) -> dict[int, dict]:
    """seed -> the two rescaled statistics of ``--by-type``, from the file ``pattern`` names for the seed."""
    out = {}
    for seed, sf in stats.items():
        path = Path(pattern.format(seed=seed))
        if not path.exists():
            raise ValueError(f"{path} does not exist: run tools/lab/snip_validate.py --validate-by-type "
                             f"--output {path} "
                             f"on seed {seed}'s trunk (docs/snip.md, \"By module type\")")
        record = json.loads(path.read_text())
        if record.get("iteration") != sf.stats.iteration or "by_type" not in record:
            raise ValueError(f"{path} is not a --validate-by-type record of iteration {sf.stats.iteration}, the "
                             f"branch point of seed {seed}")
        try:
            out[seed] = {MEASURED: measured_update_stats(sf.stats, record["by_type"]),
                         MEASURED_MOMENTUM: measured_update_stats(sf.stats, record["by_type"], beta1)}
        except ValueError as e:
            raise ValueError(f"{path}: {e} (run --validate-by-type on seed {seed}'s trunk of this run)") from e
    return out
