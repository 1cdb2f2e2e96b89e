"""SNIP's integer linear program: one number format per linear module.

SNIP's probe cycle (``snip/probes.py``, costed by ``snip/estimators.py``)
measures, for every linear module and every candidate format, how much quality
would be lost (a normalised divergence, lower is better). This module picks one
format per module (or, in *split* mode, one for the forward GEMM and one for the
backward GEMMs) that minimises the total divergence while at least a
``target`` fraction of the linear-layer FLOPs run in an FP4 format and, with a
GEMM speed table, the estimated GEMM time stays within ``time_target`` of the
all-BF16 time, globally and optionally per pipeline stage.

Everything here is plain data and pure functions; no torch.distributed. The
formulation is written out in ``docs/ilp.md``.

Decision units: in joint mode every module is one unit, keyed by its name;
in split mode every module is two units, keyed ``(name, "fwd")`` and
``(name, "bwd")``. Pins, the current plan and plans all map unit keys to
format names; in split mode a bare module name stands for both its passes.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np

from megatron_snip.numerics.registry import FP4_NAMES

from . import solvers
from .feasibility import (
    FRACTION_TOL,
    TARGET_FLAG,
    TIME_TARGET_FLAG,
    InfeasibleBudgetError,
    InfeasibleTimeTargetError,
    check_feasible,
    time_capacity,
)

logger = logging.getLogger("megatron_snip.snip")

FWD = "fwd"
BWD = "bwd"
PASSES = (FWD, BWD)

# Format names treated as FP4 when a problem does not say which are.
DEFAULT_FP4_FORMATS = frozenset(FP4_NAMES)


UnitKey = str | tuple[str, str]
CostTable = Mapping[str, Mapping[str, float]]
Plan = Mapping[UnitKey, str]


@dataclass(frozen=True)
class LinearModule:
    """A linear module and the FLOPs of its GEMMs.

    FLOPs are per training step and count a multiply-add as 2, so a module
    with ``in_features x out_features`` weights over ``tokens`` tokens has
    ``2 * tokens * in_features * out_features`` FLOPs in each of fprop,
    dgrad and wgrad. Only ratios matter to the ILP, so any common unit works.
    """

    name: str  # e.g. "decoder.layers.7.mlp.linear_fc1"
    layer: int  # global transformer-layer index, >= 0
    fprop_flops: float  # forward GEMM, FLOPs
    dgrad_flops: float  # input-gradient GEMM, FLOPs
    wgrad_flops: float  # weight-gradient GEMM, FLOPs
    stage: int = 0  # pipeline stage holding the module, >= 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"module name must be a non-empty string, got {self.name!r}")
        for attr in ("layer", "stage"):
            value = getattr(self, attr)
            if not isinstance(value, int | np.integer) or value < 0:
                raise ValueError(f"module {self.name}: {attr} must be an integer >= 0, got {value!r}")
        for attr in ("fprop_flops", "dgrad_flops", "wgrad_flops"):
            value = getattr(self, attr)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"module {self.name}: {attr} must be finite and >= 0, got {value!r}")

    @classmethod
    def from_shape(cls, name: str, layer: int, tokens: int, in_features: int,
                   out_features: int, stage: int = 0) -> LinearModule:
        """A module whose three GEMMs each take ``2 * tokens * in * out`` FLOPs."""
        gemm = 2.0 * tokens * in_features * out_features
        return cls(name, layer, gemm, gemm, gemm, stage)

    @property
    def bwd_flops(self) -> float:
        """dgrad + wgrad FLOPs."""
        return self.dgrad_flops + self.wgrad_flops

    @property
    def flops(self) -> float:
        """fprop + dgrad + wgrad FLOPs."""
        return self.fprop_flops + self.bwd_flops


@dataclass(frozen=True)
class DecisionUnit:
    """One choice of the ILP: a module (joint mode) or a module pass (split mode)."""

    key: UnitKey  # module name, or (module name, "fwd" | "bwd")
    module: str
    layer: int
    stage: int
    flops: float  # FLOPs whose format this choice sets
    cost: Mapping[str, float]  # format -> divergence (dimensionless, >= 0)
    allowed: tuple[str, ...]  # formats it may take: all candidates, or just its pin
    pin: str | None  # pinned format, if any
    current: str | None  # format in the current plan, if any


@dataclass(frozen=True)
class SnipProblem:
    """An instance of the SNIP ILP, validated once when built.

    Give ``cost`` for joint mode (one format per module for all its GEMMs),
    or ``fwd_cost`` and ``bwd_cost`` for split mode (the forward GEMM and the
    backward GEMMs choose formats separately). Every cost table maps every
    module name to a mapping of every candidate format to a finite cost >= 0.

    ``speed`` maps every candidate format to its GEMM throughput relative to bf16 (from a
    ``GemmSpeedModel``); a unit's estimated time in format f is ``flops / speed[f]``, in
    BF16-FLOP units, so the all-BF16 time is the FLOP total. ``unit_speed`` (a measured speed
    table) gives each unit its own: unit key -> format -> throughput relative to the model-wide
    bf16 FLOP rate, "bf16" included whether or not it is a candidate, so a unit's bf16 time is
    ``flops / unit_speed[key]["bf16"]`` and the all-BF16 time their sum. With ``time_target`` T
    the plan's time is at most T times the all-BF16 time (per stage with ``per_stage``).

    Building the problem raises ``ValueError`` for malformed inputs and
    :class:`InfeasibleBudgetError` when a budget cannot be met on its own. The cost,
    pin and current-plan mappings are copied into :attr:`units` at build
    time; changing them afterwards has no effect.
    """

    modules: Sequence[LinearModule]
    formats: Sequence[str]  # candidate format names, e.g. ("bf16", "fp8", "nvfp4")
    target: float  # required FP4 fraction of linear-layer FLOPs, in [0, 1]
    cost: CostTable | None = None  # joint mode: module -> format -> cost
    fwd_cost: CostTable | None = None  # split mode: forward GEMM costs
    bwd_cost: CostTable | None = None  # split mode: backward GEMMs costs
    fp4_formats: frozenset[str] | None = None  # which candidates are FP4 (None: by name)
    per_stage: bool = False  # also require the target within every pipeline stage
    pins: Mapping[UnitKey, str] = field(default_factory=dict)  # unit -> fixed format
    current: Mapping[UnitKey, str] | None = None  # the plan now in use
    switch_penalty: float = 0.0  # objective added per unit whose format differs from current
    speed: Mapping[str, float] | None = None  # format -> GEMM throughput relative to bf16
    time_target: float | None = None  # max estimated GEMM time / all-BF16 time
    unit_speed: Mapping[UnitKey, Mapping[str, float]] | None = None  # per unit (measured); overrides speed
    units: tuple[DecisionUnit, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # Frozen dataclass: normalised values are stored with object.__setattr__.
        set_ = object.__setattr__
        set_(self, "modules", tuple(self.modules))
        set_(self, "formats", tuple(self.formats))
        self._check_modules_and_formats()
        fp4 = (DEFAULT_FP4_FORMATS & set(self.formats)) if self.fp4_formats is None else frozenset(self.fp4_formats)
        unknown = sorted(fp4 - set(self.formats))
        if unknown:
            raise ValueError(f"fp4_formats names {unknown} which are not candidate formats {list(self.formats)}")
        set_(self, "fp4_formats", frozenset(fp4))
        if not (isinstance(self.target, int | float | np.floating) and 0.0 <= self.target <= 1.0):
            raise ValueError(f"FP4 target must be a fraction in [0, 1], got {self.target!r}")
        set_(self, "target", float(self.target))
        self._check_speed()
        if not (math.isfinite(self.switch_penalty) and self.switch_penalty >= 0):
            raise ValueError(f"switch_penalty must be finite and >= 0, got {self.switch_penalty!r}")
        if (self.cost is None) == (self.fwd_cost is None and self.bwd_cost is None):
            raise ValueError("give either cost (joint mode) or fwd_cost and bwd_cost (split mode), not both or neither")
        if self.cost is None and (self.fwd_cost is None or self.bwd_cost is None):
            raise ValueError("split mode needs both fwd_cost and bwd_cost")
        set_(self, "units", self._build_units())
        if sum(u.flops for u in self.units) <= 0:
            raise ValueError("the modules have no FLOPs in total; the FP4 fraction is undefined")
        self._check_unit_speed()
        check_feasible(self)

    def _check_speed(self):
        if self.speed is None:
            if self.time_target is not None:
                raise ValueError("a time target needs speed: the GEMM throughput of every candidate format")
            return
        missing = [f for f in self.formats if f not in self.speed]
        if missing:
            raise ValueError(f"speed: no throughput for candidate format(s) {missing}")
        bad = {f: self.speed[f] for f in self.formats if not (math.isfinite(self.speed[f]) and self.speed[f] > 0)}
        if bad:
            raise ValueError(f"speed: throughputs must be finite and > 0, got {bad}")
        object.__setattr__(self, "speed", MappingProxyType({f: float(self.speed[f]) for f in self.formats}))
        if self.time_target is not None:
            if not (isinstance(self.time_target, int | float | np.floating) and math.isfinite(self.time_target)
                    and self.time_target > 0):
                raise ValueError(f"time target must be a ratio > 0, got {self.time_target!r}")
            object.__setattr__(self, "time_target", float(self.time_target))

    def _check_unit_speed(self):
        if self.unit_speed is None:
            return
        if self.speed is None:
            raise ValueError("unit_speed needs speed too (the formats' overall throughputs, for messages)")
        table = {}
        for u in self.units:
            row = self.unit_speed.get(u.key)
            missing = [] if row is None else [f for f in (*self.formats, "bf16") if f not in row]
            if row is None or missing:
                raise ValueError(f"unit_speed: no throughput for unit {u.key!r}" + (f" in {missing}" if row else ""))
            bad = {f: row[f] for f in (*self.formats, "bf16") if not (math.isfinite(row[f]) and row[f] > 0)}
            if bad:
                raise ValueError(f"unit_speed[{u.key!r}]: throughputs must be finite and > 0, got {bad}")
            table[u.key] = MappingProxyType({f: float(row[f]) for f in (*self.formats, "bf16")})
        object.__setattr__(self, "unit_speed", MappingProxyType(table))

    def unit_time(self, unit: DecisionUnit, fmt: str) -> float:
        """Estimated GEMM time of ``unit`` in ``fmt``, in BF16-FLOP units (needs ``speed``)."""
        if self.unit_speed is not None:
            return unit.flops / self.unit_speed[unit.key][fmt]
        return unit.flops / self.speed[fmt]

    def bf16_time(self, unit: DecisionUnit) -> float:
        """``unit``'s time in bf16 (the time budgets' denominator): its FLOPs under a global speed."""
        return unit.flops if self.unit_speed is None else unit.flops / self.unit_speed[unit.key]["bf16"]

    def scope_bf16_time(self, stage: int | None = None) -> float:
        """All-BF16 time of the units of ``stage`` (None: of every unit)."""
        return sum(self.bf16_time(u) for u in self.units if stage is None or u.stage == stage)

    @property
    def split(self) -> bool:
        """True when forward and backward formats are chosen separately."""
        return self.cost is None

    @property
    def total_flops(self) -> float:
        return sum(u.flops for u in self.units)

    @property
    def stage_flops(self) -> dict[int, float]:
        """Stage -> FLOPs of its linear modules."""
        out: dict[int, float] = {}
        for u in self.units:
            out[u.stage] = out.get(u.stage, 0.0) + u.flops
        return out

    def unit_formats(self, mapping: Mapping[UnitKey, str], what: str) -> dict[UnitKey, str]:
        """Map a module-or-unit keyed mapping to unit keys, checking names and formats.

        In split mode a bare module name sets both passes. ``what`` names the
        mapping in error messages ("pins", "plan", ...).
        """
        names = {m.name for m in self.modules}
        out: dict[UnitKey, str] = {}
        for key, fmt in mapping.items():
            if isinstance(key, str) and key in names:
                keys = [(key, p) for p in PASSES] if self.split else [key]
            elif self.split and isinstance(key, tuple) and len(key) == 2 and key[0] in names and key[1] in PASSES:
                keys = [key]
            else:
                shape = "a module name or (module name, 'fwd' | 'bwd')" if self.split else "a module name"
                raise ValueError(f"{what}: key {key!r} is not {shape} of this problem")
            if fmt not in self.formats:
                raise ValueError(f"{what}: {key!r} -> unknown format {fmt!r}; candidates are {list(self.formats)}")
            for k in keys:
                if out.setdefault(k, fmt) != fmt:
                    raise ValueError(f"{what}: conflicting formats for {k!r}: {out[k]!r} and {fmt!r}")
        return out

    def _check_modules_and_formats(self):
        if not self.modules:
            raise ValueError("the problem has no modules")
        bad = [m for m in self.modules if not isinstance(m, LinearModule)]
        if bad:
            raise ValueError(f"modules must be LinearModule instances, got {type(bad[0]).__name__}")
        dup = [n for n, c in Counter(m.name for m in self.modules).items() if c > 1]
        if dup:
            raise ValueError(f"duplicate module names: {dup[:5]}")
        if not self.formats or not all(isinstance(f, str) and f for f in self.formats):
            raise ValueError(f"formats must be a non-empty list of format names, got {list(self.formats)!r}")
        dup = [f for f, c in Counter(self.formats).items() if c > 1]
        if dup:
            raise ValueError(f"duplicate candidate formats: {dup}")

    def _cost_table(self, table: CostTable, label: str) -> dict[str, dict[str, float]]:
        """Validate one cost table and copy it as module -> format -> float."""
        names = [m.name for m in self.modules]
        extra = sorted(set(table) - set(names))
        if extra:
            raise ValueError(f"{label}: costs given for unknown modules {extra[:5]}")
        missing = [n for n in names if n not in table]
        if missing:
            raise ValueError(f"{label}: missing costs for {len(missing)} module(s), e.g. {missing[:5]}")
        out = {}
        for name in names:
            row = table[name]
            unknown = sorted(set(row) - set(self.formats))
            if unknown:
                raise ValueError(f"{label}[{name!r}]: unknown format(s) {unknown}; candidates are {list(self.formats)}")
            absent = [f for f in self.formats if f not in row]
            if absent:
                raise ValueError(f"{label}[{name!r}]: missing cost for format(s) {absent}")
            for f in self.formats:
                c = float(row[f])
                if not math.isfinite(c) or c < 0:
                    raise ValueError(f"{label}[{name!r}][{f!r}] = {row[f]!r}: costs must be finite and >= 0")
            out[name] = {f: float(row[f]) for f in self.formats}
        return out

    def _build_units(self) -> tuple[DecisionUnit, ...]:
        pins = self.unit_formats(self.pins, "pins")
        current = self.unit_formats(self.current or {}, "current plan")
        if self.split:
            fwd, bwd = self._cost_table(self.fwd_cost, "fwd_cost"), self._cost_table(self.bwd_cost, "bwd_cost")
            parts = [part for m in self.modules for part in (
                ((m.name, FWD), m, m.fprop_flops, fwd[m.name]),
                ((m.name, BWD), m, m.bwd_flops, bwd[m.name]),
            )]
        else:
            cost = self._cost_table(self.cost, "cost")
            parts = [(m.name, m, m.flops, cost[m.name]) for m in self.modules]
        return tuple(
            DecisionUnit(
                key=key, module=m.name, layer=int(m.layer), stage=int(m.stage), flops=float(flops),
                cost=MappingProxyType(c), allowed=(pins[key],) if key in pins else self.formats,
                pin=pins.get(key), current=current.get(key),
            )
            for key, m, flops, c in parts
        )


@dataclass(frozen=True)
class PlanEvaluation:
    """A plan's predicted cost and FP4 share under a problem."""

    objective: float  # divergence + switch_penalty * n_switched (dimensionless)
    divergence: float  # sum of the chosen formats' costs (dimensionless)
    n_switched: int  # units whose format differs from the problem's current plan
    fp4_fraction: float  # FP4 FLOPs / all linear FLOPs
    stage_fp4_fraction: dict[int, float]  # stage -> FP4 FLOPs / that stage's FLOPs
    meets_target: bool  # every budget constraint of the problem holds
    time_ratio: float | None  # estimated GEMM time / all-BF16 time (None without speed)
    stage_time_ratio: dict[int, float] | None  # stage -> the same within the stage


@dataclass(frozen=True)
class Solution(PlanEvaluation):
    """The ILP's plan, its evaluation, and how the solver got there."""

    plan: dict[UnitKey, str]  # unit key -> format, for every unit
    solver: str  # "gurobi" or "highs"
    status: str  # "optimal" (within mip_gap) or "time_limit" (feasible, not proven optimal)
    bound: float  # solver's proven lower bound on the objective
    gap: float  # (objective - bound) / |objective| (|objective| floored at 1e-10)
    seconds: float  # wall seconds spent in the solver, model building included


def evaluate_plan(problem: SnipProblem, plan: Plan) -> PlanEvaluation:
    """Predicted objective and FP4 share of ``plan`` (unit key or module name -> format).

    The plan must give a candidate format for every unit; pins are not
    enforced here, so any plan (e.g. an old one) can be scored.
    """
    formats = problem.unit_formats(plan, "plan")
    missing = [u.key for u in problem.units if u.key not in formats]
    if missing:
        raise ValueError(f"plan has no format for {len(missing)} unit(s), e.g. {missing[:3]}")
    divergence = 0.0
    n_switched = 0
    fp4_flops: dict[int, float] = {}
    time: dict[int, float] = {}
    for u in problem.units:
        f = formats[u.key]
        divergence += u.cost[f]
        n_switched += u.current is not None and f != u.current
        fp4_flops[u.stage] = fp4_flops.get(u.stage, 0.0) + (u.flops if f in problem.fp4_formats else 0.0)
        if problem.speed is not None:
            time[u.stage] = time.get(u.stage, 0.0) + problem.unit_time(u, f)
    stage_flops = {s: f for s, f in sorted(problem.stage_flops.items()) if f > 0}
    glob = sum(fp4_flops.values()) / problem.total_flops
    stages = {s: fp4_flops[s] / f for s, f in stage_flops.items()}
    binding = stages.values() if problem.per_stage else [glob]
    meets = all(v >= problem.target - FRACTION_TOL for v in binding)
    time_ratio = stage_time = None
    if problem.speed is not None:
        time_ratio = sum(time.values()) / problem.scope_bf16_time()
        stage_time = {s: time[s] / problem.scope_bf16_time(s) for s in stage_flops}
        if problem.time_target is not None:
            binding = stage_time.values() if problem.per_stage else [time_ratio]
            meets = meets and all(v <= problem.time_target + FRACTION_TOL for v in binding)
    return PlanEvaluation(
        objective=divergence + problem.switch_penalty * n_switched,
        divergence=divergence,
        n_switched=n_switched,
        fp4_fraction=glob,
        stage_fp4_fraction=stages,
        meets_target=meets,
        time_ratio=time_ratio,
        stage_time_ratio=stage_time,
    )


def build_matrix_model(problem: SnipProblem) -> tuple[solvers.MatrixModel, tuple[tuple[int, str], ...], float]:
    """The problem as a solver-neutral binary program.

    Returns ``(model, columns, scale)``: ``columns[j] = (unit index, format)``
    of variable j, and ``scale`` such that true objective = scale * model
    objective (costs are divided by their maximum so the solvers' absolute
    tolerances mean the same thing whatever the cost units).
    """
    columns = tuple((i, f) for i, u in enumerate(problem.units) for f in u.allowed)
    raw = np.array([
        problem.units[i].cost[f]
        + problem.switch_penalty * (problem.units[i].current is not None and f != problem.units[i].current)
        for i, f in columns
    ])
    scale = float(raw.max()) if raw.size and raw.max() > 0 else 1.0

    rows: list[tuple[list[int], list[float], bool, float]] = []
    by_unit: dict[int, list[int]] = {}
    for j, (i, _) in enumerate(columns):
        by_unit.setdefault(i, []).append(j)
    for i in range(len(problem.units)):  # exactly one format per unit
        rows.append((by_unit[i], [1.0] * len(by_unit[i]), True, 1.0))
    if problem.target > 0:  # a zero target constrains nothing
        # One budget row per stage, or one global row. The stage rows sum to
        # the global one, so adding it too would be redundant. Coefficients
        # are FLOP fractions of the row's scope, which keeps them in [0, 1].
        scopes = sorted(problem.stage_flops) if problem.per_stage else [None]
        for scope in scopes:
            members = [u for u in problem.units if scope is None or u.stage == scope]
            scope_flops = sum(u.flops for u in members)
            if scope_flops <= 0:
                continue
            cols = [j for j, (i, f) in enumerate(columns)
                    if f in problem.fp4_formats and (scope is None or problem.units[i].stage == scope)]
            rows.append((cols, [problem.units[columns[j][0]].flops / scope_flops for j in cols], False,
                         float(problem.target)))
    if problem.time_target is not None:
        # time <= T * all-BF16 time, written as -time / all-BF16 time >= -T (rows are == or >=).
        scopes = sorted(problem.stage_flops) if problem.per_stage else [None]
        for scope in scopes:
            scope_time = problem.scope_bf16_time(scope)
            if scope_time <= 0:
                continue
            cols = [j for j, (i, _) in enumerate(columns) if scope is None or problem.units[i].stage == scope]
            rows.append((cols, [-problem.unit_time(problem.units[columns[j][0]], columns[j][1]) / scope_time
                                for j in cols], False, -float(problem.time_target)))

    model = solvers.MatrixModel(
        cost=raw / scale,
        row_start=np.cumsum([0] + [len(r[0]) for r in rows], dtype=np.int64),
        col_index=np.array([j for r in rows for j in r[0]], dtype=np.int32),
        value=np.array([v for r in rows for v in r[1]], dtype=np.float64),
        rhs=np.array([r[3] for r in rows], dtype=np.float64),
        is_equality=np.array([r[2] for r in rows], dtype=bool),
    )
    return model, columns, scale


def _joint_infeasibility(problem: SnipProblem, solver: str) -> InfeasibleBudgetError:
    """Each budget alone is feasible (checked when the problem was built) but not both: the error
    names the smallest time target that the FP4 target admits (an ILP minimising the time)."""
    if problem.time_target is None:
        return InfeasibleBudgetError("the solver found the problem infeasible although its FP4 target is")
    fastest = replace(problem, **_cost_tables_from(problem, lambda u, f: problem.unit_time(u, f) / u.flops),
                      time_target=None, current=None, switch_penalty=0.0)
    least = evaluate_plan(problem, solve(fastest, solver).plan)
    reached = max(least.stage_time_ratio.values()) if problem.per_stage else least.time_ratio
    return InfeasibleTimeTargetError(
        f"{TARGET_FLAG} {problem.target:.6g} and {TIME_TARGET_FLAG} {problem.time_target:.6g} cannot both be met: "
        f"at that FP4 share the smallest estimated GEMM time is {reached:.6g} of the all-BF16 time. Raise "
        f"{TIME_TARGET_FLAG}, lower {TARGET_FLAG}, or choose another --gemm-speed-model.",
        target=problem.time_target, smallest_feasible=reached, stage_min=time_capacity(problem)[1])


def _cost_tables_from(problem: SnipProblem, cost) -> dict:
    """``cost(unit, format)`` as the problem's cost tables (``cost=`` or ``fwd_cost=``/``bwd_cost=``)."""
    tables: dict[str, dict[str, dict[str, float]]] = {}
    for u in problem.units:
        table = "cost" if not problem.split else ("fwd_cost" if u.key[1] == FWD else "bwd_cost")
        tables.setdefault(table, {})[u.module] = {f: (cost(u, f) if f in u.allowed else 0.0) for f in problem.formats}
    return tables


def solve(problem: SnipProblem, solver: str = "auto", time_limit: float | None = None,
          mip_gap: float = 1e-4) -> Solution:
    """Solve the SNIP ILP.

    ``solver``: "auto" (Gurobi when usable, else HiGHS), "gurobi" or
    "highs"; see :mod:`megatron_snip.snip.solvers`. ``time_limit``: wall
    seconds (None: no limit); on expiry the best plan found is returned with
    status "time_limit". ``mip_gap``: relative optimality gap at which the
    solver may stop.
    """
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds or None, got {time_limit!r}")
    if not 0 <= mip_gap < 1:
        raise ValueError(f"mip_gap must be in [0, 1), got {mip_gap!r}")
    model, columns, scale = build_matrix_model(problem)
    try:
        result = solvers.solve_matrix(model, solver, time_limit=time_limit, mip_gap=mip_gap)
    except solvers.SolverInfeasibleError:
        raise _joint_infeasibility(problem, solver) from None

    plan: dict[UnitKey, str] = {}
    for j in np.flatnonzero(result.x):
        i, f = columns[j]
        if plan.setdefault(problem.units[i].key, f) != f:
            raise solvers.SolverError(f"{result.solver} chose two formats for {problem.units[i].key!r}")
    if len(plan) != len(problem.units):
        raise solvers.SolverError(f"{result.solver} left {len(problem.units) - len(plan)} unit(s) without a format")

    evaluation = evaluate_plan(problem, plan)
    bound = result.bound * scale
    gap = max(evaluation.objective - bound, 0.0) / max(abs(evaluation.objective), 1e-10)
    solution = Solution(**vars(evaluation), plan=plan, solver=result.solver, status=result.status,
                        bound=bound, gap=gap, seconds=result.seconds)
    logger.info(
        "SNIP ILP solved by %s (%s, %d variables, %d constraints) in %.3f s: objective %.6g, gap %.2e, "
        "FP4 FLOP fraction %.4f (target %.4f)",
        solution.solver, solution.status, model.n_vars, model.n_rows, solution.seconds,
        solution.objective, solution.gap, solution.fp4_fraction, problem.target,
    )
    return solution
