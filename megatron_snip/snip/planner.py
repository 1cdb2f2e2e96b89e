"""From per-module divergences to a precision plan: build the ILP, solve it, read the plan.

Pure functions: the manager calls them on one rank with gathered statistics;
``tools/snip_solve.py`` calls them offline on a statistics JSON.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_snip.precision.flops import LlamaLinearDims
from megatron_snip.precision.plan import LINEAR_MODULES, PrecisionPlan, module_name
from megatron_snip.precision.recipes import Precision
from megatron_snip.snip.estimators import CostTables
from megatron_snip.snip.ilp import BWD, FWD, LinearModule, SnipProblem, Solution, UnitKey, solve

@dataclass(frozen=True)
class PlannerConfig:
    """The ILP's settings (flags ``--snip-*``)."""

    formats: tuple[str, ...]  # candidates, e.g. ("bf16", "fp8", "nvfp4")
    fp4_target: float  # required FP4 fraction of linear-layer FLOPs
    per_stage: bool = True  # the target holds within every pipeline stage
    split_passes: bool = False  # forward and backward GEMMs choose separately
    switch_penalty: float = 0.0  # per unit whose format changes from the current plan
    solver: str = "auto"


def linear_modules(dims: LlamaLinearDims, tokens: int, pipeline_stages: int) -> list[LinearModule]:
    """Every linear module with its GEMM FLOPs for ``tokens`` tokens and its pipeline stage."""
    per_stage = dims.num_layers // pipeline_stages
    out = []
    for layer in range(dims.num_layers):
        for module in LINEAR_MODULES:
            fan_in, fan_out = dims.in_out(module)
            out.append(LinearModule.from_shape(module_name(layer, module), layer, tokens, fan_in, fan_out,
                                               stage=layer // per_stage))
    return out


def build_problem(modules: Sequence[LinearModule], costs: CostTables, config: PlannerConfig,
                  current: PrecisionPlan | None = None) -> SnipProblem:
    """The SNIP ILP: minimise the weighted divergences (``costs``) subject to the FP4 budget.

    Jointly a module pays its forward and backward costs for one format; in split
    mode the forward GEMM and the backward GEMMs each choose and pay their own.
    """
    common = dict(modules=modules, formats=config.formats, target=config.fp4_target, per_stage=config.per_stage,
                  switch_penalty=config.switch_penalty)
    if config.split_passes:
        now = None if current is None else {
            **{(m.name, FWD): current[m.name].fwd for m in modules},
            **{(m.name, BWD): current[m.name].bwd for m in modules}}
        return SnipProblem(fwd_cost=costs.forward, bwd_cost=costs.backward, current=now, **common)
    now = None if current is None else {m.name: _joint_format(current[m.name]) for m in modules}
    return SnipProblem(cost=costs.joint, current=now, **common)


def _joint_format(precision: Precision) -> str:
    # A split precision has no single joint format; charge its forward one.
    return precision.fwd


def solve_plan(problem: SnipProblem, config: PlannerConfig) -> tuple[PrecisionPlan, Solution]:
    """Solve and turn the solution into a plan covering every module explicitly."""
    solution = solve(problem, solver=config.solver)
    return to_precision_plan(solution.plan, problem.split), solution


def to_precision_plan(units: Mapping[UnitKey, str], split: bool) -> PrecisionPlan:
    """A plan from the ILP's unit -> format mapping (a solution's or a baseline policy's)."""
    if not split:
        return PrecisionPlan({name: Precision.uniform(fmt) for name, fmt in units.items()})
    names = {key[0] for key in units}
    return PrecisionPlan({n: Precision(units[(n, FWD)], units[(n, BWD)]) for n in names})
