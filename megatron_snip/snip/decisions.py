"""What a SNIP cycle decided, module by module, in words a user can check, and the cycle's report.

For every module: the precision the plan gives it, the estimated costs of that choice
(``alpha * dL/loss`` of its forward format, ``beta * dU/||u||^2`` of its backward format,
the ILP's own cost terms), and the next faster candidate with what it would have cost:
how close each call was. A pure function of the plan and the ILP's cost tables, printed as a
table for small models and summarised for large ones (the full table goes to a file).
:class:`CycleReport` is the whole cycle's outcome, typed from the re-planner through the trainer's log
to the statistics file (its ``cycle``) and back (``statistics_file.StatisticsFile.cycle``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

from megatron_snip.numerics.registry import PRECISION_NAMES, precision_format
from megatron_snip.precision.plan import PrecisionPlan, parse_module_name
from megatron_snip.snip.estimators import CostTables

TABLE_MAX_ROWS = 64  # up to 16 layers the console shows every module; beyond, a summary


@dataclass(frozen=True)
class Decision:
    """One module's choice. Costs are dimensionless (the ILP's objective terms)."""

    module: str
    precision: str  # e.g. "nvfp4", "fp8:rowwise", or "fp8/bf16" with split passes
    loss: float  # alpha * dL/loss of its forward format (0 where a schedule fixes the pass)
    update: float  # beta * dU/||u||^2 of its backward format (0 where a schedule fixes the pass)
    faster: str | None  # the next faster candidate than its forward format (None: none is faster)
    faster_cost: float | None  # that candidate's loss + update cost
    pinned: bool  # a user pin: never re-planned


def _speed_order(formats: Sequence[str], speed: Mapping[str, float] | None) -> dict[str, float]:
    """format -> a rank that grows with GEMM speed (the speed model's, else bits: bf16 < fp8 < fp4)."""
    if speed is not None:
        return {f: speed[f] for f in formats}
    return {f: 1.0 / precision_format(f).bits for f in formats}


def decisions(plan: PrecisionPlan, costs: CostTables, formats: Sequence[str], *,
              speed: Mapping[str, float] | None = None, pins: Collection[str] = (),
              fixed: Mapping[str, str | None] | None = None) -> list[Decision]:
    """Every module of ``costs`` (in its order) with its choice under ``plan``.

    ``speed``: format -> GEMM throughput relative to bf16 (the planner's); ``pins``: pinned module
    names; ``fixed``: the passes a precision schedule fixes (their costs count 0, as in the ILP).
    """
    fixed = fixed or {}
    order = _speed_order(formats, speed)
    out = []
    for name in costs.forward:
        precision = plan[name]
        loss = 0.0 if fixed.get("fwd") else costs.forward[name][precision.fwd]
        update = 0.0 if fixed.get("bwd") else costs.backward[name][precision.bwd]
        quicker = [f for f in formats if order[f] > order.get(precision.fwd, 0.0)]
        faster = min(quicker, key=lambda f: (order[f], costs.joint[name][f])) if quicker else None
        out.append(Decision(name, str(precision), loss, update, faster,
                            costs.joint[name][faster] if faster is not None else None, name in pins))
    return out


def decision_table(rows: Sequence[Decision]) -> str:
    """Fixed-width text: one line per module."""
    width = max([len("module"), *(len(d.module) for d in rows)])
    pw = max([11, *(len(d.precision) for d in rows)])  # "fp8:blockwise/bf16" is wider than "precision"
    lines = [f"{'module':<{width}} {'precision':<{pw}} {'loss cost':>10} {'update cost':>11}  next faster (its cost)"]
    for d in rows:
        faster = "-" if d.faster is None else f"{d.faster} ({d.faster_cost:.3g})"
        pin = "  [pinned]" if d.pinned else ""
        lines.append(f"{d.module:<{width}} {d.precision:<{pw}} {d.loss:>10.3g} {d.update:>11.3g}  {faster}{pin}")
    return "\n".join(lines)


def decision_summary(rows: Sequence[Decision], top: int = 8) -> str:
    """Per module type, how many modules run each precision; then the ``top`` costliest choices."""
    by_type: dict[str, Counter] = {}
    for d in rows:
        by_type.setdefault(parse_module_name(d.module)[1], Counter())[d.precision] += 1
    known = {p: i for i, p in enumerate(PRECISION_NAMES)}
    lines = []
    for module_type, counts in by_type.items():
        parts = sorted(counts.items(), key=lambda kv: (known.get(kv[0].split("/")[0], 99), kv[0]))
        lines.append(f"{module_type:<26} " + ", ".join(f"{p}: {n}" for p, n in parts))
    costly = sorted(rows, key=lambda d: d.loss + d.update, reverse=True)[:top]
    lines.append(f"costliest {len(costly)} choices: " + "; ".join(
        f"{d.module} {d.precision} ({d.loss + d.update:.3g})" for d in costly))
    return "\n".join(lines)


@dataclass
class CycleReport:
    """What one cycle decided and what it cost; identical on every rank after the broadcast."""

    iteration: int
    plan: PrecisionPlan  # the plan from the next step on
    solver: str
    objective: float
    gap: float
    solve_seconds: float
    cycle_seconds: float
    fp4_fraction: float
    stage_fp4_fraction: dict[int, float]
    time_ratio: float  # the plan's estimated linear-GEMM time / all-bf16 (under the run's speed model)
    stage_time_ratio: dict[int, float]
    time_target: float  # the time budget the ILP held the plan to (given, or implied by the FP4 target)
    loss_divergence: float  # sum over modules of alpha * dL/loss of the chosen formats
    update_divergence: float  # sum over modules of beta * dU/||u||^2 of the chosen formats
    layer_divergence: dict[int, float]  # per layer, both terms
    decisions: list[Decision] = field(default_factory=list)  # per module, in the cost tables' order
    # modules whose Hutchinson curvature its draws do not tell from 0 (estimators.unresolved_curvatures;
    # None: no draws to judge by)
    unresolved_curvatures: list[str] | None = None

    def to_dict(self) -> dict:
        """The JSON form (the statistics file's ``cycle``): the plan as ``PrecisionPlan.to_dict()``, each
        decision as a dict of its fields."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "plan": self.plan.to_dict(),
                "decisions": [asdict(d) for d in self.decisions]}

    @classmethod
    def from_dict(cls, d: dict) -> CycleReport:
        """The inverse of :meth:`to_dict`, after JSON (whose object keys are strings: the stage and layer
        keys come back as ints). Files of statistics schema 0 hold no decisions and no unresolved
        curvatures: an empty list and None."""
        ints = ("stage_fp4_fraction", "stage_time_ratio", "layer_divergence")
        return cls(**{**d, "plan": PrecisionPlan.from_dict(d["plan"]),
                      **{k: {int(i): v for i, v in d[k].items()} for k in ints},
                      "decisions": [Decision(**row) for row in d.get("decisions", [])],
                      "unresolved_curvatures": d.get("unresolved_curvatures")})
