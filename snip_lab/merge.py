"""Several comparisons' reports as one table: seeds or arms trained in separate ``--out`` folders
(other jobs, machines or sessions) summarized over all their seeds (``tools/lab/merge_comparisons.py``).

A report (``OUT/results.json``) keeps every branch's numbers per seed: final validation loss, mean
training loss over the window, FP4 share, estimated GEMM time. The merge collects each (branch,
seed) of every report and summarizes them as one comparison would (``report.summarize``): gaps to
the BF16 branch of the same seed, regrets to the oracle's, every arm against SNIP's with 95%
intervals. What it checks, so that the merged table means what one comparison's would:

- **The same measurement.** Reports must agree on the iterations and the window, and on every
  setting that fixes what a branch measures (model, data, optimizer, formats: the ``settings``
  reports record; a report written before they were recorded is checked on its iterations and
  window only, and named).
- **The same branches.** A branch found in several reports must have the same losses in each (every
  run is deterministic: the same branch from the same trunk trains to the same numbers); the BF16
  branch of a seed in two reports so checks that they share that seed's trunk.
- **One oracle.** The oracle's rows are one arm only when planned from the same costs. Reports whose
  oracles planned with different costs (say, ablations of one seed, then of three) merge with
  ``oracle_from`` naming the report whose oracle rows to keep; the other reports' oracle rows and
  additive predictions (made with other costs) are left out.

Not merged: the training curves (no plot) and the ablation arms' estimator table (each report has its own).
Not checked: the est. GEMM times. Under ``--gemm-speed-model measured`` (the default) each report's come
from the speeds measured on its own machine, which the merged table says under its sources.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_snip.fileio import write_text_atomic
from megatron_snip.snip.statistics_file import Budget

from .branches import ARMS, FREE_SETTINGS, NOISE, BranchResult, ComparisonConfig, branches
from .oracle import ORACLE
from .report import FOCUS, markdown, summarize

# Settings every report records in its head (also those written before "settings" was).
HEAD = ("trunk_iters", "train_iters", "window")


@dataclass(frozen=True)
class Report:
    path: str
    summary: dict

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """A comparison's ``results.json`` (or the folder holding it)."""
        p = Path(path)
        p = p / "results.json" if p.is_dir() else p
        try:
            summary = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a comparison's report (results.json): {e}") from e
        if not isinstance(summary, dict) or "rows" not in summary or any(k not in summary for k in HEAD):
            raise ValueError(f"{p}: not a comparison's report: a results.json of tools/lab/compare_precision.py has "
                             f"'rows' and {', '.join(HEAD)}")
        return cls(str(p), summary)

    @property
    def costs(self) -> str | None:
        """The oracle's costs as a canonical text (None without an oracle)."""
        costs = self.summary.get("oracle")
        return None if costs is None else json.dumps(costs, sort_keys=True)

    def has_oracle(self) -> bool:
        return any(r["arm"] == ORACLE for r in self.summary["rows"])


def parse_budget(label: str) -> Budget:
    """A budget from its report label (``Budget.label``): "FP4 target 0.75" or "time target 0.400 x bf16"."""
    if m := re.fullmatch(r"FP4 target ([0-9.]+)", label):
        return Budget(float(m.group(1)))
    if m := re.fullmatch(r"time target ([0-9.]+) x bf16", label):
        return Budget(time_target=float(m.group(1)))
    raise ValueError(f"unknown budget label {label!r} (want 'FP4 target 0.75' or 'time target 0.400 x bf16')")


def merge_reports(paths: Sequence[str | Path], out: str, oracle_from: str | Path | None = None,
                  versus: str | None = None, log=print) -> dict:
    """The summary of every branch of the reports at ``paths`` (``report.summarize``'s dict, plus the
    ``sources`` it was merged from and their common ``settings``); the oracle's rows from the report
    ``oracle_from`` where the reports' oracles planned with different costs. Writes nothing; raises
    ValueError naming the reports that cannot be merged, and why."""
    if (Path(out) / "comparison.json").exists():  # a merge there would mix with branches the tool resumes
        raise ValueError(f"--out {out} holds a comparison (comparison.json): write the merge to a folder of its own")
    reports = [Report.load(p) for p in paths]
    if len(reports) < 2:
        raise ValueError("give two or more reports to merge")
    common = _common_settings(reports, log)
    results: dict[tuple[str, int], BranchResult] = {}
    origin: dict[tuple[str, int], str] = {}
    budgets: dict[str, Budget] = {}
    # Every branch but the oracle's first: a branch that differs between two reports (other trunks) is the
    # clearer error when their oracles differ too.
    for rep in reports:
        for row in rep.summary["rows"]:
            if row["arm"] != ORACLE:
                _add(rep, row, results, origin, budgets)
    keep = _oracle_costs(reports, oracle_from)
    predicted: dict[str, dict[int, float]] = {}
    for rep in reports:
        for row in rep.summary["rows"] if rep.costs == keep else ():
            name = _add(rep, row, results, origin, budgets) if row["arm"] == ORACLE else _name(row, budgets)
            if not math.isnan(row.get("additive_prediction", math.nan)):
                for seed in row["per_seed"]:  # the row's mean for each seed (exact where the seeds are disjoint)
                    predicted.setdefault(name, {}).setdefault(int(seed), row["additive_prediction"])
    head = {k: reports[0].summary[k] for k in HEAD}
    config = _config(common, head, results, budgets, versus, out, keep)
    ablation_arms = sorted({name for name, _ in results if name.startswith("ablate-")})
    every = branches(config, ablation_arms)
    oracle = {"costs": json.loads(keep), "predicted": predicted} if keep is not None else None
    summary = summarize(config, results, every, oracle=oracle)
    summary["complete"] = all(all((b.name, s) in results for s in config.seeds) for b in every
                              if not b.arm.startswith("ablate-"))
    summary.update(settings=common, sources=[r.path for r in reports])
    return summary


def _name(row: dict, budgets: dict[str, Budget]) -> str:
    """The branch name of a report row (``Branch.name``), its budget parsed from the label once."""
    if row["budget"] is None:
        return row["arm"]
    return f"{row['arm']}_{budgets.setdefault(row['budget'], parse_budget(row['budget'])).tag}"


def _add(rep: Report, row: dict, results: dict, origin: dict, budgets: dict[str, Budget]) -> str:
    """Put a row's per-seed numbers into ``results``, refusing a branch that another report has with other
    numbers; returns the branch name."""
    name = _name(row, budgets)
    for seed, v in row["per_seed"].items():
        key, r = (name, int(seed)), BranchResult(final_valid_loss=v["valid_loss"], mean_train_loss=v["mean_train_loss"],
                                                 fp4_fraction=v["fp4_fraction"], time_ratio=v["time_ratio"])
        if key in results and not _same(results[key], r):
            raise ValueError(
                f"{name} of seed {key[1]} differs between {origin[key]} (validation {results[key].final_valid_loss!r}, "
                f"training {results[key].mean_train_loss!r}) and {rep.path} ({r.final_valid_loss!r}, "
                f"{r.mean_train_loss!r}): the same branch from the same trunk trains to the same numbers, so these "
                "are other trunks or other settings; merge reports of one comparison's settings")
        results.setdefault(key, r)
        origin.setdefault(key, rep.path)
    return name


def write_merged(summary: dict, out: Path) -> None:
    """results.md and results.json under ``out`` (merge_reports's ``out``), and the oracle's costs as
    ``out/oracle/costs.json`` (what ``compare_precision.py --oracle-costs`` takes)."""
    out.mkdir(parents=True, exist_ok=True)
    if summary.get("oracle"):
        (out / ORACLE).mkdir(exist_ok=True)
        write_text_atomic(str(out / ORACLE / "costs.json"), json.dumps(summary["oracle"], indent=1))
    write_text_atomic(str(out / "results.md"), markdown(summary))
    write_text_atomic(str(out / "results.json"), json.dumps(summary, indent=1))


def _same(a: BranchResult, b: BranchResult) -> bool:
    return a.final_valid_loss == b.final_valid_loss and (
        a.mean_train_loss == b.mean_train_loss or (math.isnan(a.mean_train_loss) and math.isnan(b.mean_train_loss)))


def _common_settings(reports: Sequence[Report], log) -> dict:
    """The settings every report shares (refusing reports that differ in one that fixes what a branch
    measures); a report without recorded settings is checked on its head only."""
    first = reports[0]
    for rep in reports[1:]:
        differ = [k for k in HEAD if rep.summary[k] != first.summary[k]]
        if differ:
            raise ValueError(f"{rep.path} and {first.path} differ in {', '.join(differ)} "
                             f"({', '.join(f'{k} {rep.summary[k]} vs {first.summary[k]}' for k in differ)}): "
                             "their branches measured other things; merge reports of the same settings")
    recorded = [r for r in reports if "settings" in r.summary]
    for rep in reports:
        if "settings" not in rep.summary:
            log(f"{rep.path}: written before reports recorded their settings; checked on {', '.join(HEAD)} only")
    common = {k: v for k, v in (recorded[0].summary["settings"] if recorded else {}).items() if k not in FREE_SETTINGS}
    for rep in recorded[1:]:
        mine = {k: v for k, v in rep.summary["settings"].items() if k not in FREE_SETTINGS}
        differ = sorted(k for k in set(mine) | set(common) if mine.get(k) != common.get(k))
        if differ:
            raise ValueError(f"{rep.path} and {recorded[0].path} differ in {', '.join(differ)}: their branches "
                             "measured other things; merge reports of the same settings")
    return common


def _oracle_costs(reports: Sequence[Report], oracle_from: str | Path | None) -> str | None:
    """The costs (canonical text) of the oracle rows to keep: the reports' one set of costs, or ``oracle_from``'s."""
    costs = {r.costs for r in reports if r.has_oracle()}
    if None in costs:
        raise ValueError(f"{next(r.path for r in reports if r.has_oracle() and r.costs is None)}: oracle rows "
                         "without the costs they planned with ('oracle'): not a report of "
                         "tools/lab/compare_precision.py")
    if oracle_from is None:
        if len(costs) > 1:
            names = ", ".join(r.path for r in reports if r.has_oracle())
            raise ValueError(f"the oracles of {names} planned with different costs (oracle/costs.json), so their "
                             "rows are different arms; name the report whose oracle to keep with --oracle-from")
        return next(iter(costs), None) if costs else next((r.costs for r in reports if r.costs), None)
    chosen = [r for r in reports if Path(r.path).resolve() in (Path(oracle_from).resolve(),
                                                              (Path(oracle_from) / "results.json").resolve())]
    if not chosen or not chosen[0].has_oracle():
        raise ValueError(f"--oracle-from {oracle_from}: give one of the merged reports that has oracle rows")
    return chosen[0].costs


def _config(common: dict, head: dict, results: dict, budgets: dict[str, Budget], versus: str | None, out: str,
            costs: str | None) -> ComparisonConfig:
    """A comparison's settings for the merged branches (what report.summarize reads)."""
    names = {name for name, _ in results}
    ordered = sorted(budgets.values(), key=lambda b: (b.time_target is not None, b.time_target or b.fp4_target))
    policies = tuple(a for a in ARMS if any(f"{a}_{b.tag}" in names for b in ordered))
    if versus is None:
        versus = next((f for f in FOCUS if f in policies), None)
    known = {k: tuple(v) if isinstance(v, list) else v for k, v in common.items()
             if k in ("train_args", "snip_interval", "formats", "nproc", "solver")}
    with tempfile.TemporaryDirectory() as tmp:
        # The oracle arm needs its costs (nothing trains here, so no ablations): the config checks them in a
        # file, kept only while it is made (write_merged writes them to OUT/oracle/costs.json).
        oracle_costs = None
        if ORACLE in policies:
            oracle_costs = str(Path(tmp) / "costs.json")
            Path(oracle_costs).write_text(costs)
        return ComparisonConfig(
            out=out, policies=policies, budgets=tuple(ordered), seeds=tuple(sorted({s for _, s in results})),
            trunk_iters=head["trunk_iters"], train_iters=head["train_iters"], window=head["window"],
            noise_floor=any(name == NOISE for name in names), versus=versus, oracle_costs=oracle_costs,
            **{"train_args": (), "snip_interval": head["trunk_iters"], **known})
