"""The oracle arm: SNIP's ILP with the costs training measured instead of estimated ones.

The per-module ablations (``ablation.py``) measure what each group of modules costs in FP4; the
oracle plans with those costs (``policies.min_fp4_cost``: the budgets of every other arm, the two
baseline formats) and trains its plan like any arm, so every policy's *regret*, its gap minus the
oracle's, says how far it is from the best plan that the measured costs can make.

**Group costs.** A group's cost is its ablation arm's final validation loss minus that of
:data:`ablation.NONE_ARM` (every unpinned module in the high format) of the same seed, the mean
over the seeds that have both, clipped at 0 (a group whose FP4 left the loss no higher than the
high format costs nothing measurable; a negative mean is noise, and the ILP needs costs >= 0). A
group whose every module is pinned costs 0 (nothing of it ran in FP4).

**Module costs.** With per-module ablations (``--ablations modules``) a module's cost is its own
group's. With per-layer and per-type ablations (``--ablations layers types``) the module of layer i
and type t costs ``C * a_i * b_t``: ``a_i`` layer i's share of the layer costs, ``b_t`` type t's
share of the type costs (equal shares where every group of that kind costs 0), and ``C`` the mean
of the two totals (the layer costs and the type costs each sum to the cost of every module in FP4
under additivity; measured, they differ by noise and interaction). A module's cost is then its
layer's share times its type's share of the whole, which keeps each kind's ranking and, when the
two totals agree, reproduces both kinds' group costs exactly.

**Additivity**, the assumption both rest on: a plan's loss gap to BF16 is the all-high arm's gap
plus the sum of its FP4 modules' costs (:func:`predicted_gap`). The oracle's own branch tests it:
the report sets its measured gap beside that prediction, and beside the same prediction for every
other arm (a re-planned arm's for its first plan).

**Costs from an earlier comparison.** The costs are written once, to ``OUT/oracle/costs.json``;
``--oracle-costs`` plans another comparison's oracle with such a file instead of its own ablations
(more seeds of the same model and data in a new folder, without training the ablation arms again).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from megatron_snip.snip.baselines import min_fp4_cost
from megatron_snip.snip.ilp import Plan, SnipProblem

from .ablation import NONE_ARM, ablation_groups

ORACLE = "oracle"
# What the oracle needs measured: every module alone, or every layer and every type.
NEEDS = (("modules",), ("layers", "types"))
# The FP4-FLOP tie-break of oracle_plan: its share of the objective stays below a millionth of the
# largest cost per module, far under any difference the ablations resolve.
TIE = 1e-6


@dataclass(frozen=True)
class OracleCosts:
    """What the oracle plans with, in loss units (nats of final validation loss).

    Attributes:
        modules: unpinned module -> its cost in FP4 (>= 0).
        groups: ablation arm -> its group's cost (>= 0, before the split into modules).
        base_gap: the all-high arm's paired gap to BF16, mean over seeds (nan without BF16 branches).
        source: "modules" (measured one by one) or "layers x types" (the product model).
        seeds: the seeds whose ablations gave the costs.
    """

    modules: dict[str, float]
    groups: dict[str, float]
    base_gap: float
    source: str
    seeds: list[int]


def load_costs(path: str | Path) -> OracleCosts:
    """The costs a comparison wrote to ``OUT/oracle/costs.json``.

    Raises ValueError naming the file when it is not such a file or a module's cost is not a
    finite number >= 0 (``base_gap`` may be nan: the comparison had no BF16 branch)."""
    try:
        costs = OracleCosts(**json.loads(Path(path).read_text()))
        bad = sorted(m for m, c in costs.modules.items()
                     if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c < 0)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not the oracle's costs.json of a comparison (OUT/oracle/costs.json) "
                         f"({type(e).__name__}: {e})") from e
    if bad or not costs.modules:
        raise ValueError(f"{path}: the oracle's module costs must be finite numbers >= 0, one per module; "
                         f"{'none given' if not bad else f'bad: {bad[:3]}'}")
    return costs


def group_costs(losses: Mapping[str, Mapping[int, float]], arms: list[str],
                clip: bool = True) -> tuple[dict[str, float], list[int]]:
    """arm -> mean over seeds of (its loss - :data:`NONE_ARM`'s loss), clipped at 0 unless ``clip``
    is False, and the seeds used.

    ``losses``: arm -> seed -> final validation loss. Raises ValueError naming an arm that no seed
    measured together with :data:`NONE_ARM`.
    """
    base = losses.get(NONE_ARM, {})
    costs, used = {}, set()
    for arm in arms:
        seeds = sorted(set(losses.get(arm, {})) & set(base))
        if not seeds:
            raise ValueError(f"the oracle needs {arm} and {NONE_ARM} measured on a common seed; neither finished")
        mean = statistics.fmean(losses[arm][s] - base[s] for s in seeds)
        costs[arm] = max(mean, 0.0) if clip else mean
        used.update(seeds)
    return costs, sorted(used)


def oracle_groups(problem: SnipProblem, kinds: tuple[str, ...]) -> dict[str, tuple[str, str, set]]:
    """The ablation groups the oracle prices (``ablation.ablation_groups``), pinned modules left out:
    a pinned module runs its pinned format in every arm, so no ablation measures it."""
    pinned = {u.key for u in problem.units if u.pin is not None}
    return {arm: (kind, group, keys - pinned) for arm, (kind, group, keys) in ablation_groups(problem, kinds).items()}


def measured_costs(groups: Mapping[str, tuple[str, str, set]], losses: Mapping[str, Mapping[int, float]],
                   reference: str, clip: bool = True) -> OracleCosts:
    """The oracle's costs from the ablation arms' final validation losses.

    ``groups``: :func:`oracle_groups`; ``losses``: arm -> seed -> loss, for the groups' arms,
    :data:`NONE_ARM` and the BF16 ``reference`` (its gap to the all-high arm is ``base_gap``; nan
    where no seed has both). ``clip`` as in :func:`group_costs`.
    """
    arm_costs, seeds = group_costs(losses, list(groups), clip)
    modules, source = module_costs(groups, arm_costs)
    base = [losses[NONE_ARM][s] - losses[reference][s] for s in seeds if s in losses.get(reference, {})]
    return OracleCosts(modules=modules, groups=arm_costs, base_gap=statistics.fmean(base) if base else math.nan,
                       source=source, seeds=seeds)


def module_costs(groups: Mapping[str, tuple[str, str, set]],
                 costs: Mapping[str, float]) -> tuple[dict[str, float], str]:
    """module -> cost, and the source ("modules" or "layers x types"), from the group costs.

    ``groups``: arm -> (kind, group, unpinned modules in FP4), as ``ablation.ablation_groups``
    gives them with pinned modules left out; ``costs``: arm -> group cost. Module ablations win
    where both are given (they measure each module, no model needed).
    """
    def of(kind: str) -> dict[str, tuple[set, float]]:
        return {group: (members, costs[arm] if members else 0.0)
                for arm, (k, group, members) in groups.items() if k == kind}

    kinds = {k for k, _, _ in groups.values()}
    if "modules" in kinds:
        return {next(iter(members)): cost for members, cost in of("modules").values() if members}, "modules"
    if not {"layers", "types"} <= kinds:
        raise ValueError(f"the oracle needs --ablations {' or --ablations '.join(' '.join(n) for n in NEEDS)}; "
                         f"got {sorted(kinds)}")
    layers, types = of("layers"), of("types")
    share_l, share_t = _shares(layers), _shares(types)
    total = (sum(c for _, c in layers.values()) + sum(c for _, c in types.values())) / 2
    type_of = {m: t for t, (members, _) in types.items() for m in members}
    return {m: total * share_l[layer] * share_t[type_of[m]] for layer, (members, _) in layers.items()
            for m in members}, "layers x types"


def _shares(groups: Mapping[str, tuple[set, float]]) -> dict[str, float]:
    """group -> its share of the groups' summed cost (equal shares when they sum to 0)."""
    total = sum(c for _, c in groups.values())
    return {g: (c / total if total > 0 else 1.0 / len(groups)) for g, (_, c) in groups.items()}


def oracle_plan(problem: SnipProblem, costs: OracleCosts, solver: str = "auto") -> Plan:
    """The plan meeting ``problem``'s budgets whose FP4 modules cost least in total (joint problems:
    the ablations measure whole modules, forward and backward GEMMs together). Among equally cheap
    plans (modules whose groups cost 0) the one with the fewest FP4 FLOPs: each module's cost carries
    ``TIE x`` its FLOPs over the largest module's, in units of the largest cost."""
    if problem.split:
        raise ValueError("the oracle plans whole modules (the ablations measure their forward and backward "
                         "GEMMs together); it cannot plan --snip-split-passes problems")
    unit = max(costs.modules.values(), default=0.0) or 1.0
    largest = max(u.flops for u in problem.units)
    weight = {u.key: costs.modules[u.key] + TIE * unit * u.flops / largest
              for u in problem.units if u.key in costs.modules}
    return min_fp4_cost(problem, weight, solver=solver)


def predicted_gap(costs: OracleCosts, fp4_modules: Iterable[str]) -> float:
    """A plan's loss gap to BF16 under additivity: the all-high gap plus the costs of the modules it
    runs in FP4 (``fp4_modules``; a pinned one has no cost of its own: it is FP4 in the all-high
    arm too)."""
    return costs.base_gap + sum(costs.modules.get(m, 0.0) for m in fp4_modules)
