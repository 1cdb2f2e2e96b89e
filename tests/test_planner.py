"""The planner: divergences -> ILP -> plan, in joint and split mode, per pipeline stage."""

from __future__ import annotations

import pytest

from megatron_snip.precision.flops import LlamaLinearDims, flop_fractions
from megatron_snip.precision.plan import PrecisionPlan, module_names
from megatron_snip.precision.recipes import Precision
from megatron_snip.snip.estimators import CostTables
from megatron_snip.snip.planner import PlannerConfig, build_problem, linear_modules, solve_plan

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
    mods = linear_modules(DIMS, tokens=10, pipeline_stages=2)
    assert len(mods) == 16 and {m.stage for m in mods} == {0, 1}
    fc1 = next(m for m in mods if m.name == "decoder.layers.3.mlp.linear_fc1")
    assert (fc1.stage, fc1.fprop_flops) == (1, 2 * 10 * 64 * 384)


def test_sensitive_layers_stay_high_and_target_is_met():
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False)
    div = divergences([100.0, 1.0, 1.0, 100.0])
    plan, sol = solve_plan(build_problem(linear_modules(DIMS, 8, 1), div, cfg), cfg)
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
    mods = linear_modules(DIMS, 8, pipeline_stages=2)
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
    plan, sol = solve_plan(build_problem(linear_modules(DIMS, 8, 1), tables(loss, update), cfg), cfg)
    assert all(plan[n].fwd == "nvfp4" and plan[n].bwd != "nvfp4" for n in module_names(4))
    assert sol.objective == pytest.approx(0.0)


def test_switch_penalty_keeps_the_current_plan():
    div = divergences([1.0, 1.0, 1.0, 1.0])
    current = PrecisionPlan.uniform("nvfp4")
    cfg = PlannerConfig(formats=FORMATS, fp4_target=0.5, per_stage=False, switch_penalty=10.0)
    plan, _ = solve_plan(build_problem(linear_modules(DIMS, 8, 1), div, cfg, current), cfg)
    assert all(plan[n] == Precision.uniform("nvfp4") for n in module_names(4))
