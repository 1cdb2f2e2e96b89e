"""The comparison's table (markdown + JSON) and its gap-to-BF16 plot.

Gaps are paired: for each seed, a branch's loss minus the BF16 branch's loss of the same
seed (same trunk, same batches), then the mean and the sample standard deviation over seeds.
The seed-to-seed noise is the standard deviation of the BF16 branches' losses. With the oracle
arm (``oracle.py``), each arm's regret at a budget is paired the same way: its loss minus the
oracle branch's of the same seed.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from megatron_snip.fileio import write_text_atomic

from .ablation import ESTIMATORS, NONE_ARM, spearman
from .comparison import REFERENCE, Branch, BranchResult, ComparisonConfig, branches
from .oracle import ORACLE


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan for the deviation of fewer than two values)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def summarize(config: ComparisonConfig, results: dict[tuple[str, int], BranchResult],
              every: list[Branch] | None = None, predicted: dict[int, dict] | None = None,
              oracle: dict | None = None) -> dict:
    """One row per (budget, arm) with per-seed numbers and the paired gaps to BF16; with
    ablation arms (``predicted``: seed -> arm -> ablation.predictions), their table and the rank
    correlations of each estimator with the measured gaps; with the oracle arm, each budget row's
    paired regret to it and (``oracle``: ``{"costs": OracleCosts as a dict, "predicted": branch
    name -> seed -> additive prediction}``) the gap additivity predicts for its plan."""
    every = branches(config) if every is None else every
    ref = {s: results[(REFERENCE, s)] for s in config.seeds if (REFERENCE, s) in results}
    ref_valid = [r.final_valid_loss for r in ref.values()]
    rows = []
    names = {}
    for b in every:
        names.setdefault(b.name, b)
    for name, b in names.items():
        per_seed = {s: results[(name, s)] for s in config.seeds if (name, s) in results}
        if not per_seed:
            continue
        paired = [s for s in per_seed if s in ref]
        valid = mean_std([r.final_valid_loss for r in per_seed.values()])
        gap = mean_std([per_seed[s].final_valid_loss - ref[s].final_valid_loss for s in paired])
        train_gap = mean_std([per_seed[s].mean_train_loss - ref[s].mean_train_loss for s in paired])
        rows.append({
            "arm": b.arm, "budget": None if b.budget is None else b.budget.label, "seeds": sorted(per_seed),
            "valid_loss": valid[0], "valid_loss_std": valid[1],
            "gap": gap[0], "gap_std": gap[1], "train_gap": train_gap[0], "train_gap_std": train_gap[1],
            "fp4_fraction": statistics.fmean(r.fp4_fraction for r in per_seed.values()),
            "time_ratio": statistics.fmean(r.time_ratio for r in per_seed.values()),
            "per_seed": {s: {"valid_loss": r.final_valid_loss, "mean_train_loss": r.mean_train_loss,
                             "fp4_fraction": r.fp4_fraction, "time_ratio": r.time_ratio}
                         for s, r in per_seed.items()},
        })
        if b.budget is not None:
            rows[-1].update(_regret(results, per_seed, f"{ORACLE}_{b.budget.tag}", config.seeds))
            additive = (oracle or {}).get("predicted", {}).get(name, {})
            rows[-1]["additive_prediction"] = statistics.fmean(additive.values()) if additive else math.nan
    noise = mean_std(ref_valid)[1]
    return {"rows": rows, "bf16_seed_std": noise, "train_iters": config.train_iters,
            "trunk_iters": config.trunk_iters, "window": config.branch_window,
            "ablation": _ablation(rows, predicted or {}), "oracle": (oracle or {}).get("costs"),
            "complete": len(results) == len(every)}


def _regret(results: dict[tuple[str, int], BranchResult], per_seed: dict[int, BranchResult], oracle: str,
            seeds) -> dict:
    """A budget row's regret: its loss minus the oracle branch's of the same seed (validation and
    training window), mean and sample std over the seeds that have both; nan without an oracle."""
    paired = [s for s in seeds if s in per_seed and (oracle, s) in results]
    val = mean_std([per_seed[s].final_valid_loss - results[(oracle, s)].final_valid_loss for s in paired])
    train = mean_std([per_seed[s].mean_train_loss - results[(oracle, s)].mean_train_loss for s in paired])
    return {"regret": val[0], "regret_std": val[1], "train_regret": train[0], "train_regret_std": train[1]}


def _ablation(rows: list[dict], predicted: dict[int, dict]) -> dict | None:
    """Ablation rows with each estimator's prediction (mean over seeds' trunks) next to the
    measured gaps, and the Spearman correlation of each estimator with each measured gap."""
    # The all-high arm is the groups' common base, not a group: it ranks nothing.
    rows = [r for r in rows if r["arm"].startswith("ablate-") and r["arm"] != NONE_ARM and not math.isnan(r["gap"])]
    if not rows or not predicted:
        return None
    # Estimators every seed's predictions hold (older prediction files lack the two SNIP terms).
    known = [e for e in ESTIMATORS if all(e in p[r["arm"]] for p in predicted.values() for r in rows if r["arm"] in p)]
    for r in rows:
        for key in known:
            r[key] = statistics.fmean(p[r["arm"]][key] for p in predicted.values() if r["arm"] in p)
    correlation = {f"{est} vs {gap}": spearman([r[est] for r in rows], [r[gap] for r in rows])
                   for est in known for gap in ("gap", "train_gap")}
    return {"arms": [r["arm"] for r in rows], "estimators": known, "spearman": correlation}


ESTIMATOR_LABELS = {"snip_divergence": "SNIP predicted divergence", "snip_loss_term": "SNIP loss term",
                    "snip_update_term": "SNIP update term", "relative_error": "relative quant. error"}

def _pm(mean: float, std: float, digits: int = 4) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:+.{digits}f}" + ("" if math.isnan(std) else f" ± {std:.{digits}f}")


def markdown(summary: dict) -> str:
    lines = [f"Branches from iteration {summary['trunk_iters']} to {summary['train_iters']}; gap = loss - bf16 loss "
             f"of the same seed, mean ± sample std over seeds; train gap over the last {summary['window']} "
             f"iterations. BF16 seed-to-seed std of the validation loss: "
             + ("n/a (one seed)" if math.isnan(summary["bf16_seed_std"]) else f"{summary['bf16_seed_std']:.4f}")
             + ". Estimated GEMM time: under the run's speed model (an estimate).", "",
             "| budget | policy | seeds | FP4 FLOPs | est. GEMM time | val loss | gap to bf16 | train gap |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        lines.append(f"| {r['budget'] or '-'} | {r['arm']} | {len(r['seeds'])} | {r['fp4_fraction']:.1%} | "
                     f"{r['time_ratio']:.3f} | {r['valid_loss']:.4f} | "
                     f"{'-' if r['arm'] == REFERENCE else _pm(r['gap'], r['gap_std'])} | "
                     f"{'-' if r['arm'] == REFERENCE else _pm(r['train_gap'], r['train_gap_std'])} |")
    if summary.get("ablation"):
        known = summary["ablation"]["estimators"]
        lines += ["", "Per-module ablations (one group in FP4, the rest in the high format, no budget): what "
                  "each estimator predicts of the plan at the branch point, and what training measured.", "",
                  "| arm | FP4 FLOPs | " + " | ".join(ESTIMATOR_LABELS[e] for e in known) + " | val gap | train gap |",
                  "|---|---:|" + "---:|" * len(known) + "---:|---:|"]
        for r in summary["rows"]:
            if r["arm"] in summary["ablation"]["arms"]:
                lines.append(f"| {r['arm']} | {r['fp4_fraction']:.1%} | "
                             + " | ".join(f"{r[e]:.4g}" for e in known)
                             + f" | {_pm(r['gap'], r['gap_std'])} | {_pm(r['train_gap'], r['train_gap_std'])} |")
        lines += ["", "Spearman rank correlation with the measured gap: " + "; ".join(
            f"{k} {v:+.2f}" for k, v in summary["ablation"]["spearman"].items()) + "."]
    regret = [r for r in summary["rows"] if not math.isnan(r.get("regret", math.nan))]
    if regret:
        costs = summary.get("oracle") or {}
        lines += ["", "Regret to the oracle (the ILP on the costs the ablations measured"
                  + (f", {costs['source']} ablations of seeds {costs['seeds']}" if costs else "")
                  + "): loss minus the oracle branch's of the same seed, mean ± sample std over seeds. Additive "
                  "prediction: the all-high arm's gap plus the measured costs of the plan's FP4 modules (the "
                  "oracle's own row tests additivity: prediction vs measured gap).", "",
                  "| budget | policy | additive prediction | gap to bf16 | regret (val) | regret (train) |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in regret:
            lines.append(f"| {r['budget']} | {r['arm']} | {_pm(r['additive_prediction'], math.nan)} | "
                         f"{_pm(r['gap'], r['gap_std'])} | {_pm(r['regret'], r['regret_std'])} | "
                         f"{_pm(r['train_regret'], r['train_regret_std'])} |")
    if not summary["complete"]:
        lines += ["", "**Incomplete**: some branches have not finished; rerun the same command to finish them."]
    return "\n".join(lines) + "\n"


def write_report(config: ComparisonConfig, summary: dict, results: dict[tuple[str, int], BranchResult],
                 out: Path) -> None:
    """results.md, results.json and gap_to_bf16.png under ``out``."""
    write_text_atomic(str(out / "results.md"), markdown(summary))
    write_text_atomic(str(out / "results.json"), json.dumps(summary, indent=1))
    _plot(config, results, out / "gap_to_bf16.png")


def _plot(config: ComparisonConfig, results: dict[tuple[str, int], BranchResult], path: Path) -> None:
    """Training-loss gap to BF16 over the branch (mean over seeds): a panel per budget, and one
    for the ablation arms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"{b.label}: training loss - bf16", [(arm, f"{arm}_{b.tag}") for arm in config.policies])
              for b in config.budgets]
    ablations = sorted({name for name, _ in results if name.startswith("ablate-")})
    if ablations:
        panels.append(("ablations: training loss - bf16", [(name, name) for name in ablations]))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, arms) in zip(axes[0], panels):
        for label, name in arms:
            curves = []
            for s in config.seeds:
                mine, ref = results.get((name, s)), results.get((REFERENCE, s))
                if mine is None or ref is None:
                    continue
                steps = sorted(set(mine.train_curve) & set(ref.train_curve))
                curves.append({it: mine.train_curve[it] - ref.train_curve[it] for it in steps})
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            gap = [statistics.fmean(c[it] for c in curves) for it in steps]
            ax.plot(steps, _smooth(gap), label=label)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_title(f"{title} (mean of {len(config.seeds)} seeds, smoothed)", fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("loss gap (nats)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _smooth(values: list[float], width: int = 5) -> list[float]:
    """Trailing moving average (the per-iteration loss gap is noisy)."""
    return [statistics.fmean(values[max(0, i - width + 1):i + 1]) for i in range(len(values))]
