"""Two SNIP runs that differ only in their parallel layout: how far apart their cycles' costs and plans are.

Layouts add the same numbers in other orders, so two runs' states differ by rounding; SNIP's costs must
not amplify it (docs/snip.md, "Stable across layouts"). :func:`compare_runs` reads both runs' statistics
files (``SAVE/snip/snip_iter_N.json``) cycle by cycle: for every (module, format) the ratio of the two
runs' normalised update costs and loss costs (the larger over the smaller), and whether the plans agree; and
where the update costs part: the ratios of their local parts (exact on the batch: the states' own difference)
and of their propagated parts (the K-draw sketch), and how alike the two runs' draws still are.
:func:`compare_validations` reads instead two ``tools/lab/snip_validate.py --output`` files (each run's
checkpoint, the same batch): how far apart the runs' exact update drifts are, next to their estimates'.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from megatron_snip.snip.statistics_file import StatisticsFile

# A cost this far below a cycle's largest cost of its kind (update or loss) is rounding, not a cost: its
# ratio between runs says nothing (a module whose curvature or drift is ~0 in both).
NEGLIGIBLE = 1e-6


@dataclass(frozen=True)
class CycleComparison:
    """One cycle of two runs.

    Attributes:
        iteration: the cycle's iteration.
        update_ratio: the largest ratio (>= 1) of the two runs' update costs over every (module, format),
            with the pair it belongs to; loss_ratio: the same for the loss costs.
        same_plan: whether both cycles chose the same precision for every module.
        local_ratio, propagated_ratio: the largest ratios of the update drift's local part
            (``FormatErrors.update_sq``) and of its propagated part (``FormatErrors.propagated``).
        draw_correlation: the median over (module, format) of the correlation between the two runs' squared
            projections, draw by draw (``FormatErrors.propagated_probes``: the same noise in both runs): 1 while
            their states agree, ~0 where the sketches have become independent samples.
    """

    iteration: int
    update_ratio: tuple[float, str]
    loss_ratio: tuple[float, str]
    same_plan: bool
    local_ratio: tuple[float, str]
    propagated_ratio: tuple[float, str]
    draw_correlation: float


def _ratios(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]],
            negligible: float = 0.0) -> dict[str, float]:
    """"module format" -> the larger of the two tables' values over the smaller (inf where the smaller is <= 0),
    leaving out the pairs whose values both lie within ``negligible`` times the largest value of either table."""
    scale = max((abs(v) for row in (*a.values(), *b.values()) for v in row.values()), default=0.0)
    ratios = {}
    for name, row in a.items():
        for fmt, x in row.items():
            y = b[name][fmt]
            if negligible and max(abs(x), abs(y)) <= negligible * scale:
                continue
            ratios[f"{name} {fmt}"] = max(x, y) / min(x, y) if min(x, y) > 0 else float("inf")
    return ratios


def _largest_ratio(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> tuple[float, str]:
    ratios = _ratios(a, b, NEGLIGIBLE)
    worst = max(ratios, key=ratios.get, default=None)
    return (ratios[worst], worst) if worst is not None and ratios[worst] > 1.0 else (1.0, "")


def compare_runs(dir_a: str | Path, dir_b: str | Path) -> list[CycleComparison]:
    """The cycles both runs' statistics directories hold, compared (:class:`CycleComparison`).

    Raises:
        ValueError: no cycle in common, or a cycle without its decision (an interrupted cycle).
    """
    files = {Path(d): {p.name: p for p in Path(d).glob("snip_iter_*.json")} for d in (dir_a, dir_b)}
    common = sorted(set(files[Path(dir_a)]) & set(files[Path(dir_b)]))
    if not common:
        raise ValueError(f"{dir_a} and {dir_b} hold no SNIP cycle of the same iteration")
    out = []
    for name in common:
        a, b = StatisticsFile.load(files[Path(dir_a)][name]), StatisticsFile.load(files[Path(dir_b)][name])
        if a.divergences is None or a.cycle is None or b.divergences is None or b.cycle is None:
            raise ValueError(f"{name}: the cycle did not finish in both runs")
        costs = {k: [{n: {f: getattr(d, k) for f, d in per.items()} for n, per in run.divergences.items()}
                     for run in (a, b)] for k in ("backward", "forward")}
        parts = {k: [{n: {f: getattr(e, k) for f, e in m.errors.items()} for n, m in run.stats.modules.items()}
                     for run in (a, b)] for k in ("update_sq", "propagated")}
        draws = [_correlation(e.propagated_probes, b.stats.modules[n].errors[f].propagated_probes)
                 for n, m in a.stats.modules.items() for f, e in m.errors.items()]
        out.append(CycleComparison(a.cycle.iteration, _largest_ratio(*costs["backward"]),
                                   _largest_ratio(*costs["forward"]), a.cycle.plan == b.cycle.plan,
                                   _largest_ratio(*parts["update_sq"]), _largest_ratio(*parts["propagated"]),
                                   statistics.median(c for c in draws if not math.isnan(c))))
    return out


def _correlation(x: list[float], y: list[float]) -> float:
    """Pearson's correlation of two equally long samples (NaN where either is constant)."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sx, sy = math.sqrt(sum((v - mx) ** 2 for v in x)), math.sqrt(sum((v - my) ** 2 for v in y))
    return sum((u - mx) * (v - my) for u, v in zip(x, y)) / (sx * sy) if sx * sy > 0 else math.nan


@dataclass(frozen=True)
class Spread:
    """How far apart two runs' values of every (module, format) are: the largest ratio (>= 1) with its pair,
    the median ratio, and how many of the ``pairs`` part by more than ``threshold``."""

    largest: tuple[float, str]
    median: float
    over: int
    pairs: int
    threshold: float


def spread(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]], threshold: float = 1.3) -> Spread:
    """The :class:`Spread` of two module -> format -> value tables (the same keys, values > 0).

    Raises:
        ValueError: the tables hold no pair, or a value <= 0 (no ratio).
    """
    ratios = _ratios(a, b)
    if not ratios:
        raise ValueError("no (module, format) to compare")
    infinite = [k for k, r in ratios.items() if math.isinf(r)]
    if infinite:
        raise ValueError(f"{infinite[0]}: a value <= 0 has no ratio")
    worst = max(ratios, key=ratios.get)
    return Spread((ratios[worst], worst), statistics.median(ratios.values()),
                  sum(r > threshold for r in ratios.values()), len(ratios), threshold)


def compare_validations(path_a: str | Path, path_b: str | Path, threshold: float = 1.3) -> dict[str, Spread]:
    """Two runs' ``snip_validate.py --output`` files (per-module mode; each run's checkpoint, the same
    batches): the :class:`Spread` of their exact update drifts (``truth``) and of SNIP's update costs on
    those batches (``estimate``). Where the truth itself parts, no faithful cost can agree.

    Raises:
        ValueError: a file from ``--validate-by-type`` (no per-module values), or the two hold other pairs.
    """
    runs = [json.loads(Path(p).read_text()) for p in (path_a, path_b)]
    for path, run in zip((path_a, path_b), runs):
        if "truth_backward" not in run:
            raise ValueError(f"{path} holds no per-module update drifts (written by --validate-by-type?)")
    keys = [{(m, f) for m, row in run["truth_backward"].items() for f in row} for run in runs]
    if keys[0] != keys[1]:
        raise ValueError(f"{path_a} and {path_b} hold different (module, format) pairs")
    return {name: spread(runs[0][key], runs[1][key], threshold)
            for name, key in (("truth", "truth_backward"), ("estimate", "estimate_backward"))}
