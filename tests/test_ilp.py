"""Tests of the SNIP ILP (megatron_snip.snip.ilp) and its solver backends.

The optimum is checked against brute-force enumeration written here
independently of the package (it reads the raw instance, not problem.units).
"""

import itertools
import logging
import math

import numpy as np
import pytest

from megatron_snip.snip import solvers
from megatron_snip.snip.feasibility import (
    InfeasibleTargetError,
    InfeasibleTimeTargetError,
    fp4_capacity,
    largest_feasible_target,
)
from megatron_snip.snip.ilp import BWD, FWD, LinearModule, SnipProblem, build_matrix_model, evaluate_plan, solve

LOGGER = "megatron_snip.snip"
SOLVER_NAMES = ("gurobi", "highs")
N_INSTANCES = 30
FP4 = {"nvfp4", "mxfp4"}


# ---------------------------------------------------------------- instances

SPEED_TABLES = ({"bf16": 1.0, "fp8": 2.0, "nvfp4": 4.0, "mxfp4": 4.0},   # blackwell-like
                {"bf16": 1.0, "fp8": 2.0, "nvfp4": 1.0, "mxfp4": 1.0})   # hopper-like: FP4 emulated


# Candidates of a time-target plan on Hopper: an FP8 recipe per module, FP4 sometimes among them.
RECIPE_FORMATS = (("bf16", "fp8:tensorwise", "fp8:rowwise", "fp8:blockwise"),
                  ("bf16", "fp8:tensorwise", "fp8:rowwise", "nvfp4"),
                  ("fp8", "fp8:rowwise", "fp8:blockwise", "fp8:mxfp8"))


def random_instance(rng, *, split=False, per_stage=False, pins=False, switch=False, time=False, recipes=False):
    """Raw instance data (plain dicts) plus the SnipProblem built from it. ``recipes``: FP8 recipes per module
    as candidates, priced per unit (a measured speed table's ``unit_speed``) under a time budget."""
    formats = [("fp8", "nvfp4"), ("bf16", "nvfp4"), ("bf16", "fp8", "nvfp4"), ("fp8", "nvfp4", "mxfp4")][
        rng.integers(4)]
    if recipes:
        formats = RECIPE_FORMATS[rng.integers(len(RECIPE_FORMATS))]
        time = True
    n = int(rng.integers(3, 6) if split else rng.integers(4, 8))
    n_stages = int(rng.integers(1, 4))
    modules = [
        LinearModule(f"decoder.layers.{i}.mlp.linear_fc1", layer=i,
                     fprop_flops=float(rng.uniform(1, 10)) * 1e9, dgrad_flops=float(rng.uniform(1, 10)) * 1e9,
                     wgrad_flops=float(rng.uniform(1, 10)) * 1e9, stage=i * n_stages // n)
        for i in range(n)
    ]
    names = [m.name for m in modules]

    def table():
        # Some zero costs so ties and degenerate objectives are exercised too.
        return {m: {f: float(rng.uniform(0, 1)) * (rng.random() > 0.1) for f in formats} for m in names}

    keys = [(m, p) for m in names for p in (FWD, BWD)] if split else names
    raw = dict(modules=modules, formats=formats, split=split, per_stage=per_stage, keys=keys,
               pins={}, current={}, penalty=0.0)
    if split:
        raw["fwd_cost"], raw["bwd_cost"] = table(), table()
    else:
        raw["cost"] = table()
    if pins:
        for k in rng.choice(len(keys), size=int(rng.integers(1, 3)), replace=False):
            raw["pins"][keys[k]] = formats[rng.integers(len(formats))]
    if switch:
        raw["current"] = {k: formats[rng.integers(len(formats))] for k in keys if rng.random() < 0.8}
        raw["penalty"] = float(rng.uniform(0, 0.6))

    def build(target, time_target=None):
        costs = dict(fwd_cost=raw["fwd_cost"], bwd_cost=raw["bwd_cost"]) if split else dict(cost=raw["cost"])
        timed = dict(speed=raw["speed"], time_target=time_target, unit_speed=raw.get("unit_speed")) if time else {}
        return SnipProblem(modules, formats, target, **costs, per_stage=per_stage, pins=raw["pins"],
                           current=raw["current"] or None, switch_penalty=raw["penalty"], **timed)

    if time:
        raw["speed"] = SPEED_TABLES[rng.integers(len(SPEED_TABLES))]
    if recipes:
        # Measured-like: each unit its own speed per format, bf16 included (the ILP's all-bf16 time), FP8
        # recipes from a little slower to twice as fast as bf16 (rowwise and blockwise pay more for scales).
        low = {"bf16": 0.8, "fp8": 1.0, "fp8:tensorwise": 1.0, "fp8:rowwise": 0.9, "fp8:blockwise": 0.7,
               "fp8:mxfp8": 0.6, "nvfp4": 0.5}
        raw["speed"] = {f: 1.0 for f in formats}
        raw["unit_speed"] = {k: {f: float(rng.uniform(low[f], low[f] + 1.0)) for f in {*formats, "bf16"}}
                             for k in keys}
    largest = largest_feasible_target(build(0.0))
    # Every fifth instance sits exactly on the largest feasible target.
    target = largest if rng.random() < 0.2 else float(rng.uniform(0, largest))
    raw["target"] = target
    if not time:
        return raw, build(target)
    # A time target between the least and the most time the FP4-feasible plans take (sometimes
    # exactly the least: the binding case).
    fastest, slowest = time_range(raw)
    raw["time_target"] = fastest if rng.random() < 0.2 else float(rng.uniform(fastest, slowest))
    return raw, build(target, raw["time_target"])


def enumerate_assignments(raw):
    """Every assignment's objective, whether it meets the FP4 budget, and its time ratio (global and
    per stage, as arrays over the assignments; time None without a speed table)."""
    mods = {m.name: m for m in raw["modules"]}
    units = []
    for key in raw["keys"]:
        if raw["split"]:
            name, p = key
            m = mods[name]
            flops = m.fprop_flops if p == FWD else m.dgrad_flops + m.wgrad_flops
            cost = (raw["fwd_cost"] if p == FWD else raw["bwd_cost"])[name]
        else:
            m = mods[key]
            flops = m.fprop_flops + m.dgrad_flops + m.wgrad_flops
            cost = raw["cost"][key]
        allowed = [raw["pins"][key]] if key in raw["pins"] else list(raw["formats"])
        cur = raw["current"].get(key)
        unit_cost = [cost[f] + raw["penalty"] * (cur is not None and f != cur) for f in allowed]
        units.append((allowed, unit_cost, flops, m.stage))

    combos = np.array(list(itertools.product(*[range(len(u[0])) for u in units])))
    objective = np.zeros(len(combos))
    fp4_flops, time = {}, {}
    speed = raw.get("speed")
    bf16_time = {}  # stage -> its all-bf16 time (its FLOPs, or by each unit's own speed)
    for j, (key, (allowed, unit_cost, flops, stage)) in enumerate(zip(raw["keys"], units)):
        objective += np.asarray(unit_cost)[combos[:, j]]
        is_fp4 = np.array([f in FP4 for f in allowed])[combos[:, j]]
        fp4_flops[stage] = fp4_flops.get(stage, 0.0) + flops * is_fp4
        unit_speed = raw["unit_speed"][key] if raw.get("unit_speed") else speed
        if speed is not None:
            time[stage] = time.get(stage, 0.0) + np.array([flops / unit_speed[f] for f in allowed])[combos[:, j]]
            bf16_time[stage] = bf16_time.get(stage, 0.0) + flops / (unit_speed["bf16"] if raw.get("unit_speed")
                                                                      else 1.0)
    stage_total = {}
    for _, _, flops, stage in units:
        stage_total[stage] = stage_total.get(stage, 0.0) + flops
    total = sum(stage_total.values())
    ok = sum(fp4_flops.values()) / total >= raw["target"] - 1e-9
    if raw["per_stage"]:
        for s, f in stage_total.items():
            ok &= fp4_flops[s] / f >= raw["target"] - 1e-9
    if speed is None:
        return objective, ok, None
    # The binding time of an assignment: its worst stage with per-stage budgets, else the whole.
    ratio = (np.max([time[s] / bf16_time[s] for s in stage_total], axis=0) if raw["per_stage"]
             else sum(time.values()) / sum(bf16_time.values()))
    return objective, ok, ratio


def time_range(raw):
    """(least, most) binding time ratio over the assignments that meet the FP4 budget."""
    _, ok, ratio = enumerate_assignments(raw)
    return float(ratio[ok].min()), float(ratio[ok].max())


def brute_force(raw):
    """Minimum objective over all assignments meeting the budgets (None if none does)."""
    objective, ok, ratio = enumerate_assignments(raw)
    if raw.get("time_target") is not None:
        ok &= ratio <= raw["time_target"] + 1e-9
    return float(objective[ok].min()) if ok.any() else None


SCENARIOS = {
    "global": dict(),
    "per_stage": dict(per_stage=True),
    "pins": dict(pins=True, per_stage=None),
    "switch": dict(switch=True, per_stage=None),
    "split": dict(split=True, per_stage=None, pins=None, switch=None),
    "time": dict(time=True, per_stage=None, pins=None, split=None),
    "fp8_recipes": dict(recipes=True, per_stage=None, pins=None, split=None, switch=None),
}


@pytest.mark.parametrize("solver", SOLVER_NAMES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_matches_brute_force(scenario, solver):
    mixed_recipes = 0  # optima that run modules in two FP8 recipes or more
    for seed in range(N_INSTANCES):
        rng = np.random.default_rng([list(SCENARIOS).index(scenario), seed])
        # None in a scenario means "toggle at random per instance".
        flags = {k: bool(rng.random() < 0.5) if v is None else v for k, v in SCENARIOS[scenario].items()}
        raw, problem = random_instance(rng, **flags)
        best = brute_force(raw)
        assert best is not None, "generated targets are feasible by construction"

        sol = solve(problem, solver)
        ctx = f"{scenario} seed {seed} {flags}: solver {sol.objective} vs brute force {best}"
        assert sol.solver == solver
        assert sol.status == "optimal"
        # Never better than the optimum (the plan is feasible), at worst within the MIP gap.
        assert best - 1e-9 <= sol.objective <= best + 1e-4 * abs(best) + 1e-9, ctx
        assert sol.meets_target, ctx
        assert set(sol.plan) == set(raw["keys"])
        assert all(sol.plan[k] == f for k, f in raw["pins"].items()), ctx
        assert evaluate_plan(problem, sol.plan).objective == pytest.approx(sol.objective)
        assert 0 <= sol.gap <= 1e-4 + 1e-12 and sol.seconds >= 0
        assert sol.bound <= sol.objective + 1e-6
        mixed_recipes += len({f for f in sol.plan.values() if f.startswith("fp8")}) > 1
    if scenario == "fp8_recipes":
        assert mixed_recipes >= N_INSTANCES // 3, "the instances must exercise plans that mix FP8 recipes"


def test_solvers_agree_exactly_with_zero_gap():
    for seed in range(10):
        raw, problem = random_instance(np.random.default_rng(seed), per_stage=True, pins=True, switch=True)
        best = brute_force(raw)
        for solver in SOLVER_NAMES:
            assert solve(problem, solver, mip_gap=0).objective == pytest.approx(best, rel=1e-9, abs=1e-9)


def test_per_stage_budgets_of_uneven_stages_match_brute_force():
    """The planner's problem at uneven stages (PP2 with 1 + 3 layers of a 4-layer model: 16 modules, 2^16
    assignments): its stage rows are built from the modules megatron-core places on each stage, so the
    solver's optimum is brute force's over those stages, and each stage meets the target over its own FLOPs."""
    from megatron_snip.precision.flops import LlamaLinearDims
    from megatron_snip.precision.pipeline_layout import PipelineLayout
    from megatron_snip.snip.estimators import CostTables
    from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules

    dims = LlamaLinearDims(num_layers=4, hidden_size=64, ffn_hidden_size=192, kv_channels=16, num_query_groups=2)
    modules = linear_modules(dims, 8, PipelineLayout(4, 2, first_stage_layers=1))
    formats = ("fp8", "nvfp4")
    for seed in range(3):
        rng = np.random.default_rng(seed)
        cost = {m.name: {f: float(rng.uniform(0, 1)) for f in formats} for m in modules}
        target = float(rng.uniform(0.3, 0.7))
        config = PlannerConfig(formats=formats, fp4_target=target, per_stage=True, solver="highs")
        problem = build_problem(modules, CostTables(cost, cost, cost), config)
        raw = dict(modules=modules, formats=formats, split=False, per_stage=True, keys=[m.name for m in modules],
                   pins={}, current={}, penalty=0.0, cost=cost, target=target)
        best = brute_force(raw)
        sol = solve(problem, "highs")
        assert best - 1e-9 <= sol.objective <= best + 1e-4 * abs(best) + 1e-9, (seed, sol.objective, best)
        assert set(sol.stage_fp4_fraction) == {0, 1} and min(sol.stage_fp4_fraction.values()) >= target - 1e-9


# ---------------------------------------------------------------- problem data

def test_flops_from_shape():
    m = LinearModule.from_shape("decoder.layers.0.mlp.linear_fc2", layer=0, tokens=4096, in_features=5632,
                                out_features=2048, stage=1)
    tio = 4096 * 5632 * 2048
    assert (m.fprop_flops, m.dgrad_flops, m.wgrad_flops) == (2 * tio, 2 * tio, 2 * tio)
    assert m.bwd_flops == 4 * tio and m.flops == 6 * tio and m.stage == 1


def test_split_mode_flops_and_plan_keys():
    mods = [LinearModule("a", 0, 1.0, 2.0, 3.0), LinearModule("b", 1, 4.0, 4.0, 4.0)]
    costs = {n: {"fp8": 0.0, "nvfp4": 1.0} for n in "ab"}
    # 18 FLOPs in all; a's backward alone (5) meets a 5/18 target at the cost of one unit.
    p = SnipProblem(mods, ("fp8", "nvfp4"), 5 / 18, fwd_cost=costs, bwd_cost=costs, pins={("b", BWD): "fp8"})
    assert [u.key for u in p.units] == [("a", FWD), ("a", BWD), ("b", FWD), ("b", BWD)]
    assert [u.flops for u in p.units] == [1.0, 5.0, 4.0, 8.0]
    sol = solve(p, "highs")
    assert sol.plan == {("a", FWD): "fp8", ("a", BWD): "nvfp4", ("b", FWD): "fp8", ("b", BWD): "fp8"}
    assert sol.fp4_fraction == pytest.approx(5 / 18) and sol.objective == 1.0
    # A bare module name in a plan stands for both passes.
    assert evaluate_plan(p, {"a": "nvfp4", "b": "fp8"}).fp4_fraction == pytest.approx(6 / 18)


def test_switch_penalty_keeps_current_plan():
    mods = [LinearModule(f"m{i}", i, 1.0, 1.0, 1.0) for i in range(4)]
    cost = {f"m{i}": {"fp8": 0.0, "nvfp4": 0.1 * (i + 1)} for i in range(4)}
    current = {"m0": "fp8", "m1": "fp8", "m2": "nvfp4", "m3": "nvfp4"}
    free = solve(SnipProblem(mods, ("fp8", "nvfp4"), 0.5, cost=cost, current=current))
    assert free.plan == {"m0": "nvfp4", "m1": "nvfp4", "m2": "fp8", "m3": "fp8"} and free.n_switched == 4
    sticky = solve(SnipProblem(mods, ("fp8", "nvfp4"), 0.5, cost=cost, current=current, switch_penalty=1.0))
    assert sticky.plan == current and sticky.n_switched == 0
    assert sticky.objective == pytest.approx(0.7)


def test_per_stage_budget_is_enforced_per_stage():
    # Stage 0 has the cheap FP4 modules; globally all FP4 could sit there.
    mods = [LinearModule(f"m{i}", i, 1.0, 1.0, 1.0, stage=i // 2) for i in range(4)]
    cost = {f"m{i}": {"fp8": 0.0, "nvfp4": 0.1 if i < 2 else 1.0} for i in range(4)}
    glob = solve(SnipProblem(mods, ("fp8", "nvfp4"), 0.5, cost=cost))
    assert glob.stage_fp4_fraction == {0: 1.0, 1: 0.0}
    staged = solve(SnipProblem(mods, ("fp8", "nvfp4"), 0.5, cost=cost, per_stage=True))
    assert staged.stage_fp4_fraction == {0: 0.5, 1: 0.5} and staged.fp4_fraction == 0.5


@pytest.mark.parametrize("solver", SOLVER_NAMES)
def test_costs_far_below_the_largest_still_count(solver):
    """SNIP's costs of a 4-layer model at iteration 4 (PP=2, per-stage budgets, time target 1):
    they span 1e7. With no FP4 target the optimum is all BF16 at cost 0; at Gurobi's default
    reduced-cost tolerance the three cheapest modules came out in FP4 (cost 0.0023)."""
    nvfp4 = (1820.0, 0.774, 17.0, 5.74, 32.2, 0.0277, 0.152, 0.161,
             1.5, 0.000811, 0.0104, 0.00746, 0.0178, 0.000162, 0.0019, 0.00129)
    kinds = (("self_attention.linear_qkv", 1.0), ("self_attention.linear_proj", 0.5),
             ("mlp.linear_fc1", 3.0), ("mlp.linear_fc2", 1.5))
    mods = [LinearModule(f"decoder.layers.{i // 4}.{kinds[i % 4][0]}", i // 4, *[kinds[i % 4][1]] * 3,
                         stage=i // 8) for i in range(16)]
    cost = {m.name: {"bf16": 0.0, "nvfp4": c} for m, c in zip(mods, nvfp4)}
    problem = SnipProblem(mods, ("bf16", "nvfp4"), 0.0, cost=cost, per_stage=True,
                          speed={"bf16": 1.0, "nvfp4": 4.0}, time_target=1.0)
    sol = solve(problem, solver)
    assert sol.objective == 0.0 and set(sol.plan.values()) == {"bf16"}


def test_fp4_formats_are_configurable():
    mods = [LinearModule(f"m{i}", i, 1.0, 1.0, 1.0) for i in range(2)]
    cost = {f"m{i}": {"bf16": 0.0, "fp8": 0.2, "int4": 0.5} for i in range(2)}
    p = SnipProblem(mods, ("bf16", "fp8", "int4"), 0.5, cost=cost, fp4_formats={"int4"})
    assert sorted(solve(p).plan.values()) == ["bf16", "int4"]


# ---------------------------------------------------------------- infeasible targets

def _uniform_modules(n, stages=1):
    return [LinearModule(f"decoder.layers.{i}.mlp.linear_fc1", i, 1.0, 1.0, 1.0, stage=i * stages // n)
            for i in range(n)]


def _costs(mods, formats=("bf16", "fp8", "nvfp4")):
    return {m.name: {f: 0.1 for f in formats} for m in mods}


def test_infeasible_target_names_largest_global_target():
    mods = _uniform_modules(8)
    pins = {mods[0].name: "bf16"}
    with pytest.raises(InfeasibleTargetError) as exc:
        SnipProblem(mods, ("bf16", "fp8", "nvfp4"), 0.95, cost=_costs(mods), pins=pins)
    err = exc.value
    assert isinstance(err, ValueError)
    assert err.largest_feasible == pytest.approx(0.875) and err.target == 0.95
    msg = str(err)
    assert "FP4 target 0.95 is infeasible" in msg
    assert "with 1 module pinned to non-FP4 formats (bf16: 1)" in msg
    assert "largest feasible target is 0.875 (global)" in msg and "--snip-fp4-target" in msg
    # Exactly the largest feasible target is solvable by both solvers.
    p = SnipProblem(mods, ("bf16", "fp8", "nvfp4"), 0.875, cost=_costs(mods), pins=pins)
    for solver in SOLVER_NAMES:
        assert solve(p, solver).fp4_fraction == pytest.approx(0.875)


def test_infeasible_target_names_binding_stage():
    mods = _uniform_modules(8, stages=2)  # layers 0-3 stage 0, 4-7 stage 1
    pins = {mods[4].name: "fp8", mods[5].name: "fp8", mods[0].name: "bf16"}
    formats = ("bf16", "fp8", "nvfp4")
    with pytest.raises(InfeasibleTargetError) as exc:
        SnipProblem(mods, formats, 0.6, cost=_costs(mods), pins=pins, per_stage=True)
    err = exc.value
    assert err.largest_feasible == pytest.approx(0.5)
    assert err.global_max == pytest.approx(5 / 8)
    assert err.stage_max == pytest.approx({0: 0.75, 1: 0.5})
    assert "3 modules pinned to non-FP4 formats (bf16: 1, fp8: 2)" in str(err)
    assert "0.625 (global) / 0.5 (stage 1)" in str(err)
    # Without per-stage budgets 0.6 is within the global capacity.
    assert solve(SnipProblem(mods, formats, 0.6, cost=_costs(mods), pins=pins)).fp4_fraction >= 0.6


def test_infeasible_split_pins_count_passes():
    mods = [LinearModule("a", 0, 1.0, 1.0, 1.0), LinearModule("b", 1, 1.0, 1.0, 1.0)]
    c = _costs(mods)
    with pytest.raises(InfeasibleTargetError) as exc:
        SnipProblem(mods, ("bf16", "fp8", "nvfp4"), 0.8, fwd_cost=c, bwd_cost=c, pins={("a", BWD): "bf16"})
    assert exc.value.largest_feasible == pytest.approx(4 / 6)
    assert "1 module pass pinned" in str(exc.value) and "0.666667 (global)" in str(exc.value)


def test_infeasible_without_fp4_candidates():
    mods = _uniform_modules(2)
    with pytest.raises(InfeasibleTargetError, match="none of the candidate formats") as exc:
        SnipProblem(mods, ("bf16", "fp8"), 0.5, cost=_costs(mods, ("bf16", "fp8")))
    assert exc.value.largest_feasible == 0.0
    # A zero target needs no FP4 format.
    p = SnipProblem(mods, ("bf16", "fp8"), 0.0, cost=_costs(mods, ("bf16", "fp8")))
    assert solve(p).fp4_fraction == 0.0 and fp4_capacity(p) == (0.0, {0: 0.0})


# ---------------------------------------------------------------- input validation

def _bad(**change):
    mods = change.pop("modules", _uniform_modules(3))
    kwargs = dict(formats=("fp8", "nvfp4"), target=0.5, cost=_costs(mods, ("fp8", "nvfp4")))
    kwargs.update(change)
    return lambda: SnipProblem(mods, **kwargs)


M0 = "decoder.layers.0.mlp.linear_fc1"
GOOD = _costs(_uniform_modules(3), ("fp8", "nvfp4"))


@pytest.mark.parametrize("build, message", [
    (_bad(cost={**GOOD, M0: {"fp8": 0.1, "nvfp4": 0.1, "fp6": 0.1}}), "unknown format"),
    (_bad(cost={**GOOD, M0: {"fp8": -0.1, "nvfp4": 0.1}}), "finite and >= 0"),
    (_bad(cost={**GOOD, M0: {"fp8": math.nan, "nvfp4": 0.1}}), "finite and >= 0"),
    (_bad(cost={k: v for k, v in GOOD.items() if k != M0}), "missing costs for 1 module"),
    (_bad(cost={**GOOD, M0: {"fp8": 0.1}}), r"missing cost for format\(s\) \['nvfp4'\]"),
    (_bad(cost={**GOOD, "decoder.layers.9.mlp.linear_fc1": {"fp8": 0.1, "nvfp4": 0.1}}), "unknown modules"),
    (_bad(target=1.5), r"in \[0, 1\]"),
    (_bad(target=-0.1), r"in \[0, 1\]"),
    (_bad(pins={M0: "int8"}), "unknown format 'int8'"),
    (_bad(pins={"decoder.layers.9.mlp.linear_fc1": "fp8"}), "is not a module name"),
    (_bad(pins={(M0, "fwd"): "fp8"}), "is not a module name"),  # pass keys only in split mode
    (_bad(cost=None, fwd_cost=GOOD, bwd_cost=GOOD, pins={M0: "fp8", (M0, "fwd"): "nvfp4"}), "conflicting"),
    (_bad(fwd_cost=GOOD), "not both or neither"),
    (_bad(cost=None, fwd_cost=GOOD), "needs both"),
    (_bad(fp4_formats={"nvfp4", "mxfp4"}), "not candidate formats"),
    (_bad(formats=("fp8", "fp8")), "duplicate candidate formats"),
    (_bad(modules=_uniform_modules(2) * 2), "duplicate module names"),
    (_bad(switch_penalty=-1.0), "switch_penalty"),
    (_bad(current={M0: "fp4"}), "current plan"),
    (lambda: LinearModule("x", 0, -1.0, 1.0, 1.0), "fprop_flops must be finite"),
    (lambda: LinearModule("x", -1, 1.0, 1.0, 1.0), "layer must be an integer"),
    (_bad(modules=[LinearModule(M0, 0, 0.0, 0.0, 0.0)], cost={M0: {"fp8": 0.1, "nvfp4": 0.1}}), "no FLOPs"),
])
def test_invalid_inputs_are_rejected(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_invalid_plans_and_solver_arguments():
    mods = _uniform_modules(3)
    p = SnipProblem(mods, ("fp8", "nvfp4"), 0.5, cost=_costs(mods, ("fp8", "nvfp4")))
    with pytest.raises(ValueError, match="no format for 2 unit"):
        evaluate_plan(p, {mods[0].name: "fp8"})
    with pytest.raises(ValueError, match="unknown ILP solver"):
        solve(p, "cplex")
    with pytest.raises(ValueError, match="time_limit"):
        solve(p, time_limit=0)
    with pytest.raises(ValueError, match="mip_gap"):
        solve(p, mip_gap=1.5)


# ---------------------------------------------------------------- solver selection

def _small_problem():
    mods = _uniform_modules(4)
    return SnipProblem(mods, ("fp8", "nvfp4"), 0.5, cost=_costs(mods, ("fp8", "nvfp4")))


@pytest.fixture(scope="module")
def large_problem():
    """1001 modules x 2 formats = 2002 binaries: over the pip license's 2000."""
    rng = np.random.default_rng(7)
    mods = [LinearModule.from_shape(f"decoder.layers.{i}.mlp.linear_fc1", i, 8, int(rng.integers(1, 9)) * 64,
                                    64, stage=i % 4) for i in range(1001)]
    cost = {m.name: {"fp8": float(rng.uniform(0, 0.1)), "nvfp4": float(rng.uniform(0, 1))} for m in mods}
    return SnipProblem(mods, ("fp8", "nvfp4"), 0.7, cost=cost, per_stage=True)


@pytest.fixture
def gurobipy():
    return pytest.importorskip("gurobipy")


@pytest.fixture
def size_limited_gurobi(gurobipy):
    if not solvers._gurobi_size_limited(gurobipy):
        pytest.skip("the installed Gurobi license is not size-limited")


def _no_gurobipy():
    raise ImportError("No module named 'gurobipy'")


def test_auto_uses_gurobi_when_usable(gurobipy, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sol = solve(_small_problem(), "auto")
    assert sol.solver == "gurobi"
    assert "solved by gurobi" in caplog.text and "falling back" not in caplog.text


def test_auto_falls_back_without_gurobipy(monkeypatch, caplog):
    monkeypatch.setattr(solvers, "_import_gurobipy", _no_gurobipy)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sol = solve(_small_problem(), "auto")
    assert sol.solver == "highs"
    assert "falling back to HiGHS because gurobipy is not importable" in caplog.text
    assert "solved by highs" in caplog.text


def test_explicit_gurobi_without_gurobipy_raises(monkeypatch):
    monkeypatch.setattr(solvers, "_import_gurobipy", _no_gurobipy)
    with pytest.raises(solvers.SolverUnavailableError, match="gurobipy is not importable.*'highs'.*'auto'"):
        solve(_small_problem(), "gurobi")


def test_auto_falls_back_over_license_size(size_limited_gurobi, large_problem, caplog):
    model, _, _ = build_matrix_model(large_problem)
    assert model.n_vars > solvers.GUROBI_SIZE_LIMIT
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sol = solve(large_problem, "auto")
    assert sol.solver == "highs" and sol.meets_target
    assert f"falling back to HiGHS because the model has {model.n_vars} variables" in caplog.text
    assert "size-limited license" in caplog.text


def test_explicit_gurobi_over_license_size_raises(size_limited_gurobi, large_problem):
    with pytest.raises(solvers.SolverUnavailableError, match="size-limited license.*'highs'"):
        solve(large_problem, "gurobi")


def test_gurobi_error_at_solve_time_falls_back(gurobipy, monkeypatch, large_problem, caplog):
    # Pretend the license check passed: the real size-limited license then
    # refuses the model inside optimize(), which must be caught.
    monkeypatch.setattr(solvers, "_gurobi_size_limited", lambda gp: False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sol = solve(large_problem, "auto")
    if sol.solver == "gurobi":
        pytest.skip("the installed Gurobi license admits the model")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "falling back to HiGHS because Gurobi failed (error 10010" in warnings[0].getMessage()


# ---------------------------------------------------------------- time budgets

BLACKWELL = {"bf16": 1.0, "fp8": 2.0, "nvfp4": 4.0}


def test_time_target_is_an_upper_bound_on_estimated_gemm_time():
    # Two modules of 1 + 1 + 1 FLOPs; bf16 costs nothing, fp8 a little, nvfp4 more.
    mods = [LinearModule(f"m{i}", i, 1.0, 1.0, 1.0) for i in range(2)]
    cost = {f"m{i}": {"bf16": 0.0, "fp8": 0.1, "nvfp4": 1.0 + i} for i in range(2)}
    free = solve(SnipProblem(mods, ("bf16", "fp8", "nvfp4"), 0.0, cost=cost, speed=BLACKWELL))
    assert free.plan == {"m0": "bf16", "m1": "bf16"} and free.time_ratio == 1.0
    # time <= 0.5: both in fp8 (0.5) is the cheapest way; bf16 + nvfp4 would be 0.625.
    half = solve(SnipProblem(mods, ("bf16", "fp8", "nvfp4"), 0.0, cost=cost, speed=BLACKWELL, time_target=0.5))
    assert half.plan == {"m0": "fp8", "m1": "fp8"} and half.time_ratio == pytest.approx(0.5)
    # time <= 0.375: one module must be in nvfp4 (0.25 + 0.5)/2; the cheaper one (m0) takes it.
    tight = solve(SnipProblem(mods, ("bf16", "fp8", "nvfp4"), 0.0, cost=cost, speed=BLACKWELL, time_target=0.375))
    assert tight.plan == {"m0": "nvfp4", "m1": "fp8"} and tight.meets_target


def test_infeasible_time_target_names_the_smallest_feasible_one():
    mods = [LinearModule(f"m{i}", i, 1.0, 1.0, 1.0, stage=i) for i in range(2)]
    cost = {f"m{i}": {"bf16": 0.0, "fp8": 0.1} for i in range(2)}
    message = r"0\.5 \(global\) / 0\.5 \(stage 0\).*Raise --snip-time-target"
    with pytest.raises(InfeasibleTimeTargetError, match=message) as e:
        SnipProblem(mods, ("bf16", "fp8"), 0.0, cost=cost, speed=BLACKWELL, time_target=0.4, per_stage=True)
    assert e.value.smallest_feasible == pytest.approx(0.5)


@pytest.mark.parametrize("solver", SOLVER_NAMES)
def test_fp4_and_time_targets_that_cannot_hold_together_are_named(solver):
    # FP4 emulated (no faster than bf16): 50% FP4 costs time, so time 0.6 is reachable (all fp8: 0.5)
    # and 50% FP4 is reachable, but not both: the least time at 50% FP4 is (1 + 0.5) / 2 = 0.75.
    hopper = {"fp8": 2.0, "nvfp4": 1.0}
    mods = [LinearModule(f"m{i}", i, 1.0, 1.0, 1.0) for i in range(2)]
    cost = {f"m{i}": {"fp8": 0.0, "nvfp4": 1.0} for i in range(2)}
    problem = SnipProblem(mods, ("fp8", "nvfp4"), 0.5, cost=cost, speed=hopper, time_target=0.6)
    with pytest.raises(InfeasibleTimeTargetError, match=r"cannot both be met.*0\.75") as e:
        solve(problem, solver)
    assert e.value.smallest_feasible == pytest.approx(0.75)


def test_time_target_needs_every_candidate_speed():
    mods = [LinearModule("m0", 0, 1.0, 1.0, 1.0)]
    with pytest.raises(ValueError, match=r"no throughput for candidate format\(s\) \['nvfp4'\]"):
        SnipProblem(mods, ("fp8", "nvfp4"), 0.0, cost={"m0": {"fp8": 0.0, "nvfp4": 0.0}}, speed={"fp8": 2.0},
                    time_target=0.5)
    with pytest.raises(ValueError, match="a time target needs speed"):
        SnipProblem(mods, ("fp8",), 0.0, cost={"m0": {"fp8": 0.0}}, time_target=0.5)
