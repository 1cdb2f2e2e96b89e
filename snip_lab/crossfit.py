"""The oracle's optimism, measured: plan on some ablation seeds, price on a seed it never saw.

The oracle picks the plan whose modules' measured costs sum lowest. Those costs are noisy (a few
seeds' ablation arms), so the plan it picks is, among near-equal plans, the one whose costs the
noise made look lowest: its additive prediction is optimistic (the optimizer's curse), and the
trained oracle lands above it. A plan that did not look at the costs (SNIP's, a baseline's) has no
such bias.

The cross-fit measures the bias without training anything. For each ablation seed ``h``: the
oracle plans with the costs of the other seeds (the *fitted* costs, built exactly as the oracle
builds its own, clipped at 0), and every plan is priced twice under additivity, with the fitted
costs (*in-sample*) and with seed ``h``'s alone (*held out*). The held-out costs are not clipped:
clipping one seed's noise at 0 raises the price of exactly the cheap groups the oracle picks, so a
clipped held-out price would overstate the bias. A plan's *excess* is its held-out price minus its
in-sample price; the oracle's *optimism* is its excess minus the mean excess of the plans that did
not look at the costs (which removes what every plan shares: seed ``h``'s own level and the clip).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from megatron_snip.snip.ilp import SnipProblem

from .ablation import NONE_ARM
from .oracle import ORACLE, measured_costs, oracle_plan, predicted_gap
from .variants import fp4_modules


@dataclass(frozen=True)
class Fold:
    """One held-out seed (``held_out``): plan name -> its gap predicted under additivity (loss units),
    with the costs of the other ablation seeds (``in_sample``) and with the held-out seed's
    (``held_out_price``)."""

    held_out: int
    in_sample: dict[str, float]
    held_out_price: dict[str, float]

    def excess(self, name: str) -> float:
        return self.held_out_price[name] - self.in_sample[name]

    def optimism(self) -> float:
        """The oracle's excess minus the mean excess of the other plans."""
        others = [self.excess(n) for n in self.in_sample if n != ORACLE]
        return self.excess(ORACLE) - (statistics.fmean(others) if others else 0.0)


def cross_fit(problem: SnipProblem, groups: Mapping[str, tuple[str, str, set]],
              losses: Mapping[str, Mapping[int, float]], reference: str,
              plans: Mapping[int, Mapping[str, Iterable[str]]], solver: str = "auto") -> list[Fold]:
    """One :class:`Fold` per ablation seed that ``plans`` has plans for.

    ``problem``: the budget's ILP (its units and budgets; the oracle re-plans it per fold);
    ``groups``: ``oracle.oracle_groups``; ``losses``: arm -> seed -> final validation loss of the
    ablation arms, :data:`NONE_ARM` and the BF16 ``reference``; ``plans``: seed -> plan name -> the
    modules it runs in FP4, for the plans that did not look at the costs (a seed's plans come from
    its own trunk's statistics). Raises ValueError with fewer than two ablation seeds (nothing to
    hold out from).
    """
    seeds = sorted(losses.get(NONE_ARM, {}))
    if len(seeds) < 2:
        raise ValueError(f"a cross-fit holds one ablation seed out of the others: it needs the ablations of two "
                         f"or more seeds (measured: {seeds})")

    def only(keep) -> dict[str, dict[int, float]]:
        return {arm: {s: v for s, v in per.items() if keep(s)} for arm, per in losses.items()}

    folds = []
    for h in seeds:
        if h not in plans:
            continue
        fitted = measured_costs(groups, only(lambda s, h=h: s != h), reference)
        held = measured_costs(groups, only(lambda s, h=h: s == h), reference, clip=False)
        rows = {name: list(modules) for name, modules in plans[h].items()}
        rows[ORACLE] = fp4_modules(problem, oracle_plan(problem, fitted, solver))
        folds.append(Fold(h, {n: predicted_gap(fitted, m) for n, m in rows.items()},
                          {n: predicted_gap(held, m) for n, m in rows.items()}))
    return folds
