"""Rank correlation of estimates with measurements (no scipy needed): how well an estimator
orders modules is what the ILP depends on."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def rank_with_ties(values: Sequence[float]) -> list[float]:
    """1-based ranks; tied values share the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the tie-averaged ranks (NaN when
    either side is constant or there are fewer than 3 values: two points always rank at +-1)."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} vs {len(y)} values")
    if len(x) < 3:
        return math.nan
    rx, ry = rank_with_ties(x), rank_with_ties(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else math.nan


def rank_correlations(estimate: Mapping[str, Mapping[str, float]], truth: Mapping[str, Mapping[str, float]]
                      ) -> dict[str, float]:
    """Spearman correlation of an estimate with the ground truth over the (module, format) pairs
    both hold: ``"all"`` pairs, and per format (across modules: the ranking the ILP needs most,
    as formats alone separate by orders of magnitude)."""
    pairs = [(m, f) for m in truth for f in truth[m] if f in estimate.get(m, {})]
    out = {"all": spearman([estimate[m][f] for m, f in pairs], [truth[m][f] for m, f in pairs])}
    for fmt in dict.fromkeys(f for _, f in pairs):
        sub = [(m, f) for m, f in pairs if f == fmt]
        out[fmt] = spearman([estimate[m][f] for m, f in sub], [truth[m][f] for m, f in sub])
    return out
