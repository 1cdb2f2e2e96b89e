"""The comparison's table (markdown + JSON) and its gap-to-BF16 plot.

Gaps are paired: for each seed, a branch's loss minus the BF16 branch's loss of the same
seed (same trunk, same batches), then the mean and the sample standard deviation over seeds.
The seed-to-seed noise is the standard deviation of the BF16 branches' losses; the noise floor
(``comparison.NOISE``, BF16 again on another data order) is the gap of an arm that differs from
BF16 in nothing but its batches. With the oracle arm (``oracle.py``), each arm's regret at a budget
is paired the same way: its loss minus the oracle branch's of the same seed. At each budget every
arm is also set against SNIP's (the first of :data:`FOCUS` trained, or the arm ``--versus`` names):
the paired difference, its 95% confidence interval (Student's t over the seeds) and its size in
paired standard deviations.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from megatron_snip.arguments.parser import parse_args
from megatron_snip.fileio import write_text_atomic

from .ablation import ESTIMATORS, NONE_ARM
from .branches import NOISE, REFERENCE, REPLANNED, Branch, BranchResult, ComparisonConfig, branches
from .oracle import ORACLE
from .ranks import spearman

# The arm every other arm at a budget is set against: SNIP's, re-planned or its first plan kept.
FOCUS = ("snip", "snip-fixed", "snip-loss-term")
# The oracle's test of the focus arm's plans (docs/evidence.md): its gap to BF16 within ORACLE_RATIO x the
# oracle's, and every arm the oracle leads by LEAD_SD paired standard deviations (validation loss) led by as much.
ORACLE_RATIO = 1.25
LEAD_SD = 2.0
# Student's t, 97.5% quantile, by degrees of freedom (1-30): the 95% interval of a mean over few seeds.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan for the deviation of fewer than two values)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else math.nan)


def ci95(std: float, n: int) -> float:
    """Half-width of the 95% confidence interval of a mean of ``n`` values with sample std ``std``
    (Student's t; beyond 30 degrees of freedom the 30's quantile, slightly wide; nan below 2 values)."""
    if n < 2 or math.isnan(std):
        return math.nan
    return T975[min(n - 1, len(T975)) - 1] * std / math.sqrt(n)


def paired_difference(results: dict[tuple[str, int], BranchResult], a: str, b: str, seeds) -> dict:
    """Branch ``a`` minus branch ``b`` per seed, on the final validation loss and the training window:
    mean, sample std, 95% half-width, over the seeds that have both."""
    both = [s for s in seeds if (a, s) in results and (b, s) in results]
    out = {"seeds": both}
    for key, attr in (("val", "final_valid_loss"), ("train", "mean_train_loss")):
        mean, std = mean_std([getattr(results[(a, s)], attr) - getattr(results[(b, s)], attr) for s in both])
        out.update({key: mean, f"{key}_std": std, f"{key}_ci": ci95(std, len(both))})
    return out


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
            rows[-1].update(_regret(results, per_seed, ref, f"{ORACLE}_{b.budget.tag}", config.seeds))
            additive = (oracle or {}).get("predicted", {}).get(name, {})
            rows[-1]["additive_prediction"] = statistics.fmean(additive.values()) if additive else math.nan
    noise = mean_std(ref_valid)[1]
    return {"rows": rows, "bf16_seed_std": noise, "train_iters": config.train_iters,
            "trunk_iters": config.trunk_iters, "window": config.branch_window,
            "speed_model": _speed_model(config.train_args),
            "noise_floor": paired_difference(results, NOISE, REFERENCE, config.seeds) if config.noise_floor else None,
            "versus_snip": _versus_focus(config, results), "oracle_test": _oracle_test(config, results, rows),
            "ablation": _ablation(rows, predicted or {}), "oracle": (oracle or {}).get("costs"),
            "complete": len(results) == len(every)}


def _speed_model(train_args: tuple[str, ...]) -> str:
    """The runs' ``--gemm-speed-model``, as pretrain_llama.py reads their flags (default, ``--yaml-cfg`` included)."""
    return parse_args(list(train_args)).gemm_speed_model


def _speed_model_line(model: str | None) -> str:
    """What the est. GEMM time column is: which speeds it weighs the plan's GEMMs by."""
    if model is None:  # a report written before the model was recorded
        return "Estimated GEMM time: under the run's speed model (an estimate)."
    if model == "measured":
        return ("Estimated GEMM time: of all-BF16, under `--gemm-speed-model measured` (each format's speed as "
                "measured on the machine that trained; a CPU emulates FP8 and FP4, slower than its BF16, so above "
                "1 there; pass `--gemm-speed-model blackwell` to the runs for a GPU estimate).")
    return f"Estimated GEMM time: of all-BF16, under `--gemm-speed-model {model}` (published peaks, an estimate)."


def _focus(config: ComparisonConfig) -> str | None:
    """The arm every other is set against: ``--versus``, else the first of :data:`FOCUS` trained."""
    return config.versus or next((f for f in FOCUS if f in config.policies), None)


def _versus_focus(config: ComparisonConfig, results: dict[tuple[str, int], BranchResult]) -> list[dict]:
    """At each budget, every other arm minus ``config.versus`` (default SNIP's, :data:`FOCUS`), paired per
    seed (:func:`paired_difference`)."""
    focus = _focus(config)
    if focus is None:
        return []
    rows = []
    for budget in config.budgets:
        mine = f"{focus}_{budget.tag}"
        for arm in config.policies:
            if arm != focus:
                diff = paired_difference(results, f"{arm}_{budget.tag}", mine, config.seeds)
                if diff["seeds"]:
                    rows.append({"budget": budget.label, "arm": arm, "focus": focus, **diff})
    return rows


def _oracle_test(config: ComparisonConfig, results: dict[tuple[str, int], BranchResult],
                 rows: list[dict]) -> list[dict]:
    """At each budget with both the oracle's and the focus arm's branches: the focus arm's gap to BF16 over the
    oracle's (its row's ``ratio_to_oracle``) and, for every other arm, the oracle's and the focus arm's leads over
    it: the arm's loss minus theirs per seed (the seeds all three share), mean / sample std (validation loss and
    training window; +inf for a lead without spread, nan under 2 seeds). ``holds``: the oracle leads by less
    than :data:`LEAD_SD`, or the focus arm leads by as much; None under 2 seeds (no spread to judge by)."""
    focus = _focus(config)
    if focus in (None, ORACLE) or ORACLE not in config.policies:
        return []
    out = []
    for budget in config.budgets:
        mine, oracle = f"{focus}_{budget.tag}", f"{ORACLE}_{budget.tag}"
        row = next((r for r in rows if r["arm"] == focus and r["budget"] == budget.label), None)
        if row is None or not any((oracle, s) in results for s in config.seeds):
            continue
        leads = []
        for arm in config.policies:
            name = f"{arm}_{budget.tag}"
            seeds = [s for s in config.seeds if all((n, s) in results for n in (name, mine, oracle))]
            if arm in (focus, ORACLE) or not seeds:
                continue
            by_oracle = paired_difference(results, name, oracle, seeds)
            by_focus = paired_difference(results, name, mine, seeds)
            lead = {f"{who}_lead{part}": _in_sd(d[key], d[f"{key}_std"])
                    for who, d in (("oracle", by_oracle), ("focus", by_focus))
                    for key, part in (("val", ""), ("train", "_train"))}
            lead["holds"] = (None if math.isnan(lead["oracle_lead"])
                             else lead["oracle_lead"] < LEAD_SD or lead["focus_lead"] >= LEAD_SD)
            leads.append({"arm": arm, "seeds": seeds, **lead})
        ratio = row.get("ratio_to_oracle", math.nan)
        out.append({"budget": budget.label, "focus": focus, "ratio_to_oracle": ratio,
                    "train_ratio_to_oracle": row.get("train_ratio_to_oracle", math.nan),
                    "within": ratio <= ORACLE_RATIO, "leads": leads})
    return out


def _in_sd(mean: float, std: float) -> float:
    """A paired mean in paired standard deviations (+-inf without spread, nan when either is nan)."""
    if math.isnan(mean) or math.isnan(std):
        return math.nan
    return mean / std if std > 0 else math.copysign(math.inf, mean) if mean else 0.0


def _regret(results: dict[tuple[str, int], BranchResult], per_seed: dict[int, BranchResult],
            ref: dict[int, BranchResult], oracle: str, seeds) -> dict:
    """A budget row's regret: its loss minus the oracle branch's of the same seed (validation and
    training window), mean and sample std over the seeds that have both; and its gap to BF16 over the
    oracle's on those seeds (ratio of the mean gaps: the issue's "within 1.25x"); nan without an oracle."""
    paired = [s for s in seeds if s in per_seed and (oracle, s) in results]
    val = mean_std([per_seed[s].final_valid_loss - results[(oracle, s)].final_valid_loss for s in paired])
    train = mean_std([per_seed[s].mean_train_loss - results[(oracle, s)].mean_train_loss for s in paired])
    out = {"regret": val[0], "regret_std": val[1], "regret_ci": ci95(val[1], len(paired)),
           "train_regret": train[0], "train_regret_std": train[1], "train_regret_ci": ci95(train[1], len(paired))}
    for key, attr in (("ratio_to_oracle", "final_valid_loss"), ("train_ratio_to_oracle", "mean_train_loss")):
        both = [s for s in paired if s in ref]
        mine = mean_std([getattr(per_seed[s], attr) - getattr(ref[s], attr) for s in both])[0]
        theirs = mean_std([getattr(results[(oracle, s)], attr) - getattr(ref[s], attr) for s in both])[0]
        out[key] = mine / theirs if both and theirs > 0 else math.nan
    return out


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


def _ci(mean: float, half: float, digits: int = 4) -> str:
    """A mean and its 95% interval: ``+0.0012 [-0.0003, +0.0027]``."""
    if math.isnan(mean):
        return "-"
    interval = "" if math.isnan(half) else f" [{mean - half:+.{digits}f}, {mean + half:+.{digits}f}]"
    return f"{mean:+.{digits}f}" + interval


def _ratio(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}x"


def _sigmas(mean: float, std: float) -> str:
    """A paired difference in paired standard deviations."""
    return _sd(_in_sd(mean, std))


def markdown(summary: dict) -> str:
    lines = [f"Branches from iteration {summary['trunk_iters']} to {summary['train_iters']}; gap = loss - bf16 loss "
             f"of the same seed, mean ± sample std over seeds; train gap over the last {summary['window']} "
             f"iterations. BF16 seed-to-seed std of the validation loss: "
             + ("n/a (one seed)" if math.isnan(summary["bf16_seed_std"]) else f"{summary['bf16_seed_std']:.4f}")
             + ". " + _speed_model_line(summary.get("speed_model")), *_noise_line(summary),
             *_sources_line(summary), "",
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
    versus = summary.get("versus_snip") or []
    if versus:
        focus = versus[0]['focus']
        lines += ["", f"Paired differences to {focus} at each budget (arm minus {focus}, same "
                  "seed; negative: the arm's loss is lower): mean [95% confidence interval, Student's t over the "
                  "seeds] and the mean in paired standard deviations.", "",
                  "| budget | arm | seeds | val difference [95% CI] | val / std | train difference [95% CI] | "
                  "train / std |", "|---|---|---:|---:|---:|---:|---:|"]
        for v in versus:
            lines.append(f"| {v['budget']} | {v['arm']} | {len(v['seeds'])} | {_ci(v['val'], v['val_ci'])} | "
                         f"{_sigmas(v['val'], v['val_std'])} | {_ci(v['train'], v['train_ci'])} | "
                         f"{_sigmas(v['train'], v['train_std'])} |")
    regret = [r for r in summary["rows"] if not math.isnan(r.get("regret", math.nan))]
    if regret:
        costs = summary.get("oracle") or {}
        lines += ["", "Regret to the oracle (the ILP on the costs the ablations measured"
                  + (f", {costs['source']} ablations of seeds {costs['seeds']}" if costs else "")
                  + "): loss minus the oracle branch's of the same seed, mean over seeds [95% confidence interval]; "
                  "the mean gap to BF16 over the oracle's on the same seeds. Additive prediction: the all-high "
                  "arm's gap plus the measured costs of the plan's FP4 modules (the oracle's own row tests "
                  "additivity: prediction vs measured gap); a re-planned arm's, of its first plan.", "",
                  "| budget | policy | additive prediction | gap to bf16 | regret (val) [95% CI] | "
                  "regret (train) [95% CI] | gap / oracle's (val / train) |", "|---|---|---:|---:|---:|---:|---:|"]
        for r in regret:
            first = " (first plan)" if r["arm"] in REPLANNED and not math.isnan(r["additive_prediction"]) else ""
            lines.append(f"| {r['budget']} | {r['arm']} | {_pm(r['additive_prediction'], math.nan)}{first} | "
                         f"{_pm(r['gap'], r['gap_std'])} | {_ci(r['regret'], r['regret_ci'])} | "
                         f"{_ci(r['train_regret'], r['train_regret_ci'])} | "
                         f"{_ratio(r.get('ratio_to_oracle'))} / {_ratio(r.get('train_ratio_to_oracle'))} |")
    lines += _oracle_test_lines(summary.get("oracle_test") or [])
    if not summary["complete"]:
        lines += ["", "**Incomplete**: some arms lack some of the seeds (the seeds column); each paired number uses "
                  "the seeds both of its arms have." if summary.get("sources") else
                  "**Incomplete**: some branches have not finished; rerun the same command to finish them."]
    return "\n".join(lines) + "\n"


def _oracle_test_lines(tests: list[dict]) -> list[str]:
    """The oracle's test as a table: per budget, the focus arm's gap over the oracle's, then each arm's leads."""
    if not tests:
        return []
    focus = tests[0]["focus"]
    lines = ["", f"The oracle's test of {focus}: its gap to BF16 within {ORACLE_RATIO}x the oracle's, and every arm "
             f"the oracle leads by {LEAD_SD:g} paired standard deviations or more (validation loss) led by {focus} by "
             f"{LEAD_SD:g} too. A lead: the arm's loss minus the leader's, same seed (the seeds all three have), mean "
             "over sample std; validation (training window).", "",
             f"| budget | {focus}'s gap / oracle's, val (train) | arm | seeds | oracle's lead, sd | {focus}'s lead, sd "
             "| met |", "|---|---:|---|---:|---:|---:|---|"]
    for t in tests:
        ratio = (f"{_ratio(t['ratio_to_oracle'])} ({_ratio(t['train_ratio_to_oracle'])}): "
                 + ("met" if t["within"] else "**not met**"))
        for lead in t["leads"] or [{}]:
            cells = ([lead["arm"], str(len(lead["seeds"])),
                      *(f"{_sd(lead[f'{who}_lead'])} ({_sd(lead[f'{who}_lead_train'])})"
                        for who in ("oracle", "focus")),
                      _verdict(lead["holds"])] if lead else ["-"] * 5)
            lines.append(f"| {t['budget']} | {ratio} | " + " | ".join(cells) + " |")
    return lines


def _verdict(holds: bool | None) -> str:
    return "not yet (under 2 seeds)" if holds is None else "yes" if holds else "**no**"


def _sd(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:+.1f}"


def _noise_line(summary: dict) -> list[str]:
    """The noise floor's sentence for the report's head (nothing without the noise-floor arm)."""
    floor = summary.get("noise_floor")
    if not floor or not floor["seeds"]:
        return []
    return [f"Noise floor ({NOISE}: BF16 again on another order of the training documents, minus bf16, "
            f"{len(floor['seeds'])} seeds): val {_pm(floor['val'], floor['val_std'])} on the same validation "
            f"samples (its training window, {_pm(floor['train'], floor['train_std'])}, is over other batches: "
            "not a floor for the train gaps, which every other arm measures on bf16's batches)."]


def _sources_line(summary: dict) -> list[str]:
    """A merged report's sources (merge.py); nothing for one comparison's."""
    sources = summary.get("sources")
    if not sources:
        return []
    line = f"Merged from {len(sources)} reports: {', '.join(sources)}."
    if summary.get("speed_model") == "measured":  # a speed table per machine (and load): est. times do not carry over
        line += (" Each report's est. GEMM times were measured on its own machine: where the reports ran on "
                 "different machines, a row mixing their seeds, or two rows from different reports, compare the "
                 "machines as well as the plans (the losses do not depend on it).")
    return [line]


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
