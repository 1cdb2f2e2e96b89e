"""From per-module divergences to a precision plan: build the ILP, solve it, read the plan.

Pure functions. :class:`~megatron_snip.snip.replanner.SnipReplanner` calls them on rank 0 with a
cycle's gathered statistics; ``training/precision_setup.py`` at start-up, on zero costs, to check that the
budgets are feasible under the pins; ``snip/statistics_file.py`` (``tools/snip_solve.py``, the
comparisons in ``snip_lab/``) on a statistics file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from megatron_snip.numerics.recipes import Precision, RecipeConfig
from megatron_snip.numerics.registry import FP4_NAMES, family
from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.gemm_speed import GemmSpeedModel, ModuleSpeeds, peak_speed_model
from megatron_snip.precision.pipeline_layout import PipelineLayout
from megatron_snip.precision.plan import LINEAR_MODULES, PrecisionPlan, module_name, parse_module_name
from megatron_snip.snip.config import SnipConfig
from megatron_snip.snip.estimators import CostTables
from megatron_snip.snip.ilp import BWD, FWD, LinearModule, SnipProblem, Solution, UnitKey, solve

# The formats the planner's implied time budget and every baseline plan assume: FP4 units in nvfp4, the rest
# in fp8 (else the first fp8:RECIPE candidate), where those are candidates.
PREFERRED_FP4 = "nvfp4"
PREFERRED_HIGH = "fp8"


@dataclass(frozen=True)
class PlannerConfig:
    """The ILP's settings (flags ``--snip-*``).

    ``speed`` (precision -> GEMM throughput relative to bf16, from the run's
    ``GemmSpeedModel``) turns on time accounting; ``module_speed`` (a measured model's
    per-module-type speeds) prices every module at its own measured time. Without
    ``time_target`` (research mode: the paper's FP4 share) the plan's GEMM time is held to
    :func:`implied_time_target`, the time of the baselines' plans at the same FP4 share, so the
    non-FP4 remainder runs in FP8 unless BF16 pays for itself (docs/ilp.md, "Budgets"); that
    time is a proxy, priced by a peak estimate (:meth:`from_snip`).

    ``pins`` (global module name -> precision: ``--first-last-layers-bf16``, the modules a
    ``--te-precision-config-file`` fixes) are never re-planned: the ILP keeps them in their
    precision, and their FLOPs and time count in the budgets like every other module's.
    """

    formats: tuple[str, ...]  # candidates, e.g. ("bf16", "fp8", "nvfp4")
    fp4_target: float  # required FP4 fraction of linear-layer FLOPs
    per_stage: bool = True  # the budgets hold within every pipeline stage
    split_passes: bool = False  # forward and backward GEMMs choose separately
    switch_penalty: float = 0.0  # per unit whose format changes from the current plan
    solver: str = "auto"
    speed: Mapping[str, float] | None = None  # precision -> GEMM throughput relative to bf16
    time_target: float | None = None  # max estimated GEMM time / all-BF16 time (None: implied)
    pins: Mapping[str, Precision] = field(default_factory=dict)  # module -> the precision it keeps
    module_speed: ModuleSpeeds | None = None  # module type -> precision -> (fwd, bwd) throughput (measured)

    @classmethod
    def from_snip(cls, snip: SnipConfig, recipe: RecipeConfig, speed_model: GemmSpeedModel,
                  pins: Mapping[str, Precision] | None = None) -> PlannerConfig:
        """The settings of a run's ``--snip-*`` flags under its GEMM speed model, with its ``pins``.

        With ``--snip-time-target`` the budget is priced by ``speed_model`` (per module where it was
        measured). Without one (research mode) a measured model is replaced by :func:`proxy_speed_model`
        (the device's peak estimate): the implied time budget only makes SNIP and the baselines
        comparable at equal estimated cost, and a plan must not depend on a timing's noise."""
        model = speed_model if snip.snip_time_target is not None else proxy_speed_model(speed_model)
        formats = snip.snip_formats
        return cls(formats=formats, fp4_target=snip.snip_fp4_target,
                   per_stage=snip.snip_budget == "per-stage", split_passes=snip.snip_split_passes,
                   switch_penalty=snip.snip_switch_penalty, solver=snip.snip_solver,
                   speed=model.precision_speeds(recipe, formats), time_target=snip.snip_time_target,
                   pins=dict(pins or {}),
                   module_speed=model.module_speeds(dict.fromkeys((*formats, "bf16"))))


def proxy_speed_model(speed_model: GemmSpeedModel) -> GemmSpeedModel:
    """The speed model research mode (an FP4 share, no time target) prices its implied budget with: the
    run's own if it is a peak estimate, else the peak estimate of this device (``auto``)."""
    return peak_speed_model("auto") if speed_model.measured else speed_model


def linear_modules(dims: LlamaLinearDims, tokens: int, layout: PipelineLayout | None = None) -> list[LinearModule]:
    """Every linear module with its GEMM FLOPs for ``tokens`` tokens and the pipeline rank that runs it in
    ``layout`` (None: one stage), as megatron-core places it (uneven and virtual stages included: a stage's
    budget counts the modules of all its chunks, so each stage is held to its own FLOPs)."""
    layout = layout or PipelineLayout(dims.num_layers)
    if layout.num_layers != dims.num_layers:
        raise ValueError(f"a pipeline layout of {layout.num_layers} layers for a {dims.num_layers}-layer model")
    out = []
    for layer in range(dims.num_layers):
        for module in LINEAR_MODULES:
            fan_in, fan_out = dims.in_out(module)
            out.append(LinearModule.from_shape(module_name(layer, module), layer, tokens, fan_in, fan_out,
                                               stage=layout.stage_of(layer)))
    return out


def build_problem(modules: Sequence[LinearModule], costs: CostTables, config: PlannerConfig,
                  current: PrecisionPlan | None = None, fixed: Mapping[str, str | None] | None = None) -> SnipProblem:
    """The SNIP ILP: minimise the weighted divergences (``costs``) subject to the budgets.

    Jointly a module pays its forward and backward costs for one format; in split
    mode the forward GEMM and the backward GEMMs each choose and pay their own.

    ``fixed`` (``PrecisionSchedule.fixed``: ``{"fwd": precision or None, "bwd": ...}``) names
    passes a precision schedule imposes on every module: the problem leaves them out (split
    mode, their FLOPs and costs zero), so the budgets apply to the GEMMs the plan decides.
    ``config.pins`` become the problem's pins (:func:`unit_pins`).
    """
    outside = sorted({f for p in config.pins.values() for f in (p.fwd, p.bwd)} - set(config.formats))
    if outside:
        raise ValueError(f"pins: {outside[0]} is not a candidate format {list(config.formats)}")
    fixed = {side: f for side, f in (fixed or {}).items() if f is not None}
    if fixed:
        if set(fixed) >= {"fwd", "bwd"}:
            raise ValueError("the precision schedule fixes every GEMM: there is nothing to plan")
        config = replace(config, split_passes=True)
        modules = [replace(m, fprop_flops=0.0 if "fwd" in fixed else m.fprop_flops,
                           dgrad_flops=0.0 if "bwd" in fixed else m.dgrad_flops,
                           wgrad_flops=0.0 if "bwd" in fixed else m.wgrad_flops) for m in modules]
        zero = {n: dict.fromkeys(row, 0.0) for n, row in costs.forward.items()}
        costs = replace(costs, forward=zero if "fwd" in fixed else costs.forward,
                        backward=zero if "bwd" in fixed else costs.backward)
    time_target = config.time_target
    if time_target is None and config.speed is not None:
        time_target = implied_time_target(modules, config)
    common = dict(modules=modules, formats=config.formats, target=config.fp4_target, per_stage=config.per_stage,
                  switch_penalty=config.switch_penalty, speed=config.speed, time_target=time_target,
                  pins=unit_pins(config.pins, config.split_passes),
                  unit_speed=unit_speeds(modules, config.module_speed, config.split_passes))
    if config.split_passes:
        now = None if current is None else {
            **{(m.name, FWD): current[m.name].fwd for m in modules},
            **{(m.name, BWD): current[m.name].bwd for m in modules}}
    else:
        now = None if current is None else {m.name: _joint_format(current[m.name]) for m in modules}
    if now is not None:
        # A format that is not a candidate (e.g. the bf16 warm-up plan under --snip-formats fp8 mxfp4)
        # makes every choice a switch: the same penalty for all, so no current format at all.
        now = {k: f for k, f in now.items() if f in config.formats}
    if config.split_passes:
        return SnipProblem(fwd_cost=costs.forward, bwd_cost=costs.backward, current=now, **common)
    return SnipProblem(cost=costs.joint, current=now, **common)


def unit_speeds(modules: Sequence[LinearModule], module_speed: ModuleSpeeds | None,
                split: bool) -> dict[UnitKey, dict[str, float]] | None:
    """Per-module-type (forward, backward) speeds as the ILP's per-unit speeds: in split mode one per
    pass; jointly the module's FLOP-weighted speed over its three GEMMs (its FLOPs / its time)."""
    if module_speed is None:
        return None
    out: dict[UnitKey, dict[str, float]] = {}
    for m in modules:
        row = module_speed[parse_module_name(m.name)[1]]
        if split:
            out[(m.name, FWD)] = {f: v[0] for f, v in row.items()}
            out[(m.name, BWD)] = {f: v[1] for f, v in row.items()}
        elif m.flops > 0:
            out[m.name] = {f: m.flops / (m.fprop_flops / v[0] + m.bwd_flops / v[1]) for f, v in row.items()}
        else:
            out[m.name] = {f: v[0] for f, v in row.items()}
    return out


def unit_pins(pins: Mapping[str, Precision], split: bool) -> dict[UnitKey, str]:
    """Module -> precision pins as the ILP's unit -> format pins: in split mode one per pass, jointly
    one per module (ValueError for a split precision, which a joint unit cannot hold)."""
    if split:
        return {key: fmt for name, p in pins.items() for key, fmt in (((name, FWD), p.fwd), ((name, BWD), p.bwd))}
    split_pins = sorted(name for name, p in pins.items() if p.fwd != p.bwd)
    if split_pins:
        raise ValueError(f"pin {split_pins[0]} -> {pins[split_pins[0]]} gives its forward and backward GEMMs "
                         "different precisions, which needs --snip-split-passes")
    return {name: p.fwd for name, p in pins.items()}


def implied_time_target(modules: Sequence[LinearModule], config: PlannerConfig) -> float:
    """The GEMM-time budget an FP4 target implies: the estimated time of the plans the baselines
    make at that target (:func:`baseline_formats`: FP4 units in nvfp4, the rest in fp8),
    with the pinned units in their pinned formats. Per budget scope (a stage with per-stage
    budgets, else the model), as a ratio to the scope's all-BF16 time (its FLOPs ``F``):

        T = (pinned time + need / s_fp4 + (free - need) / s_high) / F,   need = t F - pinned FP4 FLOPs

    (without pins ``t / s_fp4 + (1 - t) / s_high``), plus, where FP4 is slower than the high
    format (FP4 emulated on Hopper), the time of one free unit's overshoot of the target, which
    discrete modules cannot avoid. One target holds for every scope, so it is the largest
    scope's. Under it, BF16 can replace FP8 only where extra FP4 pays for its time, so SNIP and
    the baselines are compared at equal estimated cost.
    """
    fp4, high = baseline_formats(config.formats, set(FP4_NAMES) & set(config.formats))
    t = config.fp4_target if fp4 is not None else 0.0
    inv_fp4 = 1.0 / config.speed[fp4] if fp4 is not None else 0.0
    inv_high = 1.0 / config.speed[high] if high is not None else inv_fp4  # no high candidate: all FP4
    scopes: dict[int | None, list[tuple[float, str | None]]] = {}  # scope -> (FLOPs, pinned format) per unit
    for m in modules:
        pin = config.pins.get(m.name)
        parts = (((m.fprop_flops, pin and pin.fwd), (m.bwd_flops, pin and pin.bwd)) if config.split_passes
                 else ((m.flops, pin and pin.fwd),))
        scopes.setdefault(m.stage if config.per_stage else None, []).extend(parts)
    ratios = []
    for units in scopes.values():
        total = sum(flops for flops, _ in units)
        if total <= 0:
            continue
        free = [flops for flops, pin in units if pin is None]
        pinned_fp4 = sum(flops for flops, pin in units if pin in FP4_NAMES)
        need = min(max(t * total - pinned_fp4, 0.0), sum(free))
        time = (sum(flops / config.speed[pin] for flops, pin in units if pin is not None)
                + need * inv_fp4 + (sum(free) - need) * inv_high)
        if need > 0 and inv_fp4 > inv_high:
            time += (inv_fp4 - inv_high) * max(free)
        ratios.append(time / total)
    return max(ratios, default=1.0)


def _joint_format(precision: Precision) -> str:
    # A split precision has no single joint format; charge its forward one.
    return precision.fwd


def solve_plan(problem: SnipProblem, config: PlannerConfig,
               fixed: Mapping[str, str | None] | None = None) -> tuple[PrecisionPlan, Solution]:
    """Solve and turn the solution into a plan covering every module explicitly (with the
    schedule's ``fixed`` passes, which the problem left out, in their fixed precisions; pinned
    modules keep their pins in the plan, the schedule still runs on top of them)."""
    solution = solve(problem, solver=config.solver)
    plan = to_precision_plan(solution.plan, problem.split)
    fixed = fixed or {}
    if any(fixed.values()):
        plan = PrecisionPlan({n: plan[n] if n in config.pins else Precision(fixed.get("fwd") or plan[n].fwd,
                                                                             fixed.get("bwd") or plan[n].bwd)
                              for n in (m.name for m in problem.modules)})
    return plan, solution


def to_precision_plan(units: Mapping[UnitKey, str], split: bool) -> PrecisionPlan:
    """A plan from the ILP's unit -> format mapping (a solution's or a baseline policy's)."""
    if not split:
        return PrecisionPlan({name: Precision.uniform(fmt) for name, fmt in units.items()})
    names = {key[0] for key in units}
    return PrecisionPlan({n: Precision(units[(n, FWD)], units[(n, BWD)]) for n in names})


def baseline_formats(formats: Sequence[str], fp4_formats: Iterable[str]) -> tuple[str | None, str | None]:
    """(fp4, high): the formats a baseline gives its FP4 units and the rest by default: "nvfp4" if
    a candidate, else the first FP4 candidate; "fp8" if a candidate, else the first other FP8 one
    (an ``fp8:RECIPE``), else the first non-FP4 one (None where the candidates have none)."""
    fp4_formats = set(fp4_formats)
    fp4 = [f for f in formats if f in fp4_formats]
    high = [f for f in formats if f not in fp4_formats]
    fp8 = [f for f in high if family(f) == family(PREFERRED_HIGH)]
    return (PREFERRED_FP4 if PREFERRED_FP4 in fp4 else next(iter(fp4), None),
            PREFERRED_HIGH if PREFERRED_HIGH in high else next(iter(fp8 or high), None))
