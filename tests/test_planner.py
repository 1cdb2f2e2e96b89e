"""The planner: divergences -> ILP -> plan, in joint and split mode, per pipeline stage."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from megatron_snip.numerics.recipes import Precision
from megatron_snip.precision.flops import LlamaLinearDims, flop_fractions
from megatron_snip.precision.pipeline_layout import PipelineLayout
from megatron_snip.precision.plan import PrecisionPlan, module_names
from megatron_snip.snip.estimators import CostTables
from megatron_snip.snip.ilp import LinearModule
from megatron_snip.snip.planner import PlannerConfig, build_problem, implied_time_target, linear_modules, solve_plan

DIMS = LlamaLinearDims(num_layers=4, hidden_size=64, ffn_hidden_size=192, kv_channels=16, num_query_groups=2)
FORMATS = ("bf16", "fp8", "nvfp4")


def tables(fwd, bwd):
    joint = {n: {f: fwd[n][f] + bwd[n][f] for f in fwd[n]} for n in fwd}
    return CostTables(joint=joint, forward=fwd, backward=bwd)


def divergences(scale_by_layer):
    """FP4 hurts layer l by scale_by_layer[l] in each pass; fp8 a hundredth of that; bf16 nothing."""
    div = {n: {"bf16": 0.0, "fp8": 0.01 * scale_by_layer[int(n.split(".")[2])],
               "nvfp4": scale_by_layer[int(n.split(".")[2])]} for n in module_names(DIMS.num_layers)}
    return tables(div, div)


def test_modules_carry_flops_and_stages():
    mods = linear_modules(DIMS, tokens=10, layout=PipelineLayout(4, 2))
    assert len(mods) == 16 and {m.stage for m in mods} == {0, 1}
    fc1 = next(m for m in mods if m.name == "decoder.layers.3.mlp.linear_fc1")
    assert (fc1.stage, fc1.fprop_flops) == (1, 2 * 10 * 64 * 384)


def test_virtual_stages_budget_each_physical_stage_over_its_chunks():
    """PP2 x VPP2 over 4 layers: chunks of one layer dealt round-robin, rank 0 runs layers 0 and 2."""
    mods = linear_modules(DIMS, tokens=10, layout=PipelineLayout(4, 2, 2))
    assert {int(m.name.split(".")[2]): m.stage for m in mods} == {0: 0, 1: 1, 2: 0, 3: 1}
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=True)
    # Layers 0 and 2 (rank 0) are the sensitive ones: a per-stage budget still puts half of rank 0's
    # FLOPs in FP4, where a stage mapping without interleaving (layers 0, 1 on rank 0) would not.
    plan, sol = solve_plan(build_problem(mods, divergences([100.0, 1.0, 100.0, 1.0]), cfg), cfg)
    assert all(v >= 0.5 - 1e-9 for v in sol.stage_fp4_fraction.values()) and set(sol.stage_fp4_fraction) == {0, 1}
    assert any(plan[f"decoder.layers.{layer}.mlp.linear_fc1"].fwd == "nvfp4" for layer in (0, 2))


def test_uneven_stages_hold_each_stage_to_its_own_flops():
    """PP2 with 1 + 3 layers (--decoder-first-pipeline-num-layers 1): stage 0 is layer 0 alone, so a per-stage
    budget puts half of layer 0's FLOPs in FP4 although it is the sensitive one; an even split (layers 0, 1 on
    stage 0) would meet stage 0's budget with layer 1 and leave layer 0 in fp8."""
    mods = linear_modules(DIMS, tokens=10, layout=PipelineLayout(4, 2, first_stage_layers=1))
    assert {m.layer: m.stage for m in mods} == {0: 0, 1: 1, 2: 1, 3: 1}
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=True)
    div = divergences([100.0, 1.0, 1.0, 1.0])
    problem = build_problem(mods, div, cfg)
    layer_flops = sum(m.flops for m in mods if m.layer == 0)
    assert problem.stage_flops == pytest.approx({0: layer_flops, 1: 3 * layer_flops})
    plan, sol = solve_plan(problem, cfg)
    layer0 = [n for n in module_names(4) if n.startswith("decoder.layers.0.")]
    assert flop_fractions(plan, DIMS, layer0).fp4 >= 0.5 - 1e-9
    assert sol.stage_fp4_fraction[0] >= 0.5 - 1e-9 and sol.stage_fp4_fraction[1] >= 0.5 - 1e-9
    even, _ = solve_plan(build_problem(linear_modules(DIMS, 10, PipelineLayout(4, 2)), div, cfg), cfg)
    assert flop_fractions(even, DIMS, layer0).fp4 == 0.0


def test_sensitive_layers_stay_high_and_target_is_met():
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False)
    div = divergences([100.0, 1.0, 1.0, 100.0])
    plan, sol = solve_plan(build_problem(linear_modules(DIMS, 8), div, cfg), cfg)
    assert flop_fractions(plan, DIMS).fp4 == pytest.approx(sol.fp4_fraction)
    assert sol.fp4_fraction >= 0.5 - 1e-9
    # FP4 goes to the insensitive middle layers; the sensitive ends stay bf16 (cost 0).
    for name in module_names(4):
        layer = int(name.split(".")[2])
        if layer in (0, 3):
            assert plan[name] == Precision.uniform("bf16")
        else:
            assert plan[name] == Precision.uniform("nvfp4")


def test_per_stage_budget_moves_fp4_into_every_stage():
    div = divergences([1.0, 1.0, 100.0, 100.0])
    mods = linear_modules(DIMS, 8, PipelineLayout(4, 2))
    glob = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False)
    stage = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=True)
    plan_g, _ = solve_plan(build_problem(mods, div, glob), glob)
    plan_s, sol_s = solve_plan(build_problem(mods, div, stage), stage)
    stage1 = [n for n in module_names(4) if int(n.split(".")[2]) >= 2]
    assert flop_fractions(plan_g, DIMS, stage1).fp4 == 0.0
    assert flop_fractions(plan_s, DIMS, stage1).fp4 >= 0.5 - 1e-9
    assert min(sol_s.stage_fp4_fraction.values()) >= 0.5 - 1e-9


def test_split_mode_chooses_passes_separately():
    loss = {n: {"bf16": 0.0, "fp8": 0.0, "nvfp4": 0.0} for n in module_names(4)}   # forward FP4 is free
    update = {n: {"bf16": 0.0, "fp8": 0.0, "nvfp4": 50.0} for n in module_names(4)}  # backward FP4 is costly
    cfg = PlannerConfig(formats=FORMATS, fp4_target=1 / 3, per_stage=False, split_passes=True)
    plan, sol = solve_plan(build_problem(linear_modules(DIMS, 8), tables(loss, update), cfg), cfg)
    assert all(plan[n].fwd == "nvfp4" and plan[n].bwd != "nvfp4" for n in module_names(4))
    assert sol.objective == pytest.approx(0.0)


def test_switch_penalty_keeps_the_current_plan():
    div = divergences([1.0, 1.0, 1.0, 1.0])
    current = PrecisionPlan.uniform("nvfp4")
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False, switch_penalty=10.0)
    plan, _ = solve_plan(build_problem(linear_modules(DIMS, 8), div, cfg, current), cfg)
    assert all(plan[n] == Precision.uniform("nvfp4") for n in module_names(4))


# -- budgets in time: the non-FP4 remainder ---------------------------------------------------------

BLACKWELL = {"bf16": 1.0, "fp8": 2.0, "nvfp4": 4.0}


def four_modules(flops):
    return [LinearModule(f"decoder.layers.{i}.mlp.linear_fc1", i, f, f, f) for i, f in enumerate(flops)]


def joint(cost):
    return CostTables(joint=cost, forward=cost, backward=cost)


def test_implied_time_target_is_the_baselines_time():
    mods = four_modules([1.0] * 4)
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.75, per_stage=False, speed=BLACKWELL)
    assert implied_time_target(mods, cfg) == pytest.approx(0.75 / 4 + 0.25 / 2)
    # FP4 no faster than FP8 (emulated on Hopper): one unit's overshoot of the target is allowed for.
    hopper = replace(cfg, speed={"bf16": 1.0, "fp8": 2.0, "nvfp4": 1.0})
    assert implied_time_target(mods, hopper) == pytest.approx(0.75 + 0.25 / 2 + (1 - 0.5) * 0.25)


def test_remainder_goes_to_fp8_not_bf16():
    """Four equal modules, FP4 hurts m_i by i + 1, FP8 by 0.01, BF16 not at all. At 50% FP4 the
    divergence-only ILP leaves the other half in BF16 (0 cost); with the time the baselines take
    (0.5 / 4 + 0.5 / 2 of BF16) it must run them in FP8: BF16 cannot be paid for here."""
    cost = {f"decoder.layers.{i}.mlp.linear_fc1": {"bf16": 0.0, "fp8": 0.01, "nvfp4": i + 1.0} for i in range(4)}
    names = list(cost)
    old = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False)
    plan, _ = solve_plan(build_problem(four_modules([1.0] * 4), joint(cost), old), old)
    assert [str(plan[n]) for n in names] == ["nvfp4", "nvfp4", "bf16", "bf16"]
    new = replace(old, speed=BLACKWELL)
    plan, sol = solve_plan(build_problem(four_modules([1.0] * 4), joint(cost), new), new)
    assert [str(plan[n]) for n in names] == ["nvfp4", "nvfp4", "fp8", "fp8"]
    assert sol.objective == pytest.approx(3.02) and sol.time_ratio == pytest.approx(0.375)


def test_bf16_only_where_extra_fp4_pays_for_it():
    """m3 is small (1 FLOP unit against 3) and FP8 hurts it badly (10): keeping it in BF16 costs 1 time
    unit, which putting m2 in FP4 (beyond the 50% target) pays for. Optimum, by enumeration of all 81
    plans: m0..m2 in nvfp4, m3 in bf16, divergence 6."""
    flops = [3.0, 3.0, 3.0, 1.0]
    cost = {f"decoder.layers.{i}.mlp.linear_fc1": {"bf16": 0.0, "fp8": 10.0 if i == 3 else 0.01, "nvfp4": i + 1.0}
            for i in range(4)}
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False, speed=BLACKWELL)
    plan, sol = solve_plan(build_problem(four_modules(flops), joint(cost), cfg), cfg)
    names = list(cost)
    assert [str(plan[n]) for n in names] == ["nvfp4", "nvfp4", "nvfp4", "bf16"]
    budget = implied_time_target(four_modules(flops), cfg)
    best = min(
        (sum(cost[n][f] for n, f in zip(names, combo)), combo) for combo in itertools.product(FORMATS, repeat=4)
        if sum(w for w, f in zip(flops, combo) if f == "nvfp4") / 10 >= 0.5
        and sum(w / BLACKWELL[f] for w, f in zip(flops, combo)) / 10 <= budget + 1e-12)
    assert best == (6.0, ("nvfp4", "nvfp4", "nvfp4", "bf16")) and sol.objective == pytest.approx(6.0)


def test_time_target_given_replaces_the_implied_one():
    cost = {f"decoder.layers.{i}.mlp.linear_fc1": {"bf16": 0.0, "fp8": 0.01, "nvfp4": i + 1.0} for i in range(4)}
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.0, per_stage=False, speed=BLACKWELL, time_target=0.4375)
    plan, sol = solve_plan(build_problem(four_modules([1.0] * 4), joint(cost), cfg), cfg)
    # 0.4375 = (0.25 + 0.5 + 0.5 + 0.5) / 4: one module in FP4 (the cheapest), the rest FP8.
    assert [str(plan[n]) for n in cost] == ["nvfp4", "fp8", "fp8", "fp8"]
    assert sol.time_ratio == pytest.approx(0.4375)


def test_current_formats_outside_the_candidates_are_no_obstacle():
    """--snip-formats fp8 mxfp4 with the bf16 warm-up plan in force (it crashed the first cycle)."""
    cost = {n: {"fp8": 0.01, "mxfp4": 1.0} for n in module_names(4)}
    cfg = PlannerConfig(formats=("fp8", "mxfp4"), fp4_target=0.75, per_stage=False, switch_penalty=1.0)
    plan, sol = solve_plan(build_problem(linear_modules(DIMS, 8), joint(cost), cfg,
                                         current=PrecisionPlan.uniform("bf16")), cfg)
    assert sol.fp4_fraction >= 0.75 and {p.fwd for p in plan.modules.values()} <= {"fp8", "mxfp4"}


def test_schedule_fixed_passes_are_left_out_of_the_budgets():
    """A schedule fixing the forward GEMMs in bf16: SNIP plans the backward GEMMs only, its budget
    counts their FLOPs only, and the plan carries the fixed forward precision."""
    div = divergences([1.0, 1.0, 100.0, 100.0])
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.75, per_stage=False, speed=BLACKWELL)
    fixed = {"fwd": "bf16", "bwd": None}
    problem = build_problem(linear_modules(DIMS, 8), div, cfg, fixed=fixed)
    plan, sol = solve_plan(problem, cfg, fixed)
    assert problem.split and all(u.flops == 0 for u in problem.units if u.key[1] == "fwd")
    assert all(plan[n].fwd == "bf16" for n in module_names(4))
    assert sol.fp4_fraction >= 0.75 - 1e-9  # of the backward FLOPs
    assert flop_fractions(plan, DIMS).fp4 == pytest.approx(sol.fp4_fraction * 2 / 3)
